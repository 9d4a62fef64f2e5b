// The simulator in Firefox (Debian's firefox-esr, driven over WebDriver BiDi by
// puppeteer-core, since playwright-core drives only its own patched Firefox builds): serves
// wasm-demo/www as static files, opens index.html?sim, waits for the first run and reads what
// the page drew and its check. Prints one JSON line: {errors, browser, check, error, bars,
// pageRuns, layers, phone}. Used by host-native/tests/split_page.rs. Env: FIREFOX (default
// /usr/bin/firefox-esr), SHOT (a screenshot), PAGE_TIMEOUT_MS (default 120000).
import puppeteer from 'puppeteer-core';
import { collectErrors, installCountBy, phoneWidth, serveWww } from './common.mjs';

const timeout = Number(process.env.PAGE_TIMEOUT_MS || 120000);
const www = await serveWww();
const browser = await puppeteer.launch({
  browser: 'firefox',
  executablePath: process.env.FIREFOX || '/usr/bin/firefox-esr',
  headless: true,
});
const errors = [];
try {
  const page = await browser.newPage();
  collectErrors(page, errors);
  await page.setViewport({ width: 1280, height: 1000 });
  await page.goto(`${www.url}index.html?sim`);
  await installCountBy(page);
  await page.waitForFunction(
    () => window.tetherSim && window.tetherSim.runs >= 1 && !window.tetherSim.running,
    { timeout });
  const seen = await page.evaluate(() => {
    const s = window.tetherSim, count = window.countBy;
    return {
      browser: navigator.userAgent,
      check: s.outcome && s.outcome.check,
      error: s.error,
      bars: count('#timeline rect.ubatch', 'data-device'),
      pageRuns: count('#pages rect.page-run', 'data-on'),
      layers: count('#layers .layer', 'data-device'),
    };
  });
  if (process.env.SHOT) await page.screenshot({ path: process.env.SHOT, fullPage: true });
  const phone = await phoneWidth(page, (size) => page.setViewport(size));
  console.log(JSON.stringify({ errors, ...seen, phone }));
} catch (e) {
  console.log(JSON.stringify({ errors: [...errors, `firefox.mjs: ${e.message}`] }));
} finally {
  await browser.close();
  www.close();
}
