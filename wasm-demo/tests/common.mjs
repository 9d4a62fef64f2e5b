// What the page tests share: a static file server for wasm-demo/www (the simulator needs no
// tether server), Chromium's flags, console errors, counting what was drawn, a phone-sized view.
import { createServer } from 'node:http';
import { chromium } from 'playwright-core';
import { readFile } from 'node:fs/promises';
import { extname, join, normalize } from 'node:path';
import { fileURLToPath } from 'node:url';

const www = fileURLToPath(new URL('../www/', import.meta.url));
const types = { '.html': 'text/html', '.js': 'text/javascript', '.css': 'text/css',
                '.wasm': 'application/wasm' };

export async function serveWww() {
  const server = createServer(async (req, res) => {
    const path = normalize(decodeURIComponent(new URL(req.url, 'http://x').pathname));
    try {
      if (path.includes('..')) throw new Error('outside www');
      const file = path.endsWith('/') ? `${path}index.html` : path;
      const body = await readFile(join(www, file));
      res.writeHead(200, { 'content-type': types[extname(file)] || 'application/octet-stream' });
      res.end(body);
    } catch {
      res.writeHead(404).end();
    }
  });
  await new Promise((done) => server.listen(0, '127.0.0.1', done));
  return { url: `http://127.0.0.1:${server.address().port}/`, close: () => server.close() };
}

// Chromium's flags for these tests: headless, and nothing that dials out (this machine's
// network is closed).
export const CHROMIUM_ARGS = ['--no-sandbox', '--headless=new', '--disable-background-networking',
                              '--disable-component-update', '--disable-sync', '--no-first-run'];

// How long a page test waits for what it expects (PAGE_TIMEOUT_MS, default 120000).
export const PAGE_TIMEOUT = Number(process.env.PAGE_TIMEOUT_MS || 120000);

// Headless Chromium with those flags (CHROMIUM, default /usr/bin/chromium).
export function launchChromium() {
  return chromium.launch({
    executablePath: process.env.CHROMIUM || '/usr/bin/chromium',
    args: CHROMIUM_ARGS,
  });
}

// Collect the page's console errors and uncaught exceptions into `errors`.
export function collectErrors(page, errors) {
  page.on('console', (m) => { if (m.type() === 'error') errors.push(m.text()); });
  page.on('pageerror', (e) => errors.push(`page error: ${e}`));
}

// Give the page `window.countBy(selector, attribute)`: how many elements match, by the value
// of the attribute (what the tests read of the layers, bars and page runs drawn).
export async function installCountBy(page) {
  await page.evaluate(`window.countBy = (sel, attr) => {
    const out = {};
    for (const e of document.querySelectorAll(sel)) {
      const k = e.getAttribute(attr);
      out[k] = (out[k] || 0) + 1;
    }
    return out;
  }`);
}

// The page's width and the screen's at a phone's size (390 x 844), after a frame.
export async function phoneWidth(page, resize) {
  await resize({ width: 390, height: 844 });
  return page.evaluate(() => new Promise((done) => requestAnimationFrame(() => done({
    width: document.documentElement.scrollWidth,
    screen: window.innerWidth,
  }))));
}
