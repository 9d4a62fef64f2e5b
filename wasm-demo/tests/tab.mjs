// Opens helper pages in headless Chromium and waits until each says its session ended (or
// failed). Used by host-native/tests/tab.rs: `node wasm-demo/tests/tab.mjs URL [URL...]`, each
// URL a helper.html with its host and code in the query string and join=1. Every page gets a
// browser context of its own (its own localStorage, as separate browsers would have), unless
// TAB_PROFILE names a profile directory, which every page then shares and which outlives the
// run (a later run is the same browser's next visit). Prints one JSON line per page on stdout:
// {state, status, backend, pages, queries, chunks, fetched, cached}; the pages' console goes
// to stderr.
//
// Env: CHROMIUM (default /usr/bin/chromium), TAB_TIMEOUT_MS (default 240000),
// TAB_CLOSE_AFTER_QUERIES=N closes the first page once it answered N attention queries (a tab
// closed mid-decode) and reports it as state "closed".
import { chromium } from 'playwright-core';

const urls = process.argv.slice(2);
if (urls.length === 0) {
  console.error('usage: node tab.mjs URL [URL...]');
  process.exit(2);
}
const timeout = Number(process.env.TAB_TIMEOUT_MS || 240000);
const closeAfter = Number(process.env.TAB_CLOSE_AFTER_QUERIES || 0);

const options = {
  executablePath: process.env.CHROMIUM || '/usr/bin/chromium',
  args: [
    '--no-sandbox',
    '--headless=new',
    '--enable-unsafe-webgpu',
    '--enable-features=Vulkan',
    '--use-angle=swiftshader',
    '--use-webgpu-adapter=swiftshader',
    '--disable-gpu-sandbox',
    '--disable-background-networking',
    '--disable-component-update',
    '--disable-sync',
    '--no-first-run',
    '--disable-quic',
  ],
};
const profile = process.env.TAB_PROFILE;
const shared = profile ? await chromium.launchPersistentContext(profile, options) : null;
const browser = shared ? null : await chromium.launch(options);
const newContext = async () => shared || browser.newContext();
const closeContext = async (context) => { if (!shared) await context.close(); };

const readState = () => ({
  state: document.body.dataset.state,
  status: document.getElementById('status').textContent,
  backend: document.getElementById('backend-name').textContent,
  pages: Number(document.getElementById('pages').textContent),
  queries: Number(document.getElementById('queries').textContent),
  chunks: Number(document.getElementById('chunks').textContent),
  fetched: Number(document.getElementById('fetched').textContent),
  cached: Number(document.getElementById('cached').textContent),
});

async function run(url, i) {
  const context = await newContext();
  const page = await context.newPage();
  page.on('console', (m) => console.error(`[tab ${i}] ${m.text()}`));
  page.on('pageerror', (e) => console.error(`[tab ${i}] page error: ${e}`));
  await page.goto(url);
  if (i === 0 && closeAfter > 0) {
    await page.waitForFunction(
      (n) => Number(document.getElementById('queries').textContent) >= n,
      closeAfter, { timeout, polling: 10 });
    const seen = await page.evaluate(readState);
    await page.close();
    await closeContext(context);
    return { ...seen, state: 'closed' };
  }
  await page.waitForFunction(
    () => ['ended', 'error'].includes(document.body.dataset.state), null, { timeout });
  const seen = await page.evaluate(readState);
  await page.close();
  await closeContext(context);
  return seen;
}

let failed = false;
try {
  const results = await Promise.all(urls.map(run));
  for (const r of results) console.log(JSON.stringify(r));
} catch (e) {
  console.error(`tab.mjs: ${e}`);
  failed = true;
} finally {
  await (shared || browser).close();
}
process.exit(failed ? 1 : 0);
