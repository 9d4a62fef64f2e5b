//! The helper runtime: serves one host at a time over any `Link`. It holds the KV pages a host
//! gives it, with their page boundaries, and answers attention queries with one partial per
//! page, computed by the same backend code the host would have used: with the same backend on
//! both sides, the host's merge is bit-identical to attending over the pages itself.
//!
//! A frame that does not decode gets an `Error` frame and ends the session (the peer is not
//! speaking our protocol); a well-formed request that cannot be served (wrong layer, rows out
//! of order, over the memory budget, a reply past the frame limit) gets an `Error` reply and
//! the session goes on with all stored state intact. Every size a host sends is checked
//! against those limits before anything is allocated or computed for it.

mod limits;
mod requests;
#[cfg(all(feature = "runner", not(target_arch = "wasm32")))]
pub mod runner;

use std::collections::BTreeMap;
use std::future::Future;
use std::ops::Range;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use crate::backend::Backend;
use crate::link::{Link, LinkError};
use crate::model::LayerState;
use crate::protocol::{decode, encode, Configure, Intro, Message, MsgType, Role, PROTOCOL_VERSION};
use crate::{Model, State};

use limits::held_bytes;
pub use limits::prefill_bytes;

/// Sequences one host may keep on this helper at once.
const MAX_SEQS: usize = 64;

pub struct HelperOptions {
    /// Bytes this helper holds at most for one host: KV pages (whole, as allocated), DeltaNet
    /// state (of the assigned layers, per sequence), and while a prefill chunk runs its
    /// activations and reply. Other replies are bounded by the frame limit instead, so a
    /// helper whose pages fill its budget still answers queries over them.
    pub mem_budget: u64,
    pub max_frame: usize,
}

/// Why a session ended.
#[derive(Debug, PartialEq, Eq)]
pub enum SessionEnd {
    /// The host said Bye.
    Bye,
    /// The link closed.
    Closed(String),
    /// The host was refused or broke the protocol; the message was sent to it as an Error.
    Refused(String),
}

/// The layers a host assigns, being built: natively ready at once (a memory-mapped checkpoint
/// or a generated preset); in a browser tab, fetched from the host first.
pub type Loading<'a> = Pin<Box<dyn Future<Output = crate::Result<Model>> + 'a>>;

/// Builds the layers a host assigns (and nothing else) from the helper's checkpoint.
pub type LoadLayers<'a> = dyn Fn(Range<usize>) -> Loading<'a> + Sync + 'a;

/// The weights a helper runs its share of a split prefill with.
pub enum Weights<'a> {
    /// A whole model, whatever layers a host assigns.
    Whole(&'a Model),
    /// Only the layers a host assigns, built when it configures the session; `identity`
    /// (config and the whole model's identity, no layers) answers the handshake.
    Assigned {
        identity: &'a Model,
        load: &'a LoadLayers<'a>,
    },
}

pub struct Helper<'a> {
    weights: Weights<'a>,
    /// The layers built for the last assignment, kept for the next host asking for them.
    assigned: Mutex<Option<Arc<Model>>>,
    backend: &'a dyn Backend,
    opts: HelperOptions,
}

struct Held {
    configure: Option<Configure>,
    /// The assigned layers (for `Weights::Assigned`).
    layers: Option<Arc<Model>>,
    /// Per sequence: the KV rows this helper holds (pages handed over by the host, and the
    /// mirror of its prefill layers) and, for those layers, the DeltaNet state.
    seqs: BTreeMap<u64, State>,
    counters: BTreeMap<String, u64>,
    /// The frame limit both sides announced: a reply past it would be refused by the host, so
    /// none is computed.
    max_frame: usize,
}

impl Held {
    /// The assignment, which every request on KV or layers needs first.
    fn configured(&self, what: MsgType) -> Result<Configure, Refusal> {
        self.configure
            .clone()
            .ok_or_else(|| Refusal("order", format!("{what:?} before Configure")))
    }

    /// Message counts and the bytes held.
    fn stats(&self) -> Message {
        Message::Stats(self.counters())
    }

    /// Message counts, the bytes held and the KV pages held.
    fn counters(&self) -> BTreeMap<String, u64> {
        let mut counters = self.counters.clone();
        let kv: usize = self.seqs.values().map(State::kv_bytes).sum();
        let delta: usize = self.seqs.values().map(State::delta_bytes).sum();
        counters.insert("kv_bytes".into(), kv as u64);
        counters.insert("delta_state_bytes".into(), delta as u64);
        counters.insert("held_bytes".into(), held_bytes(&self.seqs));
        let pages: usize = self
            .seqs
            .values()
            .flat_map(|s| &s.layers)
            .map(|l| match l {
                LayerState::Attention(kv) => kv.pages().len(),
                LayerState::DeltaNet(_) | LayerState::Elsewhere => 0,
            })
            .sum();
        counters.insert("kv_pages".into(), pages as u64);
        counters
    }
}

/// A request that cannot be served: the reply is an Error frame with this code and message.
struct Refusal(&'static str, String);

impl<'a> Helper<'a> {
    /// A helper with a whole model.
    pub fn new(model: &'a Model, backend: &'a dyn Backend, opts: HelperOptions) -> Self {
        Helper::with_weights(Weights::Whole(model), backend, opts)
    }

    pub fn with_weights(
        weights: Weights<'a>,
        backend: &'a dyn Backend,
        opts: HelperOptions,
    ) -> Self {
        Helper {
            weights,
            assigned: Mutex::new(None),
            backend,
            opts,
        }
    }

    /// Config and identity: the model as the handshake knows it.
    fn model(&self) -> &Model {
        match &self.weights {
            Weights::Whole(m) => m,
            Weights::Assigned { identity, .. } => identity,
        }
    }

    /// The model that runs `layers` in this session, built now if the helper loads per
    /// assignment and does not hold those layers yet.
    async fn load(&self, layers: Range<usize>) -> crate::Result<Option<Arc<Model>>> {
        let Weights::Assigned { load, .. } = &self.weights else {
            return Ok(None);
        };
        {
            let mut held = self.assigned.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(m) = held.as_ref().filter(|m| {
                let l = m.loaded_layers();
                l.start <= layers.start && layers.end <= l.end
            }) {
                return Ok(Some(m.clone()));
            }
            // Drop the old layers before building the new ones.
            *held = None;
        }
        let m = load(layers).await?;
        // Weights this helper's backend cannot use (k-quants on a GPU) end the session with
        // that reason instead of a panic at the first layer.
        m.check_backend(self.backend)?;
        let m = Arc::new(m);
        *self.assigned.lock().unwrap_or_else(|e| e.into_inner()) = Some(m.clone());
        Ok(Some(m))
    }

    fn intro(&self) -> Intro {
        Intro {
            version: PROTOCOL_VERSION,
            model: self.model().identity.name.clone(),
            model_digest: self.model().identity.digest.clone(),
            role: Role::Helper,
            mem_offer: self.opts.mem_budget,
            backends: vec![self.backend.name().to_string()],
            max_frame: self.opts.max_frame as u64,
            device: crate::protocol::device_kind().into(),
        }
    }

    /// A session for one host, fed its frames by whoever carries them.
    pub fn session(&self) -> Session<'_, 'a> {
        Session {
            helper: self,
            greeted: false,
            held: Held {
                configure: None,
                layers: None,
                seqs: BTreeMap::new(),
                counters: BTreeMap::new(),
                max_frame: self.opts.max_frame,
            },
        }
    }

    /// Serve one host over a blocking link until it says Bye, the link closes or the host
    /// breaks the protocol (the native driver of [`Session`]; read-backs are waited for here).
    pub fn serve(&self, link: &mut dyn Link) -> SessionEnd {
        self.serve_watched(link, &mut |_| {})
    }

    /// [`Self::serve`], telling `watch` the session after every frame it answered (a driver
    /// that reports its helper's work: the iOS library's status).
    pub fn serve_watched(
        &self,
        link: &mut dyn Link,
        watch: &mut dyn FnMut(&Session<'_, 'a>),
    ) -> SessionEnd {
        let mut session = self.session();
        loop {
            let frame = match link.recv() {
                Ok(f) => f,
                Err(LinkError::Closed(why)) => return SessionEnd::Closed(why),
                Err(e) => return SessionEnd::Closed(e.to_string()),
            };
            let step = pollster::block_on(session.on_frame(&frame));
            if let Some(reply) = step.reply {
                if link.send(reply).is_err() {
                    return step
                        .end
                        .unwrap_or(SessionEnd::Closed("while replying".into()));
                }
            }
            if let Some(end) = step.end {
                return end;
            }
            watch(&session);
        }
    }
}

/// What one frame from the host produced: the frame to send back, if any, and whether the
/// session is over (after sending it).
pub struct Step {
    pub reply: Option<Vec<u8>>,
    pub end: Option<SessionEnd>,
}

impl Step {
    fn reply(req: u32, msg: &Message) -> Step {
        Step {
            reply: Some(encode(req, msg)),
            end: None,
        }
    }

    /// An Error frame to the host, which ends the session.
    fn refuse(req: u32, code: &str, message: String) -> Step {
        Step {
            reply: Some(encode(req, &Message::error(code, message.clone()))),
            end: Some(SessionEnd::Refused(format!("{code}: {message}"))),
        }
    }
}

/// One host's session: frames in, frames out. No I/O, threads or blocking of its own, so the
/// same code serves a host over a native socket ([`Helper::serve`]) and from a browser tab,
/// whose read-backs complete on the page's event loop (hence `async`).
pub struct Session<'h, 'a> {
    helper: &'h Helper<'a>,
    greeted: bool,
    held: Held,
}

impl Session<'_, '_> {
    /// What a Stats request would answer now: frames by message type, the bytes held and the
    /// KV pages held. For a driver that shows its helper's work (a browser tab's page).
    pub fn counters(&self) -> BTreeMap<String, u64> {
        self.held.counters()
    }

    /// The host's next frame. A frame that does not decode, or a handshake that fails, ends
    /// the session with an Error frame; a request that cannot be served gets an Error reply
    /// and the session goes on.
    pub async fn on_frame(&mut self, frame: &[u8]) -> Step {
        let (req, msg) = match decode(frame, self.helper.opts.max_frame) {
            Ok(m) => m,
            Err(e) => return Step::refuse(0, "bad_frame", e.to_string()),
        };
        *self
            .held
            .counters
            .entry(format!("{:?}", msg.msg_type()))
            .or_default() += 1;
        if !self.greeted {
            return self.greet(req, msg);
        }
        let reply = match msg {
            Message::Bye { .. } => {
                return Step {
                    reply: None,
                    end: Some(SessionEnd::Bye),
                }
            }
            Message::Hello(_) => return Step::refuse(req, "handshake", "Hello sent twice".into()),
            other => self
                .helper
                .handle(&mut self.held, other)
                .await
                .unwrap_or_else(|Refusal(code, m)| Message::error(code, m)),
        };
        Step::reply(req, &reply)
    }

    /// The host's Hello: same protocol, same model, or the session ends.
    fn greet(&mut self, req: u32, msg: Message) -> Step {
        let intro = match msg {
            Message::Hello(intro) => intro,
            other => {
                let why = format!("expected Hello, got {:?}", other.msg_type());
                return Step::refuse(req, "handshake", why);
            }
        };
        if intro.version != PROTOCOL_VERSION {
            let why = format!("protocol {} vs {PROTOCOL_VERSION}", intro.version);
            return Step::refuse(req, "version", why);
        }
        let ours = &self.helper.model().identity;
        if intro.model_digest != ours.digest {
            let why = format!(
                "this helper runs a different model: {} here, {} on the host",
                ours.name, intro.model
            );
            return Step::refuse(req, "model", why);
        }
        self.greeted = true;
        self.held.max_frame = self.held.max_frame.min(intro.max_frame as usize);
        Step::reply(req, &Message::Welcome(self.helper.intro()))
    }
}
