//! The host's end of a helper link: handshake, then the requests a sequence makes of the
//! helper's KV pages. Requests are answered in order on one link, so a request waits for the
//! reply with its id; anything else is a protocol violation that ends the session.

use crate::backend::AttnShape;
use crate::backend::Partials;
use crate::cache_types::Encoded;
use crate::error::{Error, Result};
use crate::link::{Link, LinkError};
use crate::model::Model;
use crate::protocol::{
    decode, encode, Configure, Intro, Message, Role, WireTensor, PROTOCOL_VERSION,
};

/// Frames up to this size by default: one 4096-position KV page of the 27B model (4 KV heads
/// of 256) is 32 MiB for K and V together.
pub const DEFAULT_MAX_FRAME: usize = 256 << 20;

/// How long a request waits for its reply before the helper counts as gone.
const REPLY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(120);

/// Replies held for later requests at most (a pipeline keeps one per ubatch in flight).
const MAX_EARLY: usize = 4096;

/// The request/reply protocol of one helper link, without the link (sans-IO, as the
/// helper's `Session` is): it numbers and frames requests, files replies that arrive while an
/// earlier one is awaited, decodes them, and knows when the helper counts as lost.
/// [`HelperClient`] drives it over a blocking [`Link`]; a driver on another kind of link
/// feeds it the same way.
#[derive(Debug)]
pub struct Exchange {
    next_req: u32,
    /// The frame limit both sides agreed on.
    max_frame: usize,
    /// Replies that arrived while a later request was awaited: a pipelined prefill chunk's
    /// reply can come in while the host waits for an attention query.
    early: std::collections::BTreeMap<u32, Vec<u8>>,
    /// Why the helper counts as gone (its link failed, it stopped answering or broke the
    /// protocol): every later request fails at once with this, and the sequence's owner
    /// detaches it (see `Placement::offload`).
    lost: Option<String>,
}

impl Exchange {
    pub fn new(max_frame: usize) -> Exchange {
        Exchange {
            next_req: 0,
            max_frame,
            early: Default::default(),
            lost: None,
        }
    }

    /// The next request: its id and the frame that carries `msg`.
    pub fn frame(&mut self, msg: &Message) -> Result<(u32, Vec<u8>)> {
        let req = self.next_req;
        self.next_req = self.next_req.wrapping_add(1);
        let frame = encode(req, msg);
        if frame.len() > self.max_frame {
            return Err(Error::Remote(format!(
                "a {:?} of {} bytes exceeds the agreed frame limit of {} (raise --max-frame on both sides)",
                msg.msg_type(),
                frame.len(),
                self.max_frame
            )));
        }
        if let Some(why) = &self.lost {
            return Err(Error::Remote(why.clone()));
        }
        Ok((req, frame))
    }

    /// The helper is gone for `why`: the error to return, and every later one.
    pub fn fail(&mut self, why: String) -> Error {
        self.lost = Some(why.clone());
        Error::Remote(why)
    }

    /// The reply to `req`, if it arrived while another was awaited.
    pub fn early(&mut self, req: u32) -> Option<Result<Message>> {
        let frame = self.early.remove(&req)?;
        Some(self.decode(&frame))
    }

    /// `frame` came in while `req` is awaited: the reply to `req` if it is that one; the reply
    /// to an earlier request is kept for it. A frame without a header, the reply to a later
    /// request (replies come in order) or too many kept is the helper out of protocol.
    pub fn deliver(&mut self, req: u32, frame: Vec<u8>) -> Result<Option<Result<Message>>> {
        let id = crate::protocol::message::request_id(&frame)
            .ok_or_else(|| Error::Remote("a frame without a header from the helper".into()))?;
        if id == req {
            return Ok(Some(self.decode(&frame)));
        }
        if self.early.len() >= MAX_EARLY || id.wrapping_sub(req) < u32::MAX / 2 {
            return Err(Error::Remote(format!(
                "reply to request {id} while waiting for {req}"
            )));
        }
        self.early.insert(id, frame);
        Ok(None)
    }

    /// A reply frame as a message; an `Error` reply is the helper's refusal.
    fn decode(&self, frame: &[u8]) -> Result<Message> {
        let (_, reply) = decode(frame, self.max_frame)
            .map_err(|e| Error::Remote(format!("bad frame from helper: {e}")))?;
        match reply {
            Message::Error { code, message } => Err(Error::Refused { code, message }),
            other => Ok(other),
        }
    }
}

impl From<LinkError> for Error {
    fn from(e: LinkError) -> Self {
        Error::Remote(e.to_string())
    }
}

/// Pages attended and the seconds they took, summed: a speed, for the placement to compare a
/// helper with the host.
#[derive(Clone, Copy, Debug, Default)]
pub struct AttendRate {
    pub pages: u64,
    pub secs: f64,
}

impl AttendRate {
    pub fn add(&mut self, pages: usize, took: std::time::Duration) {
        self.pages += pages as u64;
        self.secs += took.as_secs_f64();
    }

    /// Pages per second; `None` before any.
    pub fn per_sec(&self) -> Option<f64> {
        (self.pages > 0 && self.secs > 0.0).then(|| self.pages as f64 / self.secs)
    }
}

pub struct HelperClient {
    /// This helper among a sequence's helpers (`Placement::attach` numbers them): the placement
    /// records which holds each page by it.
    pub id: u32,
    /// The helper refused a page for lack of memory: no more pages are offered to it (a round
    /// trip each) until a rewind frees some.
    pub full: bool,
    /// Attention queries answered, for the placement's measured speed: pages, and seconds
    /// from query to reply.
    attended: AttendRate,
    /// Attention replies collected, and the seconds the host blocked for them (after its own
    /// work: the time this helper cost it).
    waited: (u64, f64),
    /// The placement found attending its pages here faster than waiting for it: it holds no
    /// pages and is offered none (`Placement`, set_aside_slow_helpers).
    pub slow: bool,
    /// When each attention query still unanswered was sent, with its page count.
    asked_at: std::collections::BTreeMap<u32, (web_time::Instant, usize)>,
    link: Box<dyn Link>,
    /// The request/reply protocol over `link`.
    exchange: Exchange,
    seq: u64,
    /// What the helper said of itself.
    pub helper: Intro,
    /// The layers the helper runs in a split prefill (empty: KV pages only).
    pub prefill_layers: std::ops::Range<usize>,
    /// Its prefill speed against the host's, if `calibrate` measured it.
    pub speeds: Option<crate::host::plan::Speeds>,
    /// The helper's mirror of its prefill layers holds rows and state for positions below this.
    pub mirror_pos: usize,
    /// A rewind left the mirror's DeltaNet states at a later position than its rows: the next
    /// split prefill must push the host's states even if no rows are new.
    pub mirror_stale: bool,
}

impl HelperClient {
    /// Introduce this host (the model's identity), check the helper runs the same model, and
    /// assign it its part.
    pub fn connect(
        link: Box<dyn Link>,
        model: &Model,
        configure: Configure,
        max_frame: usize,
    ) -> Result<Self> {
        Self::connect_with(link, model, |_| configure, max_frame)
    }

    /// [`Self::connect`], with its part chosen from what the helper says of itself (its
    /// memory offer decides how many layers it can mirror).
    pub fn connect_with(
        link: Box<dyn Link>,
        model: &Model,
        configure: impl FnOnce(&Intro) -> Configure,
        max_frame: usize,
    ) -> Result<Self> {
        let mut c = HelperClient {
            id: 0,
            full: false,
            attended: AttendRate::default(),
            waited: (0, 0.0),
            slow: false,
            asked_at: Default::default(),
            link,
            exchange: Exchange::new(max_frame),
            seq: 0,
            prefill_layers: 0..0,
            speeds: None,
            mirror_pos: 0,
            mirror_stale: false,
            helper: Intro {
                version: PROTOCOL_VERSION,
                model: String::new(),
                model_digest: String::new(),
                role: Role::Helper,
                mem_offer: 0,
                backends: Vec::new(),
                max_frame: 0,
                device: String::new(),
            },
        };
        match c.request(hello(model, max_frame))? {
            Message::Welcome(intro) if intro.model_digest == model.identity.digest => {
                c.helper = intro
            }
            Message::Welcome(intro) => {
                return Err(Error::Remote(format!(
                    "the helper runs a different model: {} there, {} here",
                    intro.model, model.identity.name
                )))
            }
            other => return Err(unexpected("Welcome", &other)),
        }
        c.exchange.max_frame = c.exchange.max_frame.min(c.helper.max_frame as usize);
        let configure = configure(&c.helper);
        c.configure(configure)?;
        Ok(c)
    }

    /// Assign the helper its part (again): it drops every sequence it held.
    pub fn configure(&mut self, configure: Configure) -> Result<()> {
        let layers = configure.first_layer as usize..configure.end_layer as usize;
        match self.request(Message::Configure(configure))? {
            Message::Ack => {
                self.prefill_layers = layers;
                self.mirror_pos = 0;
                self.mirror_stale = false;
                Ok(())
            }
            other => Err(unexpected("Ack", &other)),
        }
    }

    /// Send `msg` and wait for its reply; an `Error` reply becomes `Error::Remote`.
    pub fn request(&mut self, msg: Message) -> Result<Message> {
        let req = self.send(&msg)?;
        self.reply(req)
    }

    /// Queue `msg` without waiting; returns its request id for [`Self::reply`]. Replies come
    /// back in request order, so a pipeline sends ahead and collects later.
    pub fn send(&mut self, msg: &Message) -> Result<u32> {
        let (req, frame) = self.exchange.frame(msg)?;
        if let Err(e) = self.link.send(frame) {
            return Err(self.exchange.fail(e.to_string()));
        }
        Ok(req)
    }

    /// Why the helper is gone, if it is.
    pub fn lost(&self) -> Option<&str> {
        self.exchange.lost.as_deref()
    }

    pub fn is_lost(&self) -> bool {
        self.exchange.lost.is_some()
    }

    /// Whether pages may be offered to it: not full, not set aside as slow, not lost.
    pub fn takes_pages(&self) -> bool {
        !self.full && !self.slow && !self.is_lost()
    }

    /// The reply to request `req`, waiting on the link for it. The helper answers in request
    /// order, so replies to requests sent before `req` may arrive first; they are kept for
    /// their own `reply` call. A link that fails or stays silent, or a reply out of protocol,
    /// loses the helper.
    pub fn reply(&mut self, req: u32) -> Result<Message> {
        if let Some(why) = self.lost() {
            return Err(Error::Remote(why.to_string()));
        }
        let reply = match self.exchange.early(req) {
            Some(reply) => reply,
            None => self.wait_for(req),
        };
        match reply {
            Err(Error::Remote(why)) => Err(self.exchange.fail(why)),
            other => other,
        }
    }

    /// Frames off the link until the reply to `req` (the blocking driver of [`Exchange`]).
    fn wait_for(&mut self, req: u32) -> Result<Message> {
        loop {
            // A helper that stops answering without closing the link (a suspended phone)
            // counts as gone, so the host falls back instead of waiting forever.
            let frame = self.link.recv_timeout(REPLY_TIMEOUT)?.ok_or_else(|| {
                Error::Remote(format!(
                    "no reply to request {req} in {} s",
                    REPLY_TIMEOUT.as_secs()
                ))
            })?;
            if let Some(reply) = self.exchange.deliver(req, frame)? {
                return reply;
            }
        }
    }

    /// The frame limit both sides agreed on.
    pub fn max_frame(&self) -> usize {
        self.exchange.max_frame
    }

    pub fn seq(&self) -> u64 {
        self.seq
    }

    pub fn ping(&mut self) -> Result<()> {
        match self.request(Message::Ping { nonce: 7 })? {
            Message::Pong { nonce: 7 } => Ok(()),
            other => Err(unexpected("Pong", &other)),
        }
    }
}

/// A host's `Hello` for `model`, offering frames up to `max_frame` bytes.
pub fn hello(model: &Model, max_frame: usize) -> Message {
    Message::Hello(Intro {
        version: PROTOCOL_VERSION,
        model: model.identity.name.clone(),
        model_digest: model.identity.digest.clone(),
        role: Role::Host,
        mem_offer: 0,
        backends: vec!["cpu".into()],
        max_frame: max_frame as u64,
        device: crate::protocol::device_kind().into(),
    })
}

pub(crate) fn unexpected(want: &str, got: &Message) -> Error {
    Error::Remote(format!(
        "expected {want}, the helper sent {:?}",
        got.msg_type()
    ))
}

impl HelperClient {
    /// Hand the page of `layer` at `start` (its rows `k`, `v` `[rows, width]` as the page
    /// stores them, read to the host) to the helper: the oldest page still on the host, or one re-filled from the page
    /// file.
    pub fn store(
        &mut self,
        layer: usize,
        start: usize,
        width: usize,
        (k, v): (Encoded, Encoded),
    ) -> Result<()> {
        let rows = k.rows(width).unwrap_or(0);
        let msg = Message::KvAppend {
            seq: self.seq,
            layer: layer as u32,
            start: start as u64,
            k: WireTensor::new(vec![rows, width], k),
            v: WireTensor::new(vec![rows, width], v),
        };
        match self.request(msg)? {
            Message::Ack => Ok(()),
            other => Err(self.broke_with(unexpected("Ack", &other))),
        }
    }

    /// KV rows `[len, kv_heads * head_dim]` of `layer` from position `start`, back from the helper.
    pub fn fetch(&mut self, layer: usize, start: usize, len: usize) -> Result<(Encoded, Encoded)> {
        let msg = Message::KvFetch {
            seq: self.seq,
            layer: layer as u32,
            start: start as u64,
            len: len as u64,
        };
        match self.request(msg)? {
            Message::KvRows { k, v, start: s, .. }
                if s as usize == start && k.shape.first() == Some(&len) =>
            {
                Ok((k.data, v.data))
            }
            other => Err(self.broke_with(unexpected("KvRows", &other))),
        }
    }

    /// Drop every position `>= len` the helper holds for this sequence (pages and mirror).
    pub fn truncate(&mut self, len: usize) -> Result<()> {
        match self.request(Message::KvTruncate {
            seq: self.seq,
            len: len as u64,
        })? {
            Message::Ack => {
                self.mirror_pos = self.mirror_pos.min(len);
                self.mirror_stale = true;
                Ok(())
            }
            other => Err(self.broke_with(unexpected("Ack", &other))),
        }
    }

    /// Ask for one partial per page of `layer` the helper holds below position `end`; the
    /// answer is collected with [`Self::attend_reply`], so the host can attend its own pages (or
    /// run another ubatch) while the helper works.
    pub fn attend_send(
        &mut self,
        layer: usize,
        shape: AttnShape,
        q: Vec<f32>,
        positions: &[usize],
        end: usize,
        pages: usize,
    ) -> Result<u32> {
        let req = self.send(&Message::AttnQuery {
            seq: self.seq,
            layer: layer as u32,
            positions: positions.iter().map(|&p| p as u64).collect(),
            end: end as u64,
            q: WireTensor::f32(vec![positions.len(), shape.q_heads, shape.head_dim], q),
        })?;
        if self.asked_at.len() < MAX_EARLY {
            self.asked_at.insert(req, (web_time::Instant::now(), pages));
        }
        Ok(req)
    }

    /// Pages attended per second, measured from query to reply over this helper's answers so
    /// far (link time included: that is what the host waits for); `None` before any.
    pub fn pages_per_sec(&self) -> Option<f64> {
        self.attended.per_sec()
    }

    /// Seconds the host blocked for one attention reply, on average over the replies so far
    /// (the time it cost the host beyond its own work), and how many there were.
    pub fn mean_wait(&self) -> (f64, u64) {
        let (n, secs) = self.waited;
        (secs / n.max(1) as f64, n)
    }

    /// The partials asked for by request `req`, for `rows` (query row, head) pairs, one per
    /// page starting at `starts`, in page order. Anything else is a helper out of protocol: it
    /// counts as lost, since its pages can no longer be trusted.
    pub fn attend_reply(
        &mut self,
        req: u32,
        rows: usize,
        head_dim: usize,
        starts: &[u64],
    ) -> Result<Vec<Partials>> {
        let asked = self.asked_at.remove(&req);
        let blocked = web_time::Instant::now();
        let reply = self.reply(req)?;
        self.waited.0 += 1;
        self.waited.1 += blocked.elapsed().as_secs_f64();
        if let Some((at, pages)) = asked {
            self.attended.add(pages, at.elapsed());
        }
        match reply {
            Message::AttnPartials {
                o,
                m,
                l,
                page_starts,
                ..
            } => {
                let (d, pages) = (head_dim, starts.len());
                if page_starts != starts || o.shape != [pages, rows, d] {
                    return Err(self.broke(format!(
                        "partials of pages {page_starts:?} and shape {:?}, expected pages \
                         {starts:?} of [{rows}, {d}]",
                        o.shape
                    )));
                }
                // The frame's shapes are checked (`partials`): these are whole pages.
                let (o, m, l) = (o.values(), m.values(), l.values());
                Ok((0..pages)
                    .map(|p| Partials {
                        head_dim: d,
                        o: o[p * rows * d..(p + 1) * rows * d].to_vec(),
                        m: m[p * rows..(p + 1) * rows].to_vec(),
                        l: l[p * rows..(p + 1) * rows].to_vec(),
                    })
                    .collect())
            }
            other => Err(self.broke_with(unexpected("AttnPartials", &other))),
        }
    }

    /// A reply out of protocol: the helper counts as lost from now on.
    fn broke(&mut self, why: String) -> Error {
        self.exchange.fail(why)
    }

    fn broke_with(&mut self, e: Error) -> Error {
        match e {
            Error::Remote(why) => self.broke(why),
            other => other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The helper's reply to request `req`.
    fn reply(req: u32, msg: &Message) -> Vec<u8> {
        encode(req, msg)
    }

    #[test]
    fn replies_to_earlier_requests_wait_for_their_own_call() {
        let mut x = Exchange::new(DEFAULT_MAX_FRAME);
        let (first, _) = x.frame(&Message::Ping { nonce: 1 }).unwrap();
        let (second, _) = x.frame(&Message::Ping { nonce: 2 }).unwrap();
        // The second is awaited first: the first's reply is filed, not taken for it.
        let filed = x.deliver(second, reply(first, &Message::Pong { nonce: 1 }));
        assert!(matches!(filed, Ok(None)));
        let got = x.deliver(second, reply(second, &Message::Pong { nonce: 2 }));
        assert!(matches!(got, Ok(Some(Ok(Message::Pong { nonce: 2 })))));
        assert!(matches!(
            x.early(first),
            Some(Ok(Message::Pong { nonce: 1 }))
        ));
        assert!(x.early(first).is_none(), "a reply is taken once");
    }

    #[test]
    fn out_of_protocol_frames_and_refusals_are_told_apart() {
        let mut x = Exchange::new(DEFAULT_MAX_FRAME);
        let (req, _) = x.frame(&Message::Ping { nonce: 1 }).unwrap();
        // A reply to a request not yet sent: the helper is out of protocol.
        let later = x.deliver(req, reply(req + 1, &Message::Ack));
        assert!(matches!(later, Err(Error::Remote(_))));
        assert!(matches!(
            x.deliver(req, vec![1, 2, 3]),
            Err(Error::Remote(_))
        ));
        // An Error reply is a refusal, which leaves the helper usable.
        let refused = x.deliver(req, reply(req, &Message::error("memory", "full")));
        assert!(matches!(refused, Ok(Some(Err(Error::Refused { .. })))));
        assert!(x.frame(&Message::Ack).is_ok());
    }

    #[test]
    fn a_lost_helper_takes_no_more_requests_and_frames_keep_the_limit() {
        let mut x = Exchange::new(64);
        let big = Message::Bye {
            reason: "x".repeat(100),
        };
        assert!(matches!(x.frame(&big), Err(Error::Remote(why)) if why.contains("frame limit")));
        let e = x.fail("the link closed".into());
        assert!(matches!(e, Error::Remote(_)));
        assert!(
            matches!(x.frame(&Message::Ack), Err(Error::Remote(why)) if why == "the link closed")
        );
    }
}
