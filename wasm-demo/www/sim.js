// The simulator (index.html?sim): a host and a helper of a small synthetic model in this tab,
// engine-core compiled to WebAssembly (wasm-demo/src/sim.rs, run in a worker: sim-worker.js),
// joined by a link simulated on a virtual clock. Each run's events are the live page's
// (docs/TELEMETRY.md), drawn by split.js; each run is also made on the host alone, and the page
// says whether the tokens and logits were the same bits. Tests read `window.tetherSim`.

const $ = (id) => document.getElementById(id);
const sim = { runs: 0, running: false, again: false, settings: null, outcome: null, error: null };
window.tetherSim = sim;

function settings() {
  const layers = parseInt($("sim-layers").value, 10);
  const prompt = parseInt($("sim-prompt").value, 10);
  const split = $("sim-split");
  split.max = layers;
  if (parseInt(split.value, 10) > layers) split.value = layers;
  const kv = $("sim-kv");
  kv.max = prompt;
  // The slider's top keeps every position on the host.
  const keepAll = parseInt(kv.value, 10) >= prompt;
  return {
    layers,
    split_layer: parseInt(split.value, 10),
    host_kv_tokens: keepAll ? null : parseInt(kv.value, 10),
    ubatch: parseInt($("sim-ubatch").value, 10),
    page_size: parseInt($("sim-page").value, 10),
    prompt_tokens: prompt,
    gen_tokens: Math.min(Math.max(parseInt($("sim-gen").value, 10) || 1, 1), 64),
    bandwidth_mbps: parseFloat($("sim-bw").value),
    latency_ms: Math.min(Math.max(parseFloat($("sim-latency").value) || 0, 0), 1000),
    helper_speed: parseFloat($("sim-speed").value),
  };
}

function label(s) {
  $("sim-split-out").textContent = s.split_layer === s.layers
    ? `${s.layers} (the helper holds pages only)` : `${s.split_layer}`;
  $("sim-kv-out").textContent = s.host_kv_tokens === null ? "all" : `${s.host_kv_tokens} tokens`;
  $("sim-speed-out").textContent = `${s.helper_speed.toFixed(1)}x`;
}

function show(out, s, draw) {
  draw.reset();
  for (const e of out.events) draw.handle(e);
  const c = out.check;
  const check = $("sim-check");
  check.className = `check ${c.tokens_identical && c.logits_identical ? "same" : "differs"}`;
  check.textContent = c.tokens_identical && c.logits_identical
    ? `Identical to the host alone: ${c.tokens.length} tokens, every logit the same bits.`
    : `Differs from the host alone: split [${c.tokens}] against [${c.alone_tokens}]` +
      (c.tokens_identical ? " (tokens equal, logits differ)" : "");
  const x = (a, b) => `${(a / b).toFixed(2)}x`;
  $("sim-figures").textContent =
    `Prefill: ${out.split.prefill_tok_s.toFixed(0)} tok/s split (simulated link, ` +
    `${out.report.on_helper} of ${out.report.ubatches} ubatches' tail layers on the helper) ` +
    `against ${out.alone.prefill_tok_s.toFixed(0)} tok/s on the host alone in this tab: ` +
    `${x(out.split.prefill_tok_s, out.alone.prefill_tok_s)}. Decode: ` +
    `${out.split.decode_tok_s.toFixed(0)} against ${out.alone.decode_tok_s.toFixed(0)} tok/s.` +
    (out.report.fallback ? ` The helper failed: ${out.report.fallback}` : "");
  sim.settings = s;
  sim.outcome = out;
}

async function run(draw) {
  const s = settings();
  label(s);
  // Settings changed during a run: run them when it ends.
  if (sim.running) {
    sim.again = true;
    return;
  }
  sim.running = true;
  $("sim-run").disabled = true;
  $("sim-check").className = "check";
  $("sim-check").textContent = "running…";
  try {
    show(JSON.parse(await simulate(JSON.stringify(s))), s, draw);
    sim.error = null;
  } catch (err) {
    sim.error = String(err);
    $("sim-check").className = "check differs";
    $("sim-check").textContent = `error: ${err}`;
  } finally {
    sim.runs++;
    sim.running = false;
    $("sim-run").disabled = false;
    if (sim.again) {
      sim.again = false;
      run(draw);
    }
  }
}

// One run at a time goes to the worker; its answer comes back as a message.
const worker = new Worker(new URL("./sim-worker.js", import.meta.url), { type: "module" });
let answered = null;
worker.onmessage = (m) => answered(m.data);
worker.onerror = (e) => answered({ error: `the simulator's worker failed: ${e.message}` });

function simulate(settings) {
  return new Promise((done, fail) => {
    answered = (a) => (a.error === undefined ? done(a.ok) : fail(new Error(a.error)));
    worker.postMessage(settings);
  });
}

export async function start(draw) {
  const form = $("sim-form");
  // Every change runs again once the visitor stops moving a slider; Run runs at once.
  let pending;
  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    clearTimeout(pending);
    run(draw);
  });
  form.addEventListener("input", () => {
    label(settings());
    clearTimeout(pending);
    pending = setTimeout(() => run(draw), 300);
  });
  await run(draw);
}
