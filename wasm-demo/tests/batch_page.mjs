// Opens the live split page of a `tether serve --parallel N` server in headless Chromium, sends
// several completions at once from the page's origin, and reads what the page drew of the
// batch from the `batch` telemetry events: the most requests one step held, steps that ran a
// prefill ubatch beside decode rows, the columns of the batch strip and its caption. Used by
// host-native/tests/split_page.rs: `node wasm-demo/tests/batch_page.mjs URL REQUESTS`. Prints
// one JSON line: {errors, steps, most, mixed, columns, segments, figures, answers}. Env:
// CHROMIUM (default /usr/bin/chromium), SHOT (a screenshot there), PAGE_TIMEOUT_MS (120000).
import { PAGE_TIMEOUT, collectErrors, launchChromium } from './common.mjs';

const [url, requests] = process.argv.slice(2);
if (!url || !requests) {
  console.error('usage: node batch_page.mjs URL REQUESTS');
  process.exit(2);
}
const timeout = PAGE_TIMEOUT;
const browser = await launchChromium();
const errors = [];
try {
  const page = await browser.newPage({ viewport: { width: 1280, height: 900 } });
  collectErrors(page, errors);
  await page.goto(url);
  await page.waitForFunction(() => window.tetherSplit && window.tetherSplit.hello, null, { timeout });
  // Every step the page was told of, not only the latest it keeps.
  await page.evaluate(() => {
    window.allSteps = [];
    const es = new EventSource('/v1/telemetry');
    es.onmessage = (m) => { const e = JSON.parse(m.data); if (e.type === 'batch') window.allSteps.push(e); };
  });
  const answers = await page.evaluate(async (n) => {
    const model = window.tetherSplit.hello.model;
    const one = async (i) => {
      const r = await fetch('/v1/completions', {
        method: 'POST',
        headers: { 'content-type': 'application/json' },
        body: JSON.stringify({ model, prompt: `request ${i}: ${'ab'.repeat(20 + 9 * i)}`, max_tokens: 24 }),
      });
      return (await r.json()).usage?.completion_tokens ?? -1;
    };
    return Promise.all([...Array(n).keys()].map(one));
  }, Number(requests));
  await page.waitForFunction(() => document.querySelectorAll('#batch .step').length > 0, null, { timeout });
  // The page draws at most one frame later than the last event.
  await page.waitForTimeout(300);
  if (process.env.SHOT) await page.screenshot({ path: process.env.SHOT, fullPage: true });
  const seen = await page.evaluate(() => {
    const steps = window.allSteps;
    return {
      steps: steps.length,
      most: Math.max(0, ...steps.map((s) => s.requests)),
      mixed: steps.filter((s) => s.rows.some((r) => r.prefill) && s.rows.some((r) => !r.prefill)).length,
      kept: window.tetherSplit.steps.length,
      columns: document.querySelectorAll('#batch .step').length,
      segments: document.querySelectorAll('#batch .step i').length,
      drawnRows: window.tetherSplit.steps.reduce((n, s) => n + s.rows.length, 0),
      figures: document.getElementById('batch-figures').textContent,
    };
  });
  console.log(JSON.stringify({ errors, answers, ...seen }));
} finally {
  await browser.close();
}
