// Opens the live split page (`tether serve`'s `/`) in headless Chromium, asks one question
// through its chat box, and waits until the page has drawn the run: the answer, ubatch bars,
// page strips and link counters. Used by host-native/tests/split_page.rs:
// `node wasm-demo/tests/split_page.mjs URL PROMPT CODE`. Before the question it reads the
// helper cards (the native helper joined before the page opened; no request has run); after
// it, a browser tab joins with CODE at a phone's width, shows on the split page at once as a
// second card, and leaves with its Leave button. Reads what the page drew from the DOM and
// from its state (window.tetherSplit), never from pixels, and prints one JSON line:
// {errors, answer, hello, devices, bars, transfers, pageRuns, rates, shares, linkBefore, linkAfter,
// prefill, decode, ..., phone: {width, screen}}. Env: CHROMIUM (default /usr/bin/chromium),
// SHOT and SHOT_PHONE (save screenshots there, desktop and phone-sized), PAGE_TIMEOUT_MS
// (default 120000).
import { PAGE_TIMEOUT, collectErrors, installCountBy, launchChromium, phoneWidth } from './common.mjs';

const [url, prompt, code] = process.argv.slice(2);
if (!url || !prompt || !code) {
  console.error('usage: node split_page.mjs URL PROMPT CODE');
  process.exit(2);
}
const timeout = PAGE_TIMEOUT;
const browser = await launchChromium();
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
  // The helper that joined, as a card, before any request.
  await page.waitForFunction(() => document.querySelectorAll('#helpers .card').length > 0, null, { timeout });
  const cardsBefore = await page.evaluate(readCards);
  // Every text the decode figure shows while the answer comes.
  await page.evaluate(() => {
    window.decodeTexts = [];
    new MutationObserver(() => window.decodeTexts.push(document.getElementById('decode-tps').textContent))
      .observe(document.getElementById('decode-tps'), { childList: true, characterData: true, subtree: true });
  });

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
      slower: document.getElementById('pipeline-figures').classList.contains('slower'),
      speedup: v.speedup,
      ticks: [...document.querySelectorAll('#timeline text.tick')].map((t) => t.textContent),
      layerNumbers: [...document.querySelectorAll('#layers .layer')].map((l) => l.textContent),
      pageEnds: document.querySelector('#pages .ends')?.textContent || '',
      pageFigures: document.getElementById('pages-figures').textContent,
      decodeTexts: window.decodeTexts,
      memory: document.querySelectorAll('#memory > div').length,
      plan: document.getElementById('plan').textContent,
    };
  });
  // Two link samples later the rates are back to 0; the totals are not.
  const sample = await page.evaluate(() => window.tetherSplit.link.at_ms);
  await page.waitForFunction((at) => window.tetherSplit.link.at_ms > at + 600, sample, { timeout });
  const totalsAfter = await page.evaluate(() => [...document.querySelectorAll('#link-rates tbody tr')]
    .reduce((s, r) => s + Number(r.dataset.total), 0));
  if (process.env.SHOT) await page.screenshot({ path: process.env.SHOT, fullPage: true });
  const tab = await joinTab(page, errors);
  // A phone-sized screen: one column, nothing wider than the screen.
  const phone = await phoneWidth(page, (size) => page.setViewportSize(size));
  if (process.env.SHOT_PHONE) {
    await page.screenshot({ path: process.env.SHOT_PHONE, fullPage: true });
  }
  console.log(JSON.stringify({ errors, linkBefore, cardsBefore, totalsAfter, tab, ...seen, phone }));
} catch (e) {
  console.log(JSON.stringify({ errors: [...errors, `split_page.mjs: ${e.message}`] }));
} finally {
  await browser.close();
}

// The helper cards of the split page: each card's device and fields.
function readCards() {
  return [...document.querySelectorAll('#helpers .card')].map((c) => {
    const fields = { device: c.dataset.device };
    for (const dd of c.querySelectorAll('dd')) fields[dd.dataset.field] = dd.textContent;
    return fields;
  });
}

// A browser tab joins at a phone's width (its CPU backend) while the split page watches: the
// page's cards right after it joined, the helper page's width, and its status once it left.
async function joinTab(split, errors) {
  const tab = await browser.newPage({ viewport: { width: 390, height: 844 } });
  collectErrors(tab, errors);
  await tab.goto(`${url}helper/?code=${code}&backend=cpu&join=1`);
  await tab.waitForFunction(() => document.getElementById('status').textContent.startsWith('serving'),
    null, { timeout });
  await split.waitForFunction(() => document.querySelectorAll('#helpers .card').length > 1, null, { timeout });
  const cards = await split.evaluate(readCards);
  const width = await tab.evaluate(() => document.documentElement.scrollWidth);
  if (process.env.SHOT_TAB) await tab.screenshot({ path: process.env.SHOT_TAB, fullPage: true });
  await tab.click('#leave');
  await tab.waitForFunction(() => document.getElementById('status').textContent === 'left the host',
    null, { timeout });
  const left = await tab.evaluate(() => ({
    status: document.getElementById('status').textContent,
    join: new URLSearchParams(location.search).get('join'),
    leaveDisabled: document.getElementById('leave').disabled,
  }));
  return { cards, width, left };
}
