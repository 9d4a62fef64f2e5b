// The simulator with no tether server: serves wasm-demo/www as static files from this process,
// opens index.html?sim in headless Chromium, waits for the first run, then moves the split
// layer, the host KV budget and the link and waits for each run. Reads what the page drew and
// its state (window.tetherSplit, window.tetherSim), never pixels, and prints one JSON line:
// {errors, runs: [{settings, check, split, alone, report, bars, transfers, pageRuns, layers,
// plan}], phone: {width, screen}}. Used by host-native/tests/split_page.rs:
// `node wasm-demo/tests/sim_page.mjs`. Env: CHROMIUM (default /usr/bin/chromium), SHOT and
// SHOT_PHONE (screenshots), PAGE_TIMEOUT_MS (default 120000).
import { PAGE_TIMEOUT, collectErrors, installCountBy, launchChromium, phoneWidth, serveWww } from './common.mjs';

const www = await serveWww();
const url = `${www.url}index.html?sim`;

const timeout = PAGE_TIMEOUT;
const browser = await launchChromium();
const errors = [];
const runs = [];
try {
  const page = await browser.newPage({ viewport: { width: 1280, height: 1000 } });
  collectErrors(page, errors);
  await page.goto(url);
  await installCountBy(page);

  // Wait for run number `n` to finish, then read what it drew.
  const after = async (n) => {
    await page.waitForFunction((k) => window.tetherSim && window.tetherSim.runs >= k
      && !window.tetherSim.running, n, { timeout });
    return page.evaluate(() => {
      const s = window.tetherSim, v = window.tetherSplit, count = window.countBy;
      const o = s.outcome || {};
      return {
        error: s.error,
        settings: s.settings,
        check: o.check,
        split: o.split,
        alone: o.alone,
        report: o.report,
        checkText: document.getElementById('sim-check').textContent,
        devices: v.devices,
        layers: count('#layers .layer', 'data-device'),
        bars: count('#timeline rect.ubatch', 'data-device'),
        transfers: document.querySelectorAll('#timeline line.transfer').length,
        pageRuns: count('#pages rect.page-run', 'data-on'),
        rates: [...document.querySelectorAll('#link-rates tbody tr')].map((r) => r.lastChild.textContent),
        prefill: document.getElementById('prefill-tps').textContent,
        plan: document.getElementById('plan').textContent,
      };
    });
  };
  runs.push(await after(1));
  if (process.env.SHOT) await page.screenshot({ path: process.env.SHOT, fullPage: true });

  // The split layer to 8: the helper runs half the layers.
  await page.locator('#sim-split').fill('8');
  await page.click('#sim-run');
  runs.push(await after(2));
  // Every position on the host (the slider's top), and a link of 10 Mbit/s.
  await page.locator('#sim-kv').fill('512');
  await page.selectOption('#sim-bw', '10');
  await page.click('#sim-run');
  runs.push(await after(3));

  const phone = await phoneWidth(page, (size) => page.setViewportSize(size));
  if (process.env.SHOT_PHONE) await page.screenshot({ path: process.env.SHOT_PHONE, fullPage: true });
  console.log(JSON.stringify({ errors, runs, phone }));
} catch (e) {
  console.log(JSON.stringify({ errors: [...errors, `sim_page.mjs: ${e.message}`], runs }));
} finally {
  await browser.close();
  www.close();
}
