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
  const W = el.clientWidth || 600, H = 120, left = 64, laneH = (H - 20) / lanes.length;
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
  const t = svg("text", { x: left, y: H - 4 });
  t.textContent = `${(t1 - t0).toFixed(0)} ms`;
  el.append(t);
  // Busy time per lane against the span: what two stages could reach, and what they did.
  const busy = lanes.map((l) => bars.filter((b) => b.device === l)
    .reduce((s, b) => s + (b.end_ms - b.start_ms), 0));
  const total = busy.reduce((a, b) => a + b, 0);
  const bound = total / Math.max(...busy);
  const measured = total / Math.max(t1 - t0, 1e-3);
  $("pipeline-figures").textContent = lanes.length > 1
    ? `(${bars.length} bars; ${lanes.length}-stage bound ${bound.toFixed(2)}x, measured ${measured.toFixed(2)}x, ${(100 * measured / bound).toFixed(0)}% efficient)`
    : `(${bars.length} ubatches on the host alone)`;
}

// --- KV pages: a strip per full-attention layer, coloured by where each page is. ---
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
    const s = svg("svg", { viewBox: `0 0 ${Math.max(total, 1)} 1`, preserveAspectRatio: "none" });
    for (const r of l.runs) {
      counts[r.on] = (counts[r.on] || 0) + r.count;
      s.append(svg("rect", {
        x: r.first, y: 0, width: r.count, height: 1, fill: colour(r.on),
        class: "page-run", "data-on": r.on, "data-count": r.count,
      }));
    }
    row.append(s);
    box.append(row);
  }
  $("pages-figures").textContent = `(${p.layers.length} layers, pages of ${p.page_size} positions: ` +
    Object.entries(counts).map(([on, n]) => `${n} on ${on}`).join(", ") + ")";
  drawMemory(counts);
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
      rates.push({ device: l.device, kind, out: diff("sent") / dt, in: diff("received") / dt });
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
    tr.innerHTML = `<td>${r.device}</td><td>${r.kind}</td><td>${bytes(r.out)}/s</td><td>${bytes(r.in)}/s</td><td>${share}</td>`;
    body.append(tr);
  }
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
  request() { view.ubatches = []; view.transfers = []; },
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
  for (const id of ["layers", "legend", "timeline", "pages", "memory"]) $(id).replaceChildren();
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
