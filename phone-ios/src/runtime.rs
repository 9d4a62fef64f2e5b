//! The helper runtime: serves one host at a time over any `Link`. It holds the KV pages a host
//! gives it, with their page boundaries, and answers attention queries with one partial per
//! page, computed by the same backend code the host would have used, so the host's merge is
//! bit-identical to attending over the pages itself.
//!
//! A frame that does not decode gets an `Error` frame and ends the session (the peer is not
//! speaking our protocol); a well-formed request that cannot be served (wrong layer, rows out
//! of order, over the memory budget) gets an `Error` reply and the session goes on with all
//! stored state intact.

use std::collections::BTreeMap;

use engine_core::backend::{AttnShape, Backend};
use engine_core::kv::KvPage;
use engine_core::link::{Link, LinkError};
use engine_core::protocol::{
    decode, encode, Configure, Intro, Message, Role, WireTensor, PROTOCOL_VERSION,
};
use engine_core::{LayerKind, Model};

pub struct HelperOptions {
    /// Bytes of KV pages this helper keeps at most.
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

pub struct Helper<'a> {
    model: &'a Model,
    backend: &'a dyn Backend,
    opts: HelperOptions,
}

/// The pages of one sequence and layer, oldest first.
type Pages = Vec<KvPage>;

struct Session {
    configure: Option<Configure>,
    /// (sequence, layer) -> pages.
    kv: BTreeMap<(u64, u32), Pages>,
    bytes: u64,
    counters: BTreeMap<String, u64>,
}

/// A request that cannot be served: the reply is an Error frame with this code and message.
struct Refusal(&'static str, String);

impl<'a> Helper<'a> {
    pub fn new(model: &'a Model, backend: &'a dyn Backend, opts: HelperOptions) -> Self {
        Helper {
            model,
            backend,
            opts,
        }
    }

    fn intro(&self) -> Intro {
        Intro {
            version: PROTOCOL_VERSION,
            fingerprint: self.model.fingerprint.clone(),
            role: Role::Helper,
            mem_offer: self.opts.mem_budget,
            backends: vec![self.backend.name().to_string()],
            max_frame: self.opts.max_frame as u64,
        }
    }

    /// Serve one host until it says Bye, the link closes or the host breaks the protocol.
    pub fn serve(&self, link: &mut dyn Link) -> SessionEnd {
        let mut s = Session {
            configure: None,
            kv: BTreeMap::new(),
            bytes: 0,
            counters: BTreeMap::new(),
        };
        let mut greeted = false;
        loop {
            let frame = match link.recv() {
                Ok(f) => f,
                Err(LinkError::Closed(why)) => return SessionEnd::Closed(why),
                Err(e) => return SessionEnd::Closed(e.to_string()),
            };
            let (req, msg) = match decode(&frame, self.opts.max_frame) {
                Ok(m) => m,
                Err(e) => return refuse(link, 0, "bad_frame", e.to_string()),
            };
            *s.counters
                .entry(format!("{:?}", msg.msg_type()))
                .or_default() += 1;
            if !greeted {
                match msg {
                    Message::Hello(intro) => {
                        if intro.version != PROTOCOL_VERSION {
                            return refuse(
                                link,
                                req,
                                "version",
                                format!("protocol {} vs {PROTOCOL_VERSION}", intro.version),
                            );
                        }
                        if intro.fingerprint != self.model.fingerprint {
                            return refuse(
                                link,
                                req,
                                "fingerprint",
                                format!(
                                    "this helper runs a different model (fingerprint {}, the host's {})",
                                    self.model.fingerprint, intro.fingerprint
                                ),
                            );
                        }
                        greeted = true;
                        if send(link, req, Message::Welcome(self.intro())).is_err() {
                            return SessionEnd::Closed("while sending Welcome".into());
                        }
                        continue;
                    }
                    other => {
                        return refuse(
                            link,
                            req,
                            "handshake",
                            format!("expected Hello, got {:?}", other.msg_type()),
                        )
                    }
                }
            }
            let reply = match msg {
                Message::Bye { .. } => return SessionEnd::Bye,
                Message::Hello(_) => {
                    return refuse(link, req, "handshake", "Hello sent twice".into())
                }
                other => self
                    .handle(&mut s, other)
                    .unwrap_or_else(|Refusal(code, m)| Message::error(code, m)),
            };
            if send(link, req, reply).is_err() {
                return SessionEnd::Closed("while replying".into());
            }
        }
    }

    fn handle(&self, s: &mut Session, msg: Message) -> Result<Message, Refusal> {
        let c = &self.model.config;
        match msg {
            Message::Configure(cfg) => {
                let n = c.num_hidden_layers as u32;
                if cfg.first_layer > cfg.end_layer || cfg.end_layer > n || cfg.page_size == 0 {
                    return Err(Refusal(
                        "configure",
                        format!(
                            "layers {}..{} of {n} with page size {}",
                            cfg.first_layer, cfg.end_layer, cfg.page_size
                        ),
                    ));
                }
                s.configure = Some(cfg);
                Ok(Message::Ack)
            }
            Message::KvAppend {
                seq,
                layer,
                start,
                k,
                v,
            } => {
                let page_size = s
                    .configure
                    .as_ref()
                    .ok_or_else(|| Refusal("order", "KvAppend before Configure".into()))?
                    .page_size;
                self.check_full_layer(layer)?;
                let width = c.num_key_value_heads * c.head_dim;
                let rows = k.shape[0];
                if k.shape[1] != width || rows == 0 || rows > page_size as usize {
                    return Err(Refusal(
                        "shape",
                        format!("KV rows {:?}: expected [1..={page_size}, {width}]", k.shape),
                    ));
                }
                let pages = s.kv.entry((seq, layer)).or_default();
                let next = pages.last().map_or(0, |p| p.start + p.len);
                if start as usize != next || !next.is_multiple_of(page_size as usize) {
                    return Err(Refusal(
                        "order",
                        format!(
                            "layer {layer} page at {start}: the next page must start at {next}"
                        ),
                    ));
                }
                let bytes = (k.data.len() + v.data.len()) as u64 * 4;
                if s.bytes + bytes > self.opts.mem_budget {
                    return Err(Refusal(
                        "memory",
                        format!(
                            "{} + {bytes} bytes exceeds this helper's budget of {}",
                            s.bytes, self.opts.mem_budget
                        ),
                    ));
                }
                s.bytes += bytes;
                pages.push(KvPage {
                    start: next,
                    len: rows,
                    k: k.data,
                    v: v.data,
                });
                Ok(Message::Ack)
            }
            Message::AttnQuery {
                seq,
                layer,
                positions,
                q,
            } => {
                self.check_full_layer(layer)?;
                let shape = AttnShape {
                    q_heads: c.num_attention_heads,
                    kv_heads: c.num_key_value_heads,
                    head_dim: c.head_dim,
                };
                if q.shape[1..] != [shape.q_heads, shape.head_dim] {
                    return Err(Refusal(
                        "shape",
                        format!(
                            "queries {:?}: expected [t, {}, {}]",
                            q.shape, shape.q_heads, shape.head_dim
                        ),
                    ));
                }
                let pos: Vec<usize> = positions.iter().map(|&p| p as usize).collect();
                let pages: &[KvPage] = s.kv.get(&(seq, layer)).map_or(&[], |p| p.as_slice());
                let rows = pos.len() * shape.q_heads;
                let (mut o, mut m, mut l) = (Vec::new(), Vec::new(), Vec::new());
                for page in pages {
                    let p = self.backend.attend_page(shape, &q.data, &pos, page);
                    o.extend(p.o);
                    m.extend(p.m);
                    l.extend(p.l);
                }
                let n = pages.len();
                Ok(Message::AttnPartials {
                    seq,
                    layer,
                    page_starts: pages.iter().map(|p| p.start as u64).collect(),
                    o: WireTensor::f32(vec![n, rows, shape.head_dim], o),
                    m: WireTensor::f32(vec![n, rows], m),
                    l: WireTensor::f32(vec![n, rows], l),
                })
            }
            Message::KvTruncate { seq, len } => {
                let len = len as usize;
                for ((_, _), pages) in s.kv.range_mut((seq, 0)..=(seq, u32::MAX)) {
                    pages.retain(|p| p.start < len);
                    if let Some(p) = pages.last_mut() {
                        if p.start + p.len > len {
                            let row = p.k.len() / p.len;
                            p.len = len - p.start;
                            p.k.truncate(p.len * row);
                            p.v.truncate(p.len * row);
                        }
                    }
                }
                s.bytes =
                    s.kv.values()
                        .flatten()
                        .map(|p| (p.k.len() + p.v.len()) as u64 * 4)
                        .sum();
                Ok(Message::Ack)
            }
            Message::Ping { nonce } => Ok(Message::Pong { nonce }),
            Message::Stats(_) => {
                let mut counters = s.counters.clone();
                counters.insert("kv_bytes".into(), s.bytes);
                Ok(Message::Stats(counters))
            }
            other => Err(Refusal(
                "unsupported",
                format!("{:?} is not served by this helper yet", other.msg_type()),
            )),
        }
    }

    fn check_full_layer(&self, layer: u32) -> Result<(), Refusal> {
        match self.model.config.layer_types.get(layer as usize) {
            Some(LayerKind::FullAttention) => Ok(()),
            Some(LayerKind::LinearAttention) => Err(Refusal(
                "layer",
                format!("layer {layer} is a DeltaNet layer, it has no KV"),
            )),
            None => Err(Refusal(
                "layer",
                format!(
                    "layer {layer} does not exist (the model has {})",
                    self.model.config.num_hidden_layers
                ),
            )),
        }
    }
}

fn send(link: &mut dyn Link, req: u32, msg: Message) -> Result<(), LinkError> {
    link.send(encode(req, &msg))
}

fn refuse(link: &mut dyn Link, req: u32, code: &str, message: String) -> SessionEnd {
    let _ = send(link, req, Message::error(code, message.clone()));
    SessionEnd::Refused(format!("{code}: {message}"))
}
