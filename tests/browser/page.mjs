// The operator page in a real Chromium, driven by tests/integration/page.rs.
// Env: BERTH_URL (the page, through a proxy the Rust test can cut),
// BERTH_TOKEN, CHROMIUM (executable), ARTIFACTS (a directory for screenshots).
// Protocol on stdout: "cut" asks the Rust test to drop every connection;
// the Rust test answers on stdin with "cut done". The last line is
// "result <json>" with the figures. Any failure exits non-zero with why.

import { chromium } from 'playwright-core';
import { createInterface } from 'node:readline';

const base = process.env.BERTH_URL;
const token = process.env.BERTH_TOKEN;
const artifacts = process.env.ARTIFACTS;
const stdin = createInterface({ input: process.stdin });
const answers = [];
let waiting = null;
stdin.on('line', (l) => (waiting ? (waiting(l), (waiting = null)) : answers.push(l)));
const ask = (what) =>
  new Promise((resolve) => {
    console.log(what);
    if (answers.length) resolve(answers.shift());
    else waiting = resolve;
  });

function check(cond, what) {
  if (!cond) throw new Error(`check failed: ${what}`);
}

async function api(method, path, body) {
  const r = await fetch(base + path, {
    method,
    headers: { Authorization: `Bearer ${token}`, 'Content-Type': 'application/json', 'Idempotency-Key': `t-${Math.random().toString(16).slice(2)}-key` },
    body: body ? JSON.stringify(body) : undefined,
  });
  return { status: r.status, text: await r.text() };
}

const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM,
  args: ['--no-sandbox', '--disable-dev-shm-usage'],
});
const figures = {};
try {
  const context = await browser.newContext({ viewport: { width: 1100, height: 800 }, colorScheme: 'light' });
  const page = await context.newPage();
  const problems = [];
  // A refused request is logged by Chromium as a failed resource (the 401,
  // 404 and 422 here are on purpose, and so is the cut); anything else,
  // a CSP violation first of all, is a problem.
  page.on('console', (m) => m.type() === 'error' && !m.text().startsWith('Failed to load resource') && problems.push(m.text()));
  page.on('pageerror', (e) => problems.push(String(e)));
  page.on('dialog', (d) => d.accept());

  // Sign in: a refused token gets the 401 screen, the right one the list.
  await page.goto(base + '/');
  await page.fill('#token', 'not-the-token');
  await page.click('button[type=submit]');
  await page.waitForSelector('body[data-screen=unauthorized]');
  check((await page.textContent('[role=alert]')).includes('401'), 'the 401 screen says 401');
  check(!page.url().includes('not-the-token'), 'no token in the URL');
  await page.fill('#token', token);
  await page.press('#token', 'Enter'); // keyboard alone
  await page.waitForSelector('h1:text("Deployments")');
  check(await page.evaluate(() => sessionStorage.getItem('berth.token')) !== null, 'token in sessionStorage');
  check((await context.cookies()).length === 0, 'no cookie');

  // A 422 is shown next to its pointer.
  await page.goto(base + '/#/new?id=web');
  await page.waitForSelector('#configuration');
  await page.fill('#configuration', '{"domain": 5}');
  await page.click('button[type=submit]');
  await page.waitForSelector('li[data-pointer="/configuration/domain"]');
  // Preview, then submit: the page follows the build live.
  await page.fill('#configuration', '{"domain":"web.example.org","lines":1000}');
  await page.click('button:text("Preview")');
  await page.waitForSelector('h2:text("Preview")');
  await page.click('button[type=submit]');
  await page.waitForURL(/#\/b\//);
  const firstWeb = page.url().split('#/b/')[1];
  await page.waitForSelector('#log');
  // Time from the deployer's write (each line carries it) to the DOM.
  await page.evaluate(() => {
    window.latencies = [];
    const log = document.getElementById('log');
    // Lines already shown when the observer starts (a fast start can
    // render some before this runs) are counted, not timed.
    window.early = [...(log.textContent || '').matchAll(/t=(\d+)/g)].length;
    new MutationObserver((records) => {
      const now = Date.now();
      for (const r of records)
        for (const n of r.addedNodes)
          for (const m of (n.textContent || '').matchAll(/t=(\d+)/g)) window.latencies.push(now - Number(m[1]));
    }).observe(log, { childList: true });
  });
  await page.waitForSelector('#log[data-ended=true]', { timeout: 60000 });
  const lat = (await page.evaluate(() => window.latencies)).sort((a, b) => a - b);
  const early = await page.evaluate(() => window.early);
  check(lat.length + early === 1000, `1000 lines seen, not ${lat.length} timed and ${early} before`);
  check(lat.length >= 900, `most lines timed live, not ${lat.length}`);
  figures.dom_latency_p50_ms = lat[Math.floor(lat.length * 0.5)];
  figures.dom_latency_p99_ms = lat[Math.floor(lat.length * 0.99)];
  await page.screenshot({ path: `${artifacts}/live-log.png` });

  // Every line exactly once across dropped connections: the browser
  // reconnects by itself with Last-Event-ID.
  const again = await api('POST', '/v1/deployments/cut/submit', { configuration: { domain: 'cut.example.org', lines: 1000 } });
  check(again.status === 202, `cut submit: ${again.text}`);
  const build = JSON.parse(again.text).build_id;
  await page.goto(base + `/#/b/${build}`);
  // This build's log (the last one's must not count): cut mid-build.
  const cutLog = `#log[data-build="${build}"]`;
  await page.waitForFunction((sel) => Number(document.querySelector(sel)?.dataset.lines || 0) >= 300, cutLog);
  check((await ask('cut')) === 'cut done', 'the proxy cut the connections');
  await page.waitForSelector(`${cutLog}[data-ended=true]`, { timeout: 60000 });
  const shown = await page.textContent('#log');
  const stored = await api('GET', `/v1/builds/${build}/log`);
  check(stored.status === 200, 'the log reads');
  check(shown === stored.text, `the page shows the log exactly once (page ${shown.split('\n').length} lines, store ${stored.text.split('\n').length})`);
  // The deployer's 1000 lines, beside berth's own of the health step.
  check(shown.split('\n').filter((l) => /^line \d+ t=/.test(l)).length === 1000, 'all 1000 lines');

  // The deployment page follows its channel: a new build appears unasked.
  await page.goto(base + '/#/d/web');
  await page.waitForSelector('h1:has-text("web")');
  const rowsBefore = await page.locator('table tbody tr').count();
  const second = await api('POST', '/v1/deployments/web/submit', { configuration: { domain: 'web.example.org', lines: 5 } });
  check(second.status === 202, `second submit: ${second.text}`);
  await page.waitForFunction((n) => document.querySelectorAll('table tbody tr').length > n, rowsBefore);
  await page.waitForSelector('button[data-action]', { state: 'attached' });
  await page.screenshot({ path: `${artifacts}/deployment.png`, fullPage: true });
  // A freeze shows as a banner in its own words; the rollout buttons are
  // there, disabled with their reason while no rollout runs.
  const frozen = await api('PUT', '/v1/freeze', { reason: 'release week: ask Ada' });
  check(frozen.status === 200, `freeze: ${frozen.text}`);
  await page.goto(base + '/#/b/' + firstWeb);
  await page.goto(base + '/#/d/web');
  await page.waitForSelector('[data-frozen=global]');
  check((await page.textContent('[data-frozen]')).includes('release week: ask Ada'), 'the banner quotes the freeze');
  check((await page.getAttribute('button[data-action=rollout_abort]', 'title')) === 'no_rollout', 'rollout_abort says no_rollout');
  check(await page.isDisabled('button[data-action=rollout_pause]'), 'rollout_pause is disabled');
  await page.screenshot({ path: `${artifacts}/frozen.png` });
  const lifted = await api('DELETE', '/v1/freeze');
  check(lifted.status === 200, `lift: ${lifted.text}`);
  // A disabled action says why.
  const disabled = page.locator('button[data-action]:disabled').first();
  if ((await disabled.count()) > 0) check(((await disabled.getAttribute('title')) || '').length > 0, 'a disabled action has a reason');

  // Safe deploys: the deployment shows auto_rollback; each earlier
  // succeeded build has a Rollback button.
  await page.waitForFunction(() => document.querySelector('table tbody tr .state')?.textContent === 'succeeded');
  check((await page.getAttribute('[data-auto-rollback]', 'data-auto-rollback')) === 'true', 'auto_rollback is shown');
  await page.waitForSelector(`button[data-rollback="${firstWeb}"]`);
  // A deploy that breaks its node: the build page shows its health
  // events, and the automatic rollback appears on the deployment.
  const broken = await api('POST', '/v1/deployments/web/submit', { configuration: { domain: 'web.example.org', lines: 2, unhealthy: true } });
  check(broken.status === 202, `broken submit: ${broken.text}`);
  const brokenId = JSON.parse(broken.text).build_id;
  await page.goto(base + `/#/b/${brokenId}`);
  await page.waitForSelector('#health li[data-node=web][data-healthy=false]', { timeout: 30000 });
  check((await page.textContent('#health')).includes('the page test made it unhealthy'), 'the health event shows its reason');
  await page.waitForSelector(`#log[data-build="${brokenId}"][data-ended=true]`, { timeout: 30000 });
  await page.screenshot({ path: `${artifacts}/health.png` });
  // Which worker ran a finished build: berth's own machine here.
  await page.goto(base + `/#/b/${firstWeb}`);
  await page.waitForSelector('[data-worker]', { timeout: 30000 });
  check((await page.textContent('[data-worker]')) === 'this machine', 'the page names the worker');
  await page.goto(base + '/#/d/web');
  await page.waitForSelector('tr [data-rollback-of]', { timeout: 30000 });
  // The rollback ran; then roll back by hand to the first build.
  await page.waitForFunction(() => document.querySelector('table tbody tr .state')?.textContent === 'succeeded', null, { timeout: 30000 });
  await page.waitForSelector(`button[data-rollback="${firstWeb}"]:enabled`);
  await page.screenshot({ path: `${artifacts}/rollback.png`, fullPage: true });
  await page.click(`button[data-rollback="${firstWeb}"]`);
  await page.waitForSelector(`[data-rollback-of="${firstWeb}"]`, { timeout: 30000 });
  check(!page.url().includes(brokenId), 'the page follows the new rollback build');

  // Webhooks: the page lists subscriptions and their recent deliveries.
  const hook = await api('POST', '/v1/webhooks', { url: 'http://127.0.0.1:9/hook', events: ['build.failed'], description: 'page test' });
  check(hook.status === 201, `subscribe: ${hook.text}`);
  const hookId = JSON.parse(hook.text).id;
  const ping = await api('POST', `/v1/webhooks/${hookId}/test`);
  check(ping.status === 202, `ping: ${ping.text}`);
  await page.goto(base + '/#/webhooks');
  await page.waitForSelector(`section[data-webhook="${hookId}"] tr[data-delivery]`);
  check((await page.textContent(`section[data-webhook="${hookId}"]`)).includes('ping'), 'the ping delivery is listed');
  check(!(await page.textContent('main')).includes('whsec_'), 'no secret on the page');

  // A phone: nothing wider than the screen, and dark mode reads.
  const phone = await browser.newContext({ viewport: { width: 375, height: 740 }, colorScheme: 'dark' });
  const p2 = await phone.newPage();
  await p2.goto(base + '/');
  await p2.fill('#token', token);
  await p2.press('#token', 'Enter');
  await p2.waitForSelector('h1:text("Deployments")');
  const overflow = await p2.evaluate(() => document.documentElement.scrollWidth - window.innerWidth);
  check(overflow <= 0, `the list fits a phone (overflow ${overflow}px)`);
  const bg = await p2.evaluate(() => getComputedStyle(document.body).backgroundColor);
  check(bg !== 'rgb(251, 251, 250)', `dark mode applies (${bg})`);
  await p2.screenshot({ path: `${artifacts}/phone-dark.png` });
  await phone.close();

  // A 100,000-line log stays responsive.
  const big = await api('POST', '/v1/deployments/big/submit', { configuration: { domain: 'big.example.org', fast: true } });
  check(big.status === 202, `big submit: ${big.text}`);
  const bigId = JSON.parse(big.text).build_id;
  // A long log the build has written: the page reads it in one request
  // and follows the channel from the cursor the answer gives.
  for (let i = 0; i < 600; i++) {
    const b = JSON.parse((await api('GET', `/v1/builds/${bigId}`)).text);
    if (b.finished_at) break;
    await new Promise((r) => setTimeout(r, 100));
  }
  const t0 = Date.now();
  await page.goto(base + `/#/b/${bigId}`);
  await page.evaluate(() => {
    window.maxGap = 0;
    let last = performance.now();
    const tick = (t) => {
      window.maxGap = Math.max(window.maxGap, t - last);
      last = t;
      if (!document.getElementById('log')?.dataset.ended) requestAnimationFrame(tick);
    };
    requestAnimationFrame(tick);
  });
  const bigLog = `#log[data-build="${bigId}"]`;
  await page.waitForSelector(`${bigLog}[data-ended=true]`, { timeout: 120000 });
  // The deployer's 100,000 lines and berth's few of the health step.
  await page.waitForFunction((sel) => Number(document.querySelector(sel).dataset.lines) >= 100000, bigLog, { timeout: 60000 });
  const bigLines = (await page.textContent(bigLog)).split('\n').filter((l) => l.startsWith('fast line ')).length;
  check(bigLines === 100000, `all 100,000 deployer lines shown, not ${bigLines}`);
  figures.big_log_seconds = (Date.now() - t0) / 1000;
  figures.big_log_max_frame_gap_ms = Math.round(await page.evaluate(() => window.maxGap));

  // Cancel and delete through the page.
  await page.goto(base + '/#/d/big');
  await page.waitForSelector('button.danger:text("Delete")');
  await page.click('button.danger:text("Delete")');
  await page.waitForFunction(() => /destroying|idle|No such deployment/.test(document.querySelector('main').textContent));

  check(problems.length === 0, `no console errors (CSP included): ${problems.join(' | ')}`);
  console.log('result ' + JSON.stringify(figures));
} finally {
  await browser.close();
  stdin.close();
}
