// The helper page: fills the form from the query string (?host=ws://...&code=...&backend=...;
// &join=1 joins on load), runs TabHelper.join and shows its events. Served by a host at
// /helper/, the host field defaults to that host. The page's state is in
// document.body.dataset.state (idle, joining, ended, error, left) for whoever watches it.
import init, { TabHelper } from './pkg/wasm_demo.js';

const $ = (id) => document.getElementById(id);
const params = new URLSearchParams(location.search);
if (location.pathname.startsWith('/helper/') && location.protocol.startsWith('http')) {
  const ws = location.protocol === 'https:' ? 'wss:' : 'ws:';
  $('host').value = `${ws}//${location.host}/helper`;
}
for (const id of ['host', 'code', 'backend', 'mem']) {
  if (params.has(id)) $(id).value = params.get(id);
}
document.body.dataset.state = 'idle';

function log(text) {
  $('log').textContent += text + '\n';
  console.log(text);
}

function onEvent(json) {
  const e = JSON.parse(json);
  switch (e.kind) {
    case 'status': $('status').textContent = e.text; break;
    case 'backend': $('backend-name').textContent = e.name; break;
    case 'paired': $('status').textContent = `paired with the host (key ${e.host})`; break;
    case 'model': $('model').textContent = `${e.name} (${e.digest.slice(0, 12)})`; break;
    case 'stats':
      $('pages').textContent = e.pages;
      $('held').textContent = e.held_bytes;
      $('queries').textContent = e.queries;
      $('chunks').textContent = e.prefill_chunks;
      $('fetched').textContent = e.weights_fetched;
      $('fetched-bytes').textContent = e.weights_fetched_bytes;
      $('cached').textContent = e.weights_cached;
      return;
    case 'ended': $('status').textContent = `session ended: ${e.why}`; break;
    case 'error': $('status').textContent = `error: ${e.text}`; break;
  }
  log(json);
}

async function join() {
  $('go').disabled = true;
  $('leave').disabled = false;
  document.body.dataset.state = 'joining';
  try {
    await init();
    const mem = Number($('mem').value) * 1024 * 1024;
    await TabHelper.join($('host').value, $('code').value || null, $('backend').value, mem,
                         onEvent);
    document.body.dataset.state = 'ended';
  } catch (err) {
    log(`error: ${err}`);
    document.body.dataset.state = 'error';
  } finally {
    $('go').disabled = false;
    $('leave').disabled = true;
  }
}

// Leave: the session lives in this page's WebSocket, so the page ends it by loading itself
// afresh (the browser closes the socket, the host loses this helper and carries on: its
// pages are attended from the host's page file). The form keeps what was entered, without
// &join=1, so the page does not join again.
function leave() {
  document.body.dataset.state = 'left';
  const again = new URLSearchParams();
  for (const id of ['host', 'backend', 'mem']) again.set(id, $(id).value);
  again.set('left', '1');
  location.replace(`${location.pathname}?${again}`);
}

if (params.get('left') === '1') $('status').textContent = 'left the host';

$('join').addEventListener('submit', (ev) => { ev.preventDefault(); join(); });
$('leave').addEventListener('click', leave);
if (params.get('join') === '1') join();
