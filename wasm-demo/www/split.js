// The view of a split (served by `tether serve` at /, or opened as static files): the split
// drawn from telemetry events (docs/TELEMETRY.md is the schema this reads) and, beside it,
// either a chat box on the OpenAI endpoint with the events of /v1/telemetry (live), or, with
// `?sim`, the simulator (sim.js), whose engine in this tab emits the same events. Plain DOM and
// SVG: the page needs no framework. Everything drawn comes from `view`, which tests read as
// `window.tetherSplit`.

const fresh = () => ({
  hello: null,
  devices: [],
  pages: null,
  ubatches: [],
  transfers: [],
  link: null,
  rates: [],
  prefill: null,
  decode: null,
  // The answer being generated: its first token's time and the tokens since (live decode).
  answer: null,
  // The answer's draft checks so far (--draft): tokens drafted, kept, and passes.
  drafts: null,
  // Pages held per place, from the latest `pages` event.
  held: {},
  // --parallel: the latest steps' rows per request (`batch` events), oldest first.
  steps: [],
  events: 0,
});
const view = fresh();
window.tetherSplit = view;

const $ = (id) => document.getElementById(id);
// The server: this page's own, or `?server=http://HOST:PORT` when the page is opened as a
// static file (that server then needs `--cors` for this page's origin).
const server = (new URLSearchParams(location.search).get("server") || "").replace(/\/$/, "");
const SVG = "http://www.w3.org/2000/svg";
const PALETTE = ["#e07b26", "#2aa876", "#b04fc9", "#c9a227", "#d0435b", "#3aa6b9"];

function svg(tag, attrs) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  return e;
}

function colour(place) {
  if (place === "host") return "var(--host)";
  if (place === "disk") return "var(--disk)";
  const known = view.devices.map((d) => d.device);
  const i = known.indexOf(place);
  return PALETTE[(i < 0 ? parseInt(place.split(":")[1] || "0", 10) : i) % PALETTE.length];
}

function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB"];
  let u = 0;
  while (n >= 1024 && u < units.length - 1) { n /= 1024; u++; }
  return `${n.toFixed(u ? 1 : 0)} ${units[u]}`;
}

// --- The layer stack: who runs each layer. ---
function drawLayers() {
  const h = view.hello;
  if (!h) return;
  const prefill = view.devices.find((d) => d.prefill_layers);
  const split = prefill ? prefill.prefill_layers[0] : null;
  const box = $("layers");
  box.replaceChildren();
  h.layers.forEach((kind, i) => {
    const d = document.createElement("div");
    const on = split !== null && i >= split ? prefill.device : "host";
    d.className = `layer ${kind === "full_attention" ? "full" : "linear"}${i === split ? " split" : ""}`;
    d.style.background = colour(on);
    d.title = `layer ${i}: ${kind.replace("_", " ")} on ${on}`;
    d.textContent = i;
    d.dataset.device = on;
    box.append(d);
  });
  $("split-at").textContent = split === null
    ? `(${h.layers.length}, all on the host)`
    : `(${h.layers.length}; prefill splits at layer ${split})`;
  const legend = $("legend");
  legend.replaceChildren();
  for (const place of ["host", ...view.devices.map((d) => d.device), "disk"]) {
    const s = document.createElement("span");
    s.innerHTML = `<i style="background:${colour(place)}"></i>${place}`;
    legend.append(s);
  }
  drawHelpers();
}

// --- A card per helper: its kind, how it came, its backend, link round trip, layers, memory. ---
function drawHelpers() {
  const box = $("helpers");
  box.replaceChildren();
  if (!view.devices.length) {
    const p = document.createElement("p");
    p.className = "dim";
    p.textContent = "No helper yet: one that joins (tether-helper --join ws://HOST:PORT/helper, " +
      "or a browser tab at /helper) appears here at once.";
    box.append(p);
    return;
  }
  const pageBytes = view.pages && view.hello ? view.pages.page_size * view.hello.kv_bytes_per_position : 0;
  for (const d of view.devices) {
    const held = (view.held[d.device] || 0) * pageBytes;
    const fields = {
      kind: d.kind || "-",
      came: d.source === "dialed" ? "dialed by this server" : d.source === "joined" ? "joined this server" : "-",
      backend: d.backend || "-",
      "link round trip": d.rtt_ms == null ? "-" : `${d.rtt_ms.toFixed(2)} ms`,
      layers: d.prefill_layers ? `${d.prefill_layers[0]}–${d.prefill_layers[1] - 1} in a split prefill` : "none (pages only)",
      memory: `${bytes(held)} of KV held, ${bytes(d.offer_bytes)} offered`,
    };
    const card = document.createElement("div");
    card.className = "card";
    card.dataset.device = d.device;
    card.style.borderColor = colour(d.device);
    card.innerHTML = `<b></b><dl></dl>`;
    card.querySelector("b").textContent = d.device;
    for (const [k, v] of Object.entries(fields)) {
      const dt = document.createElement("dt"), dd = document.createElement("dd");
      dt.textContent = k;
      dd.textContent = v;
      dd.dataset.field = k;
      card.querySelector("dl").append(dt, dd);
    }
    box.append(card);
  }
}

// --- The prefill pipeline: a lane per device, a bar per ubatch, transfers between lanes. ---
function drawTimeline() {
  const el = $("timeline");
  el.replaceChildren();
  const bars = view.ubatches;
  if (!bars.length) return;
  const lanes = ["host", ...new Set(bars.map((b) => b.device).filter((d) => d !== "host"))];
  const t0 = Math.min(...bars.map((b) => b.start_ms));
  const t1 = Math.max(...bars.map((b) => b.end_ms));
  const W = el.clientWidth || 600, H = 140, left = 64, laneH = (H - 34) / lanes.length;
  const x = (t) => left + ((t - t0) / Math.max(t1 - t0, 1e-3)) * (W - left - 8);
  el.setAttribute("viewBox", `0 0 ${W} ${H}`);
  lanes.forEach((lane, i) => {
    const t = svg("text", { x: 4, y: 14 + i * laneH + laneH / 2 });
    t.textContent = lane;
    el.append(t);
  });
  for (const b of bars) {
    const i = lanes.indexOf(b.device);
    el.append(svg("rect", {
      x: x(b.start_ms), y: 6 + i * laneH, width: Math.max(x(b.end_ms) - x(b.start_ms), 1),
      height: laneH - 8, fill: colour(b.device), class: "ubatch", "data-device": b.device,
    }));
  }
  for (const tr of view.transfers) {
    const a = lanes.indexOf(tr.from), b = lanes.indexOf(tr.to);
    if (a < 0 || b < 0) continue;
    el.append(svg("line", {
      x1: x(tr.at_ms), x2: x(tr.at_ms), y1: 6 + a * laneH + laneH / 2, y2: 6 + b * laneH + laneH / 2,
      stroke: "#0008", "stroke-width": 1, class: "transfer",
    }));
  }
  drawAxis(el, x, [t0, t1], H - 26);
  drawPipelineFigures(bars, lanes, t1 - t0);
}

// The time axis under the lanes: ticks at a round step, in ms from the first bar's start.
function drawAxis(el, x, [t0, t1], y) {
  const raw = (t1 - t0) / 5, mag = 10 ** Math.floor(Math.log10(Math.max(raw, 1e-3)));
  const step = [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= raw);
  el.append(svg("line", { x1: x(t0), x2: x(t1), y1: y, y2: y, stroke: "#0004", class: "axis" }));
  for (let t = 0; t0 + t <= t1 + 1e-9; t += step) {
    el.append(svg("line", { x1: x(t0 + t), x2: x(t0 + t), y1: y, y2: y + 4, stroke: "#0006" }));
    const label = svg("text", { x: x(t0 + t), y: y + 15, "text-anchor": "middle", class: "tick" });
    label.textContent = `${+t.toFixed(3)}`;
    el.append(label);
  }
  const unit = svg("text", { x: 4, y: y + 15, class: "tick unit" });
  unit.textContent = "ms";
  el.append(unit);
}

// What the split gained: the host alone would have run every layer of every ubatch at the
// pace its own bars show (per token and layer), against the time the run took. A split
// slower than that is said so, plainly.
function drawPipelineFigures(bars, lanes, span) {
  const fig = $("pipeline-figures");
  fig.classList.remove("slower");
  if (lanes.length < 2) {
    fig.textContent = `(${bars.length} ubatches on the host alone, ${span.toFixed(0)} ms)`;
    return;
  }
  const host = bars.filter((b) => b.device === "host");
  const hostMs = host.reduce((s, b) => s + (b.end_ms - b.start_ms), 0);
  const hostWork = host.reduce((s, b) => s + b.tokens * (b.layers[1] - b.layers[0]), 0);
  const tokens = host.reduce((s, b) => s + b.tokens, 0);
  const alone = (hostMs / Math.max(hostWork, 1)) * tokens * view.hello.layers.length;
  const speedup = alone / Math.max(span, 1e-3);
  const busy = lanes.map((l) => bars.filter((b) => b.device === l)
    .reduce((s, b) => s + (b.end_ms - b.start_ms), 0));
  const bound = busy.reduce((a, b) => a + b, 0) / Math.max(...busy);
  const gain = speedup < 1
    ? `slower than the host alone (${speedup.toFixed(2)}x)`
    : `${speedup.toFixed(2)}x the host alone`;
  fig.classList.toggle("slower", speedup < 1);
  fig.textContent = `(${bars.length} bars in ${span.toFixed(0)} ms: ${gain}, estimated from the host's ` +
    `own bars; ${lanes.length} stages this busy could reach ${bound.toFixed(2)}x their overlap)`;
  view.speedup = speedup;
}

// --- KV pages: a strip per full-attention layer, coloured by where each page is, position
// 0 (the oldest) on the left. ---
function drawPages() {
  const p = view.pages;
  const box = $("pages");
  box.replaceChildren();
  if (!p) return;
  const counts = {};
  for (const l of p.layers) {
    const total = l.runs.reduce((s, r) => s + r.count, 0);
    const row = document.createElement("div");
    row.className = "strip";
    row.innerHTML = `<span>layer ${l.layer}</span>`;
    row.title = `layer ${l.layer}: positions 0 (oldest) to ${l.len} (newest)`;
    const s = svg("svg", { viewBox: `0 0 ${Math.max(total, 1)} 1`, preserveAspectRatio: "none" });
    for (const r of l.runs) {
      counts[r.on] = (counts[r.on] || 0) + r.count;
      s.append(svg("rect", {
        x: r.first, y: 0, width: r.count, height: 1, fill: colour(r.on),
        class: "page-run", "data-on": r.on, "data-count": r.count,
      }));
    }
    const len = document.createElement("span");
    len.className = "len";
    len.textContent = l.len;
    row.append(s, len);
    box.append(row);
  }
  const ends = document.createElement("div");
  ends.className = "strip ends";
  ends.innerHTML = "<span></span><span>← oldest (position 0)</span><span>newest →</span>";
  box.prepend(ends);
  const types = view.hello && view.hello.kv_types ? ` (${view.hello.kv_types})` : "";
  $("pages-figures").textContent = `(${p.layers.length} layers, pages of ${p.page_size} positions${types}: ` +
    Object.entries(counts).map(([on, n]) => `${n} on ${on}`).join(", ") + ")";
  view.held = counts;
  drawMemory(counts);
  drawHelpers();
}

function drawMemory(counts) {
  const h = view.hello, p = view.pages;
  if (!h || !p) return;
  const pageBytes = p.page_size * h.kv_bytes_per_position;
  const rows = [["host", (counts.host || 0) * pageBytes, h.host_kv_tokens === null ? null
    : h.host_kv_tokens * h.kv_bytes_per_position * p.layers.length]];
  for (const d of view.devices) rows.push([d.device, (counts[d.device] || 0) * pageBytes, d.offer_bytes]);
  const box = $("memory");
  box.replaceChildren();
  for (const [device, used, budget] of rows) {
    const r = document.createElement("div");
    const share = budget ? Math.min(used / budget, 1) : 0;
    r.innerHTML = `<div>${device}: KV ${bytes(used)}${budget ? ` of ${bytes(budget)}` : ""}</div>` +
      `<div class="bar"><span style="width:${(100 * share).toFixed(1)}%;background:${colour(device)}"></span></div>`;
    r.dataset.device = device;
    r.dataset.used = used;
    box.append(r);
  }
}

// --- The link: bytes per second by message type, from consecutive samples. ---
function onLink(e) {
  const prev = view.link;
  view.link = e;
  if (!prev) return;
  const dt = Math.max((e.at_ms - prev.at_ms) / 1e3, 1e-3);
  const rates = [];
  let total = 0;
  for (const l of e.links) {
    const before = prev.links.find((p) => p.device === l.device) || { sent: {}, received: {} };
    for (const kind of new Set([...Object.keys(l.sent), ...Object.keys(l.received)])) {
      const diff = (side) => ((l[side][kind] || {}).bytes || 0) - ((before[side][kind] || {}).bytes || 0);
      const side = (s) => l[s][kind] || { bytes: 0, messages: 0 };
      rates.push({
        device: l.device, kind, out: diff("sent") / dt, in: diff("received") / dt,
        sent: side("sent").bytes, received: side("received").bytes,
        frames: side("sent").messages + side("received").messages,
      });
    }
    for (const side of ["sent", "received"]) {
      total += Object.values(l[side]).reduce((s, t) => s + t.bytes, 0);
    }
  }
  view.rates = rates;
  view.linkBytes = total;
  $("link-total").textContent = bytes(total);
  const body = $("link-rates").tBodies[0];
  body.replaceChildren();
  for (const r of rates) {
    // Known for the simulator's link and a server's --link profile, not for a real link.
    const cap = (e.links.find((l) => l.device === r.device) || {}).capacity_bps;
    const share = cap ? `${((100 * 8 * Math.max(r.out, r.in)) / cap).toFixed(1)}%` : "-";
    const tr = document.createElement("tr");
    tr.innerHTML = `<td>${r.device}</td><td>${r.kind}</td><td>${bytes(r.out)}/s</td><td>${bytes(r.in)}/s</td>` +
      `<td>${bytes(r.sent)}</td><td>${bytes(r.received)}</td><td>${r.frames}</td><td>${share}</td>`;
    tr.dataset.total = r.sent + r.received;
    body.append(tr);
  }
}

// The answer being generated: its rate so far, from its tokens' times (the first token comes
// with the prefill, so the rate counts the tokens after it).
function onToken(e) {
  const a = view.answer && view.answer.id === e.id ? view.answer : (view.answer = { id: e.id, first: e.at_ms });
  a.n = e.n;
  a.rate = e.n > 1 ? (1e3 * (e.n - 1)) / Math.max(e.at_ms - a.first, 1e-3) : null;
  $("decode-tps").textContent = a.rate === null ? `… (${e.n} token)`
    : `${a.rate.toFixed(1)} tok/s so far (${e.n} tokens)`;
}

// One check of drafted tokens (--draft): the running totals, and a mark per drafted token of
// the pass, kept (green) or thrown away (red; the first of those was refused).
function onDraft(e) {
  const d = view.drafts || (view.drafts = { drafted: 0, kept: 0, passes: 0 });
  d.drafted += e.drafted;
  d.kept += e.kept;
  d.passes++;
  $("drafts").textContent = `${d.kept} of ${d.drafted} kept over ${d.passes} checks`;
  const pass = document.createElement("span");
  pass.className = "draft-pass";
  pass.title = `${e.kept} of ${e.drafted} kept`;
  for (let i = 0; i < e.drafted; i++) {
    const t = document.createElement("i");
    t.className = i < e.kept ? "kept" : "refused";
    pass.append(t);
  }
  const strip = $("draft-passes");
  strip.append(pass);
  // The latest checks only: an answer of thousands of tokens keeps the page small.
  while (strip.childElementCount > 200) strip.firstElementChild.remove();
}

// One step of a batch (--parallel): the requests in it and the rows each ran, drawn as a
// column per step (a segment per request, its colour the request's, a prefill ubatch taller
// than a decode row) beside the latest steps, at most one redraw a frame.
const STEPS_SHOWN = 120;
let batchPending = false;
function onBatch(e) {
  view.steps.push(e);
  if (view.steps.length > STEPS_SHOWN) view.steps.shift();
  if (batchPending) return;
  batchPending = true;
  requestAnimationFrame(() => { batchPending = false; drawBatch(); });
}

function drawBatch() {
  const last = view.steps[view.steps.length - 1];
  if (!last) return;
  const rows = last.rows.reduce((n, r) => n + r.rows, 0);
  const prefill = last.rows.find((r) => r.prefill);
  const many = (n, what) => `${n} ${what}${n === 1 ? "" : "s"}`;
  $("batch-figures").textContent = `${many(last.requests, "request")}; the last step ran ${many(rows, "row")}` +
    (prefill ? ` (a ubatch of ${prefill.rows} for request ${prefill.id})` : "") +
    ` in ${last.ms.toFixed(0)} ms`;
  const strip = $("batch");
  strip.replaceChildren(...view.steps.map((s) => {
    const col = document.createElement("span");
    col.className = "step";
    col.title = s.rows.map((r) => `${r.id}: ${r.rows} ${r.prefill ? "prefill" : "decode"}`).join("\n");
    for (const r of s.rows) {
      const seg = document.createElement("i");
      seg.className = r.prefill ? "prefill" : "decode";
      seg.style.background = `hsl(${(r.id * 47) % 360} 60% 50%)`;
      col.append(seg);
    }
    return col;
  }));
}

const handlers = {
  hello(e) {
    view.hello = e;
    $("model").textContent = e.model;
    $("plan").textContent = e.plan;
    drawLayers();
  },
  devices(e) {
    view.devices = e.devices;
    if (e.plan) $("plan").textContent = e.plan;
    drawLayers();
    drawPages();
  },
  pages(e) { view.pages = e; drawPages(); },
  request() {
    view.ubatches = [];
    view.transfers = [];
    view.prefill = null;
    view.decode = null;
    view.answer = null;
    for (const id of ["prefill-tps", "decode-tps", "ttft"]) $(id).textContent = "…";
    view.drafts = null;
    $("drafts").textContent = "-";
    $("draft-passes").replaceChildren();
  },
  draft: onDraft,
  batch: onBatch,
  token: onToken,
  ubatch(e) { view.ubatches.push(e); scheduleTimeline(); },
  transfer(e) { view.transfers.push(e); scheduleTimeline(); },
  prefill(e) {
    view.prefill = e;
    $("prefill-tps").textContent = `${e.tok_s.toFixed(1)} tok/s (${e.tokens} tokens)`;
    $("ttft").textContent = `${e.ttft_ms.toFixed(0)} ms`;
  },
  done(e) {
    view.decode = e;
    $("decode-tps").textContent = `${e.decode_tok_s.toFixed(1)} tok/s (${e.completion_tokens} tokens)`;
  },
  link: onLink,
};

let timelinePending = false;
function scheduleTimeline() {
  if (timelinePending) return;
  timelinePending = true;
  requestAnimationFrame(() => { timelinePending = false; drawTimeline(); });
}

// Draw one event.
function handle(e) {
  view.events++;
  const h = handlers[e.type];
  if (h) h(e);
}

// Forget everything drawn (the simulator starts each run afresh).
function reset() {
  Object.assign(view, fresh());
  for (const id of ["layers", "legend", "helpers", "timeline", "pages", "memory", "draft-passes", "batch"]) $(id).replaceChildren();
  $("link-rates").tBodies[0].replaceChildren();
}

function connect() {
  const source = new EventSource(`${server}/v1/telemetry`);
  let opened = false;
  source.onopen = () => {
    opened = true;
    $("conn").textContent = "live";
    $("conn").className = "badge live";
  };
  source.onerror = () => {
    // Never opened: no tether server behind this page (the simulator needs none).
    $("conn").textContent = opened ? "reconnecting" : "no server: try the simulator";
    $("conn").className = "badge down";
  };
  source.onmessage = (m) => handle(JSON.parse(m.data));
}

// --- Chat: the OpenAI endpoint, streamed. ---
const history = [];

function say(role, text) {
  const d = document.createElement("div");
  d.className = `msg ${role}`;
  d.textContent = text;
  $("messages").append(d);
  d.scrollIntoView({ block: "end" });
  return d;
}

async function ask(prompt) {
  history.push({ role: "user", content: prompt });
  say("user", prompt);
  const out = say("assistant", "");
  $("send").disabled = true;
  try {
    const r = await fetch(`${server}/v1/chat/completions`, {
      method: "POST",
      headers: { "content-type": "application/json" },
      body: JSON.stringify({
        model: view.hello ? view.hello.model : "", messages: history, stream: true,
        max_tokens: parseInt($("max-tokens").value, 10) || 64,
      }),
    });
    if (!r.ok) throw new Error((await r.json()).error?.message || r.statusText);
    const reader = r.body.getReader();
    const text = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += text.decode(value, { stream: true });
      let at;
      while ((at = buf.indexOf("\n")) >= 0) {
        const line = buf.slice(0, at).trimEnd();
        buf = buf.slice(at + 1);
        // Server-sent events: `data: ` lines carry chunks; `:` lines keep the stream alive.
        if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
        const chunk = JSON.parse(line.slice(6));
        if (chunk.error) throw new Error(chunk.error.message);
        out.textContent += chunk.choices[0]?.delta?.content || "";
      }
    }
    history.push({ role: "assistant", content: out.textContent });
  } catch (err) {
    out.className = "msg error";
    out.textContent = `error: ${err.message}`;
    history.pop();
  } finally {
    $("send").disabled = false;
  }
}

function startChat() {
  $("ask").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const p = $("prompt").value.trim();
    if (!p) return;
    $("prompt").value = "";
    ask(p);
  });
  $("prompt").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey) {
      ev.preventDefault();
      $("ask").requestSubmit();
    }
  });
}

window.addEventListener("resize", scheduleTimeline);
if (new URLSearchParams(location.search).has("sim")) {
  $("chat").hidden = true;
  $("sim").hidden = false;
  $("mode").textContent = "live";
  $("mode").href = "./";
  $("conn").textContent = "simulator";
  const { start } = await import("./sim.js");
  await start({ handle, reset });
} else {
  connect();
  startChat();
}
