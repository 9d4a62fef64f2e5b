//! The browser driver of the pump: a `WebSocket` to the host (the tab dials, since a page can
//! listen on nothing), a `setInterval` timer for keep-alives, the page's WebGPU (the CPU
//! backend where there is no adapter), and the tab's keys in `localStorage`, so a tab that
//! paired once joins that host again without a code.

use std::cell::RefCell;
use std::rc::Rc;

use engine_core::backend::gpu::{GpuBackend, GpuOptions};
use std::ops::Range;

use engine_core::helper::{Helper, HelperOptions, Loading, Session, SessionEnd, Weights};
use engine_core::host::remote::DEFAULT_MAX_FRAME;
use engine_core::link::keys::{hex, short, unhex, Keypair, PublicKey};
use engine_core::link::secure::{self, Dial};
use engine_core::link::LinkError;
use engine_core::{Backend, CpuBackend};
use futures_channel::{mpsc, oneshot};
use serde_json::{json, Value};
use wasm_bindgen::prelude::*;
use wasm_bindgen::JsCast;
use web_sys::{BinaryType, CloseEvent, MessageEvent, Storage, WebSocket};

use crate::pump::{self, Incoming, Wire, TICK};
use crate::weights::Lending;

/// A browser tab as a helper: `await TabHelper.join(...)` from the page.
#[wasm_bindgen]
pub struct TabHelper;

#[wasm_bindgen]
impl TabHelper {
    /// Joins the host at `url` (`ws://…`) and helps it until the session ends. `code` is the
    /// pairing code the host shows, needed the first time only; the model is the host's (its
    /// weights fetched from it as it assigns layers, crate::weights); `backend` is `auto`
    /// (WebGPU, else CPU), `gpu` or `cpu`. `on_event` gets every event as a JSON string
    /// (`{"kind": "status" | "backend" | "paired" | "model" | "stats" | "ended" | "error",
    /// ...}`). Resolves with the `ended` event, rejects with the error.
    pub async fn join(
        url: String,
        code: Option<String>,
        backend: String,
        mem_budget: f64,
        on_event: js_sys::Function,
    ) -> Result<String, JsValue> {
        std::panic::set_hook(Box::new(|info| {
            web_sys::console::error_1(&info.to_string().into());
        }));
        let events = Events(on_event);
        let code = code.filter(|c| !c.trim().is_empty());
        match run(&url, code.as_deref(), &backend, mem_budget as u64, &events).await {
            Ok(end) => {
                let (why, bye) = match end {
                    SessionEnd::Bye => ("the host said bye".to_string(), true),
                    SessionEnd::Closed(why) => (format!("the link closed: {why}"), false),
                    SessionEnd::Refused(why) => (format!("refused: {why}"), false),
                };
                Ok(events.send(json!({"kind": "ended", "why": why, "bye": bye})))
            }
            Err(e) => {
                events.send(json!({"kind": "error", "text": e}));
                Err(JsValue::from_str(&e))
            }
        }
    }
}

/// The page's event callback.
struct Events(js_sys::Function);

impl Events {
    /// Calls the page with `event` (a failing callback is the page's business); returns the
    /// JSON it was given.
    fn send(&self, event: Value) -> String {
        let text = event.to_string();
        let _ = self.0.call1(&JsValue::NULL, &JsValue::from_str(&text));
        text
    }

    fn status(&self, text: impl Into<String>) {
        self.send(json!({"kind": "status", "text": text.into()}));
    }

    /// What the helper has done so far: its pages and bytes held, requests answered by kind,
    /// weights fetched and taken from the cache.
    fn stats(&self, session: &Session, lending: &Lending) {
        let c = session.counters();
        let n = |k: &str| c.get(k).copied().unwrap_or(0);
        let w = lending.fetched();
        self.send(json!({
            "kind": "stats",
            "pages": n("kv_pages"),
            "kv_bytes": n("kv_bytes"),
            "held_bytes": n("held_bytes"),
            "queries": n("AttnQuery"),
            "prefill_chunks": n("PrefillChunk"),
            "kv_appends": n("KvAppend"),
            "weights_fetched": w.tensors,
            "weights_fetched_bytes": w.bytes,
            "weights_cached": w.cached,
        }));
    }
}

pub(crate) fn js_err(e: JsValue) -> String {
    e.as_string()
        .or_else(|| {
            e.dyn_ref::<js_sys::Error>()
                .map(|e| String::from(e.message()))
        })
        .unwrap_or_else(|| format!("{e:?}"))
}

async fn run(
    url: &str,
    code: Option<&str>,
    backend: &str,
    mem_budget: u64,
    events: &Events,
) -> Result<SessionEnd, String> {
    let backend = make_backend(backend, events).await?;
    let store = KeyStore::open()?;
    let (mut socket, mut link, host) = dial(url, code, &store, events).await?;
    events.status(format!("joined the host at {url}: asking for its model"));
    let lending = Lending::open(url, &store.keypair()?, &host).await?;
    let identity = lending.identity()?;
    events.send(
        json!({"kind": "model", "name": lending.manifest.name, "digest": lending.manifest.digest}),
    );
    events.status(format!(
        "serving the host at {url} ({})",
        if link.is_encrypted() {
            "encrypted"
        } else {
            "plain"
        }
    ));
    let load = |layers: Range<usize>| -> Loading<'_> { Box::pin(lending.layers(layers)) };
    let helper = Helper::with_weights(
        Weights::Assigned {
            identity: &identity,
            load: &load,
        },
        &*backend,
        HelperOptions {
            mem_budget,
            max_frame: DEFAULT_MAX_FRAME,
        },
    );
    let mut session = helper.session();
    events.stats(&session, &lending);
    let end = pump::serve(&mut socket.wire, &mut link, &mut session, |s| {
        events.stats(s, &lending)
    })
    .await;
    events.stats(&session, &lending);
    Ok(end)
}

/// The backend `choice` names: `gpu` (the page's WebGPU), `cpu`, or `auto` (WebGPU when the
/// browser gives a hardware adapter, else CPU: a software one, SwiftShader on a machine without
/// a GPU, ran a tab's attention about 10x slower than its CPU backend). Tells the page which
/// one runs, and why.
async fn make_backend(choice: &str, events: &Events) -> Result<Box<dyn Backend>, String> {
    let name = |what: String| events.send(json!({"kind": "backend", "name": what}));
    if choice == "cpu" {
        name("cpu".into());
        return Ok(Box::new(CpuBackend));
    }
    if !matches!(choice, "auto" | "gpu") {
        return Err(format!("backend `{choice}`: expected auto, gpu or cpu"));
    }
    events.status("asking the browser for a WebGPU adapter");
    match GpuBackend::new_async(&GpuOptions::default()).await {
        Ok(gpu) if choice == "auto" && gpu.gpu().is_software() => {
            name(format!(
                "cpu (WebGPU here is a software adapter, {}: slower than the CPU; \
                 &backend=gpu forces it)",
                gpu.adapter_name()
            ));
            Ok(Box::new(CpuBackend))
        }
        Ok(gpu) => {
            name(format!("gpu ({})", gpu.adapter_name()));
            Ok(Box::new(gpu))
        }
        Err(e) if choice == "auto" => {
            name(format!("cpu (no WebGPU: {e})"));
            Ok(Box::new(CpuBackend))
        }
        Err(e) => Err(format!("WebGPU: {e}")),
    }
}

/// Opens the secure link to `url`: by the host key remembered for it, else (or when the host
/// no longer answers to that key and a code is given) by pairing with `code`, whose key is
/// then remembered.
async fn dial(
    url: &str,
    code: Option<&str>,
    store: &KeyStore,
    events: &Events,
) -> Result<(Socket, secure::Session, PublicKey), String> {
    let keys = store.keypair()?;
    if let Some(host) = store.host(url) {
        events.status(format!(
            "dialing {url} (paired before: host key {})",
            short(&host)
        ));
        let mut socket = Socket::open(url).await?;
        match pump::handshake(&mut socket.wire, &keys, Dial::Known(host)).await {
            Ok((link, _)) => return Ok((socket, link, host)),
            Err(LinkError::Refused(why)) if code.is_some() => {
                events.status(format!(
                    "the host refused the remembered key ({why}); pairing again"
                ));
            }
            Err(e) => return Err(e.to_string()),
        }
    }
    let Some(code) = code else {
        return Err(format!(
            "not paired with the host at {url} yet: enter the pairing code it shows"
        ));
    };
    events.status(format!("dialing {url}, pairing with code {code}"));
    let mut socket = Socket::open(url).await?;
    let (link, host) = pump::handshake(&mut socket.wire, &keys, Dial::Pair(code))
        .await
        .map_err(|e| e.to_string())?;
    let host = host.ok_or("the host gave no key")?;
    store.set_host(url, &host)?;
    events.send(json!({"kind": "paired", "host": short(&host)}));
    Ok((socket, link, host))
}

/// The tab's keys in the page's `localStorage`, hex as the native key store writes them: its
/// own key pair (made on first use) and the key of each host it paired with, by URL.
struct KeyStore(Storage);

const KEYPAIR: &str = "tether.helper.keypair";

fn host_entry(url: &str) -> String {
    format!("tether.helper.host:{url}")
}

impl KeyStore {
    fn open() -> Result<KeyStore, String> {
        web_sys::window()
            .ok_or("no window: the helper runs in a page")?
            .local_storage()
            .map_err(js_err)?
            .map(KeyStore)
            .ok_or_else(|| "this page has no localStorage".into())
    }

    fn get(&self, key: &str) -> Option<String> {
        self.0.get_item(key).ok().flatten()
    }

    fn set(&self, key: &str, value: &str) -> Result<(), String> {
        self.0.set_item(key, value).map_err(js_err)
    }

    fn keypair(&self) -> Result<Keypair, String> {
        let stored = self.get(KEYPAIR).and_then(|text| {
            let (secret, public) = text.split_once(' ')?;
            Some(Keypair {
                secret: unhex(secret)?,
                public: unhex(public)?,
            })
        });
        if let Some(kp) = stored {
            return Ok(kp);
        }
        let kp = Keypair::generate();
        self.set(KEYPAIR, &format!("{} {}", hex(&kp.secret), hex(&kp.public)))?;
        Ok(kp)
    }

    fn host(&self, url: &str) -> Option<PublicKey> {
        unhex(&self.get(&host_entry(url))?)
    }

    fn set_host(&self, url: &str, key: &PublicKey) -> Result<(), String> {
        self.set(&host_entry(url), &hex(key))
    }
}

/// An open `WebSocket`, its handlers and the keep-alive timer, feeding one [`Wire`]. Dropping it
/// closes the socket and stops the timer.
struct Socket {
    ws: WebSocket,
    wire: Wire,
    interval: i32,
    _on_message: Closure<dyn FnMut(MessageEvent)>,
    _on_close: Closure<dyn FnMut(CloseEvent)>,
    _on_tick: Closure<dyn FnMut()>,
}

impl Socket {
    /// Connects to `url`; resolves once the socket is open (or fails with why it closed).
    async fn open(url: &str) -> Result<Socket, String> {
        let ws = WebSocket::new(url).map_err(js_err)?;
        ws.set_binary_type(BinaryType::Arraybuffer);
        let (tx, rx) = mpsc::unbounded();
        let (opened, is_open) = oneshot::channel::<Result<(), String>>();
        let opened = Rc::new(RefCell::new(Some(opened)));

        let on_open = {
            let opened = opened.clone();
            Closure::once(move || {
                if let Some(o) = opened.borrow_mut().take() {
                    let _ = o.send(Ok(()));
                }
            })
        };
        ws.set_onopen(Some(on_open.as_ref().unchecked_ref()));
        let frames = tx.clone();
        let on_message = Closure::<dyn FnMut(MessageEvent)>::new(move |e: MessageEvent| {
            let what = match e.data().dyn_into::<js_sys::ArrayBuffer>() {
                Ok(buf) => Incoming::Frame(js_sys::Uint8Array::new(&buf).to_vec()),
                Err(_) => Incoming::Closed("the host sent a text message: not tether's".into()),
            };
            let _ = frames.unbounded_send(what);
        });
        ws.set_onmessage(Some(on_message.as_ref().unchecked_ref()));
        let closed = tx.clone();
        let on_close = Closure::<dyn FnMut(CloseEvent)>::new(move |e: CloseEvent| {
            let why = match e.reason() {
                r if r.is_empty() => format!("the socket closed (code {})", e.code()),
                r => format!("the socket closed (code {}: {r})", e.code()),
            };
            if let Some(o) = opened.borrow_mut().take() {
                let _ = o.send(Err(why.clone()));
            }
            let _ = closed.unbounded_send(Incoming::Closed(why));
        });
        ws.set_onclose(Some(on_close.as_ref().unchecked_ref()));
        let on_tick = Closure::<dyn FnMut()>::new(move || {
            let _ = tx.unbounded_send(Incoming::Tick);
        });
        let interval = web_sys::window()
            .ok_or("no window")?
            .set_interval_with_callback_and_timeout_and_arguments_0(
                on_tick.as_ref().unchecked_ref(),
                TICK.as_millis() as i32,
            )
            .map_err(js_err)?;

        let sender = ws.clone();
        let send = Box::new(move |frame: &[u8]| sender.send_with_u8_array(frame).map_err(js_err));
        let socket = Socket {
            ws,
            wire: Wire::new(rx, send),
            interval,
            _on_message: on_message,
            _on_close: on_close,
            _on_tick: on_tick,
        };
        // Only the first of open and close answers; `on_open` runs once, from the socket.
        let result = is_open.await.unwrap_or(Err("the socket went away".into()));
        socket.ws.set_onopen(None);
        drop(on_open);
        result
            .map(|()| socket)
            .map_err(|why| format!("{url}: {why}"))
    }
}

impl Drop for Socket {
    fn drop(&mut self) {
        if let Some(w) = web_sys::window() {
            w.clear_interval_with_handle(self.interval);
        }
        self.ws.set_onmessage(None);
        self.ws.set_onclose(None);
        let _ = self.ws.close();
    }
}
