// A rollout on the operator page in a real Chromium, driven by
// tests/integration/page.rs: the deployment `alice` is paused after its
// first wave. The page shows the rollout and its waves; its resume button
// finishes it. Env: BERTH_URL, BERTH_TOKEN, CHROMIUM, ARTIFACTS.

import { chromium } from 'playwright-core';

const base = process.env.BERTH_URL;
function check(cond, what) {
  if (!cond) throw new Error(`check failed: ${what}`);
}

const browser = await chromium.launch({ executablePath: process.env.CHROMIUM, args: ['--no-sandbox', '--disable-dev-shm-usage'] });
try {
  const page = await browser.newPage({ viewport: { width: 1100, height: 800 } });
  const problems = [];
  page.on('pageerror', (e) => problems.push(String(e)));
  await page.goto(base + '/');
  await page.fill('#token', process.env.BERTH_TOKEN);
  await page.press('#token', 'Enter');
  await page.waitForSelector('h1:text("Deployments")');
  await page.goto(base + '/#/d/alice');
  await page.waitForSelector('[data-rollout=paused]');
  check((await page.textContent('[data-rollout]')).includes('wave 1 of 2'), 'wave 1 of 2');
  check((await page.locator('ol.waves li').count()) === 2, 'two waves listed');
  check((await page.locator('[data-node-state=activated]').count()) === 1, 'one node activated');
  check((await page.locator('[data-node-state=pending]').count()) === 1, 'one node pending');
  check(await page.isDisabled('button[data-action=rollout_pause]'), 'pause is disabled while paused');
  await page.screenshot({ path: `${process.env.ARTIFACTS}/rollout.png` });
  await page.click('button[data-action=rollout_resume]');
  await page.waitForSelector('[data-rollout=finished]', { timeout: 30000 });
  check((await page.textContent('[data-rollout]')).includes('succeeded'), 'the rollout succeeded');
  check(problems.length === 0, `no page errors: ${problems.join('; ')}`);
} finally {
  await browser.close();
}
