// Opens the live split page (`tether serve`'s `/`) in headless Chromium, asks one question
// through its chat box, and waits until the page has drawn the run: the answer, ubatch bars,
// page strips and link counters. Used by host-native/tests/split_page.rs:
// `node wasm-demo/tests/split_page.mjs URL PROMPT`. Reads what the page drew from the DOM and
// from its state (window.tetherSplit), never from pixels, and prints one JSON line:
// {errors, answer, hello, devices, bars, transfers, pageRuns, rates, shares, linkBefore, linkAfter,
// prefill, decode, ..., phone: {width, screen}}. Env: CHROMIUM (default /usr/bin/chromium),
// SHOT and SHOT_PHONE (save screenshots there, desktop and phone-sized), PAGE_TIMEOUT_MS
// (default 120000).
import { chromium } from 'playwright-core';
import { CHROMIUM_ARGS, collectErrors, installCountBy, phoneWidth } from './common.mjs';

const [url, prompt] = process.argv.slice(2);
if (!url || !prompt) {
  console.error('usage: node split_page.mjs URL PROMPT');
  process.exit(2);
}
const timeout = Number(process.env.PAGE_TIMEOUT_MS || 120000);
const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || '/usr/bin/chromium',
  args: CHROMIUM_ARGS,
});
const errors = [];
try {
  const page = await browser.newPage({ viewport: { width: 1280, height: 900 } });
  collectErrors(page, errors);
  await page.goto(url);
  await installCountBy(page);
  await page.waitForFunction(() => window.tetherSplit && window.tetherSplit.hello, null, { timeout });
  // The link counters as they were before the question (after the first two samples).
  await page.waitForFunction(() => window.tetherSplit.linkBytes !== undefined, null, { timeout });
  const linkBefore = await page.evaluate(() => window.tetherSplit.linkBytes);

  await page.fill('#max-tokens', '12');
  await page.fill('#prompt', prompt);
  await page.click('#send');
  await page.waitForFunction(() => window.tetherSplit.decode !== null, null, { timeout });
  await page.waitForFunction(() => !document.getElementById('send').disabled, null, { timeout });
  // A link sample after the run, and the timeline drawn.
  await page.waitForFunction(
    (before) => window.tetherSplit.linkBytes > before
      && document.querySelectorAll('#timeline rect.ubatch').length > 0,
    linkBefore, { timeout });

  const seen = await page.evaluate(() => {
    const v = window.tetherSplit, count = window.countBy;
    const messages = [...document.querySelectorAll('#messages .msg')];
    return {
      answer: messages.length ? messages[messages.length - 1].textContent : '',
      answerClass: messages.length ? messages[messages.length - 1].className : '',
      hello: { model: v.hello.model, layers: v.hello.layers.length, plan: v.hello.plan.length > 0 },
      devices: v.devices,
      layersDrawn: count('#layers .layer', 'data-device'),
      bars: count('#timeline rect.ubatch', 'data-device'),
      transfers: document.querySelectorAll('#timeline line.transfer').length,
      pageRuns: count('#pages rect.page-run', 'data-on'),
      rates: document.querySelectorAll('#link-rates tbody tr').length,
      shares: [...document.querySelectorAll('#link-rates tbody tr')].map((r) => r.lastChild.textContent),
      linkAfter: v.linkBytes,
      prefill: document.getElementById('prefill-tps').textContent,
      decode: document.getElementById('decode-tps').textContent,
      pipeline: document.getElementById('pipeline-figures').textContent,
      memory: document.querySelectorAll('#memory > div').length,
      plan: document.getElementById('plan').textContent,
    };
  });
  if (process.env.SHOT) await page.screenshot({ path: process.env.SHOT, fullPage: true });
  // A phone-sized screen: one column, nothing wider than the screen.
  const phone = await phoneWidth(page, (size) => page.setViewportSize(size));
  if (process.env.SHOT_PHONE) {
    await page.screenshot({ path: process.env.SHOT_PHONE, fullPage: true });
  }
  console.log(JSON.stringify({ errors, linkBefore, ...seen, phone }));
} catch (e) {
  console.log(JSON.stringify({ errors: [...errors, `split_page.mjs: ${e.message}`] }));
} finally {
  await browser.close();
}
