// Nodes bound to agents on the operator page in a real Chromium, driven by
// tests/integration/page.rs: alice's node `mastodon` has drifted. The page
// marks it; when the test (told through ${ARTIFACTS}/seen-drift) sends a
// report that runs the desired artifact, the mark goes without a reload.
// Env: BERTH_URL, BERTH_TOKEN, CHROMIUM, ARTIFACTS.

import { chromium } from 'playwright-core';
import { writeFileSync } from 'node:fs';

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
  await page.waitForSelector('tr[data-node=mastodon][data-drift=running]');
  check((await page.getAttribute('tr[data-node=mastodon]', 'data-agent')) === 'reporting', 'the agent reports');
  check((await page.textContent('tr[data-node=mastodon]')).includes('drifted: running'), 'the drift is in words');
  await page.screenshot({ path: `${process.env.ARTIFACTS}/nodes.png` });
  writeFileSync(`${process.env.ARTIFACTS}/seen-drift`, '');
  await page.waitForSelector('tr[data-node=mastodon]:not([data-drift])', { timeout: 30000 });
  check(problems.length === 0, `no page errors: ${problems.join('; ')}`);
} finally {
  await browser.close();
}
