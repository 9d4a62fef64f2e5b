// The simulator's engine off the page's thread: a module worker that loads the WebAssembly
// module (wasm-demo/src/sim.rs) once and answers each settings message with one run's outcome
// (`{ok: JSON text}` or `{error: message}`), so the page stays responsive while a run computes.
import init, { simulate } from "./pkg/wasm_demo.js";

const ready = init();

self.onmessage = async (m) => {
  try {
    await ready;
    self.postMessage({ ok: simulate(m.data) });
  } catch (err) {
    self.postMessage({ error: String(err) });
  }
};
