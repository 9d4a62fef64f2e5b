//! The production link: one WebSocket over plain TCP, each frame one binary message. WebSocket
//! because a browser helper can speak it too; no TLS because the link is a cable or a LAN.
//!
//! tungstenite's `WebSocket` is one object for both directions, so after the handshake the
//! connection is driven by two: the handshake's (which keeps any bytes read past the HTTP
//! response) on a reader thread, and one over a clone of the TCP stream on a writer thread.
//! Sending a big ubatch then never waits for, or stalls, an incoming reply. This is sound only
//! while the reader never writes: tungstenite writes from `read` just to answer a ping or a
//! close, so the reader stops at either and the protocol's own Ping/Pong frames do liveness.
//!
//! Frames read wait for the link's owner in a queue of [`INCOMING_FRAMES`]; past that the
//! reader stops reading and TCP flow control holds a peer that sends faster than this end
//! takes frames, instead of this end's memory growing with whatever the peer sends.
//!
//! The bound cannot deadlock: the only thread that waits on it is this end's reader, and it
//! waits for this end's owner to `recv`. A host's sending never waits on the peer:
//! [`Link::send`] queues the frame for the writer thread, and that queue is not bounded (it
//! holds only what the host chose to send). So a host blocks only in `recv`, which a frame
//! from the peer or the link closing ends. A helper's replies are what its peer asks for, so a
//! helper bounds its queue ([`WsLink::bound_sends`]): past the bound its `send` waits for the
//! peer to read, and a peer that reads nothing for the stall time loses the link. That cannot
//! deadlock either, since the host it waits on never waits to send. A host in a pipelined
//! split prefill sends many `PrefillChunk`s before it reads any reply: they wait in its
//! writer's queue and the socket while the helper's reader holds off, and TCP then stalls only the host's writer thread; the helper
//! answers each chunk it takes (its replies queue on its own writer, which the host's reader
//! drains while it has room), and the host reads them once it has sent all its chunks.

use std::io::ErrorKind;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, SyncSender};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use tungstenite::error::{CapacityError, ProtocolError};
use tungstenite::handshake::server::{ErrorResponse, Request, Response};
use tungstenite::handshake::{HandshakeError, HandshakeRole};
use tungstenite::http::{StatusCode, Uri};
use tungstenite::protocol::{Role, WebSocketConfig};
use tungstenite::{Message, WebSocket};

use super::admission::{Admission, Busy, Limits, Ticket};
use super::{Link, LinkError, LinkSender};

/// A peer that connects but never completes the HTTP upgrade must not hang `accept` forever:
/// each read and write of the handshake waits at most this, and the listener's admission
/// closes a connection whose whole handshake takes longer.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// A listener's bounds on connections not yet let in ([`WsListener::admitting`] shares another
/// table instead): a helper serves
/// one host, and a host takes a few helpers, so a few handshakes at once from one address and
/// a few dozen in all are plenty; past them the oldest idle ones give way (see
/// [`super::admission`]). The deadline covers the WebSocket upgrade and, for the caller that
/// keeps the [`Pending::take_ticket`] until its own handshake ends, the secure one too.
pub const LISTENER_LIMITS: Limits = Limits {
    per_source: 8,
    total: 64,
    deadline: Some(HANDSHAKE_TIMEOUT),
};

/// How long a dropped link's socket stays open for reading after its Close, waiting for the
/// peer to close too. Closing a socket with unread bytes in it makes the close a reset, and a
/// reset can make the peer discard frames it had received but not yet read (a refusal sent
/// just before the drop, say).
const LINGER: Duration = Duration::from_secs(2);

/// Frames read from the peer that may wait for the owner's `recv`; the reader holds one more.
/// Small, since a frame may be as large as the frame limit, but enough that the reader keeps
/// reading while the owner handles the frame before.
pub const INCOMING_FRAMES: usize = 4;

/// What a helper's replies may hold of its memory while its host does not read them: a
/// pipelined prefill keeps a few ubatches' replies in flight (tens of MB for the 27B), and a
/// host that asks and never reads must not grow it further.
pub const HELPER_SEND_QUEUE: usize = 64 << 20;

/// How long a helper's reply waits for its host to read anything before the link is dropped.
pub const HELPER_SEND_STALL: Duration = Duration::from_secs(60);

/// When bytes last arrived on a socket, as nanoseconds since the socket was watched: the
/// reader thread writes it, the link's owner reads it ([`Link::heard`]).
#[derive(Clone)]
struct Heard {
    since: Instant,
    nanos: Arc<AtomicU64>,
}

impl Heard {
    fn new() -> Heard {
        Heard {
            since: Instant::now(),
            nanos: Arc::default(),
        }
    }

    fn now(&self) {
        let n = self.since.elapsed().as_nanos().min(u64::MAX as u128) as u64;
        self.nanos.store(n, Ordering::Relaxed);
    }

    fn at(&self) -> Instant {
        self.since + Duration::from_nanos(self.nanos.load(Ordering::Relaxed))
    }
}

/// The reading side's socket, noting when bytes arrive: a large frame still on its way (a
/// slow link) proves the peer alive before it is whole.
struct Watched {
    stream: TcpStream,
    heard: Heard,
}

impl Watched {
    fn new(stream: TcpStream) -> Watched {
        Watched {
            stream,
            heard: Heard::new(),
        }
    }
}

impl std::io::Read for Watched {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.stream.read(buf)?;
        if n > 0 {
            self.heard.now();
        }
        Ok(n)
    }
}

impl std::io::Write for Watched {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.stream.write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.stream.flush()
    }
}

/// Why the writer thread stopped, for the `send` that finds it gone.
type Failure = Arc<Mutex<Option<String>>>;

/// Bytes queued for the writer thread and not yet written, and whether it stopped: what a
/// bounded sender ([`WsLink::bound_sends`]) waits on.
#[derive(Default)]
struct Backlog {
    state: Mutex<(usize, bool)>,
    room: std::sync::Condvar,
}

impl Backlog {
    fn lock(&self) -> std::sync::MutexGuard<'_, (usize, bool)> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The writer wrote `bytes` (or, with `stopped`, will write no more).
    fn written(&self, bytes: usize, stopped: bool) {
        let mut s = self.lock();
        s.0 = s.0.saturating_sub(bytes);
        s.1 |= stopped;
        self.room.notify_all();
    }

    /// Counts `len` more bytes queued, first waiting while the queue holds more than `limit`
    /// with them (a frame into an empty queue always goes); fails once the writer has written
    /// nothing for `stall`.
    fn reserve(&self, len: usize, limit: usize, stall: Duration) -> Result<(), String> {
        let mut s = self.lock();
        while s.0 > 0 && s.0.saturating_add(len) > limit && !s.1 {
            let before = s.0;
            let (next, waited) = self
                .room
                .wait_timeout(s, stall)
                .unwrap_or_else(PoisonError::into_inner);
            s = next;
            if waited.timed_out() && s.0 >= before {
                return Err(format!(
                    "the peer read nothing for {} s while {} bytes waited for it",
                    stall.as_secs(),
                    s.0
                ));
            }
        }
        s.0 += len;
        Ok(())
    }
}

/// Limits both a single WebSocket frame and a reassembled message to the link's frame limit;
/// tungstenite checks a frame's announced length before reserving memory for it, and a
/// fragmented message's length before appending each fragment.
fn config(max_frame: usize) -> WebSocketConfig {
    WebSocketConfig::default()
        .max_frame_size(Some(max_frame))
        .max_message_size(Some(max_frame))
}

fn link_error(err: tungstenite::Error, peer: SocketAddr) -> LinkError {
    use tungstenite::Error as E;
    match err {
        E::ConnectionClosed
        | E::AlreadyClosed
        | E::Protocol(ProtocolError::ResetWithoutClosingHandshake) => {
            LinkError::Closed(format!("{peer} went away"))
        }
        E::Io(e)
            if matches!(
                e.kind(),
                ErrorKind::ConnectionReset
                    | ErrorKind::ConnectionAborted
                    | ErrorKind::BrokenPipe
                    | ErrorKind::UnexpectedEof
            ) =>
        {
            LinkError::Closed(format!("{peer}: {e}"))
        }
        E::Capacity(CapacityError::MessageTooLong { size, max_size }) => LinkError::TooLarge {
            len: size,
            limit: max_size,
        },
        other => LinkError::Io(format!("{peer}: {other}")),
    }
}

fn handshake_error<R: HandshakeRole>(err: HandshakeError<R>, peer: SocketAddr) -> LinkError {
    match err {
        HandshakeError::Interrupted(_) => LinkError::Io(format!(
            "WebSocket handshake with {peer} did not finish within {HANDSHAKE_TIMEOUT:?}"
        )),
        HandshakeError::Failure(e) => link_error(e, peer),
    }
}

fn io_error(what: String) -> impl FnOnce(std::io::Error) -> LinkError {
    move |e| LinkError::Io(format!("{what}: {e}"))
}

/// Returns the clone the writer will own; the original goes to the handshake.
fn prepare(stream: &TcpStream, peer: SocketAddr) -> Result<TcpStream, LinkError> {
    // Frames are whole messages already; Nagle would hold back the tail of each.
    stream
        .set_nodelay(true)
        .map_err(io_error(format!("TCP_NODELAY on {peer}")))?;
    stream
        .set_read_timeout(Some(HANDSHAKE_TIMEOUT))
        .and_then(|()| stream.set_write_timeout(Some(HANDSHAKE_TIMEOUT)))
        .map_err(io_error(format!("timeouts on {peer}")))?;
    stream
        .try_clone()
        .map_err(io_error(format!("cloning the socket of {peer}")))
}

/// Opens a link to a helper's [`WsListener`]. `max_frame` bounds frames both ways.
pub fn connect(url: &str, max_frame: usize) -> Result<WsLink, LinkError> {
    let uri: Uri = url
        .parse()
        .map_err(|e| LinkError::Io(format!("link URL {url}: {e}")))?;
    if uri.scheme_str() != Some("ws") {
        return Err(LinkError::Io(format!(
            "link URL {url}: only ws:// is supported"
        )));
    }
    let host = uri
        .host()
        .ok_or_else(|| LinkError::Io(format!("link URL {url}: no host")))?;
    // An IPv6 host comes bracketed, as written in the URL.
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let stream = connect_tcp(host, uri.port_u16().unwrap_or(80))
        .map_err(io_error(format!("connecting to {url}")))?;
    let peer = stream
        .peer_addr()
        .map_err(io_error(format!("connecting to {url}")))?;
    let writer = prepare(&stream, peer)?;
    let (reader, _response) =
        tungstenite::client::client_with_config(url, Watched::new(stream), Some(config(max_frame)))
            .map_err(|e| handshake_error(e, peer))?;
    WsLink::start(reader, writer, Role::Client, max_frame, peer)
}

/// How long a connection attempt may take: a helper that is unplugged or asleep on a network
/// (no refusal, no answer) must not hold its host for the system's minutes-long default.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// A TCP connection to the first of `host`'s addresses that answers within the timeout.
fn connect_tcp(host: &str, port: u16) -> std::io::Result<TcpStream> {
    let mut last = None;
    for addr in (host, port).to_socket_addrs()? {
        match TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT) {
            Ok(s) => return Ok(s),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::NotFound,
            format!("{host} has no address"),
        )
    }))
}

/// Where a helper waits for its host.
pub struct WsListener {
    listener: TcpListener,
    local_addr: SocketAddr,
    max_frame: usize,
    browsers: bool,
    admission: Admission,
}

impl WsListener {
    /// `addr` as for [`TcpListener::bind`], e.g. `0.0.0.0:7878`, or port 0 for any free port.
    pub fn bind(addr: &str, max_frame: usize) -> Result<WsListener, LinkError> {
        let listener = TcpListener::bind(addr).map_err(io_error(format!("binding {addr}")))?;
        let local_addr = listener
            .local_addr()
            .map_err(io_error(format!("binding {addr}")))?;
        Ok(WsListener {
            listener,
            local_addr,
            max_frame,
            browsers: false,
            admission: Admission::new(LISTENER_LIMITS),
        })
    }

    /// Admit connections into `admission` (shared with the connections that reach its owner
    /// some other way) instead of a table of this listener's own.
    pub fn admitting(mut self, admission: Admission) -> Self {
        self.admission = admission;
        self
    }

    /// The table of connections not yet let in (for counts in logs and tests).
    pub fn admission(&self) -> &Admission {
        &self.admission
    }

    /// Whether WebSocket upgrades from web pages (requests with an `Origin` header) are let
    /// through. Off by default: any page a user opens may try to reach a loopback port, so a
    /// helper lets browsers in only when its links are paired and encrypted.
    pub fn allow_browsers(mut self, allowed: bool) -> Self {
        self.browsers = allowed;
        self
    }

    /// The bound address, with the port the system chose for port 0.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Waits for the next TCP connection and admits it (older connections not yet let in may
    /// be closed to make room, see [`LISTENER_LIMITS`]). Its WebSocket handshake is
    /// [`Pending::upgrade`], which a server runs on a thread of its own so that a slow or
    /// silent peer never holds up the next one.
    pub fn next(&self) -> Result<Pending, LinkError> {
        let (stream, peer, ticket) = loop {
            let (stream, peer) = self
                .listener
                .accept()
                .map_err(io_error(format!("accepting on {}", self.local_addr)))?;
            let shut = stream
                .try_clone()
                .map_err(io_error(format!("cloning the socket of {peer}")))?;
            let admitted = self.admission.admit(peer.ip(), move || {
                // Wakes whichever thread reads it, which then fails its handshake.
                let _ = shut.shutdown(Shutdown::Both);
            });
            // No room (every place busy): dropping the stream closes it.
            if let Some(ticket) = admitted {
                break (stream, peer, ticket);
            }
        };
        Ok(Pending {
            stream,
            peer,
            max_frame: self.max_frame,
            browsers: self.browsers,
            head: 0,
            ticket: Some(ticket),
        })
    }

    /// Waits for the next connection and completes its WebSocket handshake. An error concerns
    /// that connection only; the listener can accept again.
    pub fn accept(&self) -> Result<WsLink, LinkError> {
        self.next()?.upgrade()
    }
}

/// A TCP connection whose WebSocket handshake is still to come.
pub struct Pending {
    stream: TcpStream,
    peer: SocketAddr,
    max_frame: usize,
    browsers: bool,
    /// The length of the request head [`Pending::asks`] saw (still unread).
    head: usize,
    /// Its place among the connections not yet let in: dropped with the upgrade, unless taken.
    ticket: Option<Ticket>,
}

/// What a connection to a [`WsListener`] asks for.
#[derive(Debug, PartialEq, Eq)]
pub enum Asks {
    /// A WebSocket: [`Pending::upgrade`] it.
    Upgrade,
    /// A plain HTTP request (a page, a file): [`Pending::answer`] it.
    Plain { method: String, target: String },
}

/// The largest request head [`Pending::asks`] reads (a browser's is a few hundred bytes).
const MAX_HEAD: usize = 8192;

impl Pending {
    pub fn peer_addr(&self) -> SocketAddr {
        self.peer
    }

    /// Its place among the connections not yet let in, for a caller whose own handshake
    /// (the secure link's) follows the upgrade: the connection stays bounded and timed until
    /// the ticket is dropped.
    pub fn take_ticket(&mut self) -> Option<Ticket> {
        self.ticket.take()
    }

    /// Marks the connection busy while a plain request is answered (a lent tensor may take
    /// longer than a handshake): it is then neither timed nor pushed out, but still counted.
    pub fn busy(&self) -> Option<Busy> {
        self.ticket.as_ref().map(Ticket::busy)
    }

    /// Reads the request's head without taking it from the socket (within
    /// [`HANDSHAKE_TIMEOUT`]), so an upgrade still finds it: a host that lends a browser tab
    /// its page and weights answers plain requests on the port helpers join.
    pub fn asks(&mut self) -> Result<Asks, LinkError> {
        let peer = self.peer;
        self.stream
            .set_read_timeout(Some(HANDSHAKE_TIMEOUT))
            .map_err(io_error(format!("timeouts on {peer}")))?;
        let deadline = std::time::Instant::now() + HANDSHAKE_TIMEOUT;
        let mut buf = vec![0u8; MAX_HEAD];
        let mut seen = 0;
        loop {
            let n = self
                .stream
                .peek(&mut buf)
                .map_err(io_error(format!("reading the request of {peer}")))?;
            if n == 0 {
                return Err(LinkError::Closed(format!("{peer} closed before asking")));
            }
            let mut headers = [httparse::EMPTY_HEADER; 64];
            let mut req = httparse::Request::new(&mut headers);
            match req.parse(&buf[..n]) {
                Ok(httparse::Status::Complete(head)) => {
                    self.head = head;
                    return Ok(what_is_asked(&req));
                }
                Ok(httparse::Status::Partial) if n < MAX_HEAD => {}
                Ok(httparse::Status::Partial) | Err(_) => {
                    return Err(LinkError::Io(format!(
                        "{peer} sent no valid HTTP request head"
                    )))
                }
            }
            if std::time::Instant::now() > deadline {
                return Err(LinkError::Io(format!(
                    "{peer} sent no whole request in time"
                )));
            }
            // A peek returns what arrived so far at once; wait for more.
            if n == seen {
                thread::sleep(Duration::from_millis(5));
            }
            seen = n;
        }
    }

    /// Answers a plain request with `status`, `headers` and `body`, then closes (within
    /// [`HANDSHAKE_TIMEOUT`] per write). The request's head is read first: a socket closed
    /// with bytes unread is reset, and the peer may lose the answer.
    pub fn answer(
        self,
        status: u16,
        headers: &[(&str, String)],
        body: &[u8],
    ) -> Result<(), LinkError> {
        use std::io::Read;
        use std::io::Write;
        let peer = self.peer;
        let mut stream = self.stream;
        stream
            .set_write_timeout(Some(HANDSHAKE_TIMEOUT))
            .map_err(io_error(format!("timeouts on {peer}")))?;
        let mut head = vec![0u8; self.head];
        stream
            .read_exact(&mut head)
            .map_err(io_error(format!("reading the request of {peer}")))?;
        let reason = StatusCode::from_u16(status)
            .ok()
            .and_then(|s| s.canonical_reason())
            .unwrap_or("");
        let mut head = format!("HTTP/1.1 {status} {reason}\r\n");
        for (name, value) in headers {
            head.push_str(&format!("{name}: {value}\r\n"));
        }
        head.push_str(&format!(
            "Content-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        ));
        stream
            .write_all(head.as_bytes())
            .and_then(|()| stream.write_all(body))
            .and_then(|()| stream.flush())
            .map_err(io_error(format!("answering {peer}")))?;
        let _ = stream.shutdown(Shutdown::Write);
        Ok(())
    }

    /// The WebSocket handshake (within [`HANDSHAKE_TIMEOUT`]); a web page's request is turned
    /// away with 403 unless the listener allows browsers. The link remembers which page asked
    /// ([`WsLink::origin`]).
    pub fn upgrade(self) -> Result<WsLink, LinkError> {
        let Pending {
            stream,
            peer,
            max_frame,
            browsers,
            ..
        } = self;
        let writer = prepare(&stream, peer)?;
        let mut origin = PageOrigin::NotAPage;
        let asked = &mut origin;
        // tungstenite's callback type fixes the large error (an HTTP response).
        #[allow(clippy::result_large_err)]
        let check_origin = |req: &Request, resp: Response| match req.headers().get("origin") {
            Some(origin) if !browsers => {
                let body = format!(
                    "this helper does not take links from web pages ({}) unless it pairs them",
                    origin.to_str().unwrap_or("?")
                );
                let mut refusal = ErrorResponse::new(Some(body));
                *refusal.status_mut() = StatusCode::FORBIDDEN;
                Err(refusal)
            }
            Some(o) => {
                let host = req.headers().get("host").and_then(|h| h.to_str().ok());
                *asked = PageOrigin::of(o.to_str().unwrap_or("?"), host);
                Ok(resp)
            }
            None => Ok(resp),
        };
        let reader = tungstenite::accept_hdr_with_config(
            Watched::new(stream),
            check_origin,
            Some(config(max_frame)),
        )
        .map_err(|e| handshake_error(e, peer))?;
        let mut link = WsLink::start(reader, writer, Role::Server, max_frame, peer)?;
        link.origin = origin;
        Ok(link)
    }
}

/// Which web page, if any, opened a WebSocket: a page may pair only from the host that served
/// it, since any page a user opens can reach a device on the LAN or loopback and guess codes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PageOrigin {
    /// No `Origin` header: not a browser (a native helper or host).
    NotAPage,
    /// A page this server served itself (its `Origin` names the `Host` it asked).
    SameHost,
    /// Another site's page: its origin.
    Other(String),
}

impl PageOrigin {
    /// The origin of a request with `Origin: origin`, sent to `host` (its `Host` header).
    pub fn of(origin: &str, host: Option<&str>) -> PageOrigin {
        let authority = origin
            .strip_prefix("http://")
            .or_else(|| origin.strip_prefix("https://"));
        match (authority, host) {
            (Some(a), Some(h)) if a.eq_ignore_ascii_case(h.trim()) => PageOrigin::SameHost,
            _ => PageOrigin::Other(crate::printable::printable(origin)),
        }
    }
}

/// An upgrade asks for `Upgrade: websocket`; anything else is a plain request.
fn what_is_asked(req: &httparse::Request) -> Asks {
    let upgrade = req.headers.iter().any(|h| {
        h.name.eq_ignore_ascii_case("upgrade")
            && std::str::from_utf8(h.value)
                .is_ok_and(|v| v.trim().eq_ignore_ascii_case("websocket"))
    });
    match upgrade {
        true => Asks::Upgrade,
        false => Asks::Plain {
            method: req.method.unwrap_or("").to_string(),
            target: req.path.unwrap_or("/").to_string(),
        },
    }
}

/// One end of a WebSocket link. Dropping it sends the frames still queued, then a Close, so the
/// peer's `recv` reports [`LinkError::Closed`] after the last frame; the socket is shut once the
/// peer closes too, or [`LINGER`] later.
pub struct WsLink {
    out: WsSender,
    incoming: Receiver<Result<Vec<u8>, LinkError>>,
    peer: SocketAddr,
    origin: PageOrigin,
    /// When bytes last arrived ([`Watched`]).
    heard: Heard,
}

#[derive(Clone)]
struct WsSender {
    queue: Sender<Vec<u8>>,
    max_frame: usize,
    failure: Failure,
    backlog: Arc<Backlog>,
    /// Bytes the queue may hold, and how long a send waits for the peer to read
    /// ([`WsLink::bound_sends`]); unbounded if `None`.
    bound: Option<(usize, Duration)>,
    /// Shuts the socket when a bounded send gives up on the peer.
    socket: Arc<TcpStream>,
}

impl WsSender {
    fn failed(&self) -> Option<String> {
        self.failure
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    fn stopped(&self) -> LinkError {
        LinkError::Closed(
            self.failed()
                .unwrap_or_else(|| "WebSocket writer stopped".into()),
        )
    }
}

impl LinkSender for WsSender {
    fn send(&mut self, frame: Vec<u8>) -> Result<(), LinkError> {
        if frame.len() > self.max_frame {
            return Err(LinkError::TooLarge {
                len: frame.len(),
                limit: self.max_frame,
            });
        }
        if let Some(why) = self.failed() {
            return Err(LinkError::Closed(why));
        }
        let (limit, stall) = self.bound.unwrap_or((usize::MAX, Duration::MAX));
        if let Err(why) = self.backlog.reserve(frame.len(), limit, stall) {
            *self.failure.lock().unwrap_or_else(PoisonError::into_inner) = Some(why.clone());
            // The writer and reader stop; every later send fails at once.
            let _ = self.socket.shutdown(Shutdown::Both);
            return Err(LinkError::Closed(why));
        }
        self.queue.send(frame).map_err(|_| self.stopped())
    }
}

impl WsLink {
    fn start(
        mut reader: WebSocket<Watched>,
        writer: TcpStream,
        role: Role,
        max_frame: usize,
        peer: SocketAddr,
    ) -> Result<WsLink, LinkError> {
        // Both halves share one socket, so this clears the handshake's timeouts for both.
        let heard = reader.get_ref().heard.clone();
        let socket = &reader.get_mut().stream;
        socket
            .set_read_timeout(None)
            .and_then(|()| socket.set_write_timeout(None))
            .map_err(io_error(format!("timeouts on {peer}")))?;
        let mut writer = WebSocket::from_raw_socket(writer, role, Some(config(max_frame)));

        let (in_tx, incoming) = mpsc::sync_channel(INCOMING_FRAMES);
        // Never sent on: its sender drops when the reader ends, which is what the writer waits for.
        let (reading, reader_done) = mpsc::channel::<()>();
        thread::Builder::new()
            .name(format!("ws-reader-{peer}"))
            .spawn(move || {
                // Dropped when this thread ends: the writer's linger stops waiting then.
                let _reading = reading;
                match read_frames(&mut reader, &in_tx, peer) {
                    // The local end is gone, and its writer flushes and closes: this end keeps
                    // reading (and discarding) until the socket ends, so no unread bytes make
                    // the close a reset that could lose the last frames on their way.
                    Ended::Dropped => drain(&mut reader),
                    Ended::Peer(end) => {
                        // Stops the writer too, and tells the peer that nothing more will be
                        // read; first, since the send below waits for room in the queue.
                        let _ = reader.get_ref().stream.shutdown(Shutdown::Both);
                        // Ignored: the local end may be gone meanwhile.
                        let _ = in_tx.send(Err(end));
                    }
                }
            })
            .map_err(io_error(format!("starting the reader for {peer}")))?;

        let (queue, frames) = mpsc::channel();
        let failure = Failure::default();
        let why = failure.clone();
        let backlog = Arc::new(Backlog::default());
        let written = backlog.clone();
        let socket = Arc::new(
            writer
                .get_ref()
                .try_clone()
                .map_err(io_error(format!("cloning the socket of {peer}")))?,
        );
        thread::Builder::new()
            .name(format!("ws-writer-{peer}"))
            .spawn(move || {
                let wrote = write_frames(&mut writer, &frames, &written);
                written.written(0, true);
                match wrote {
                    // Everything sent and the Close with it: the peer may still be sending, so
                    // the socket stays open for reading until the peer closes too (the reader
                    // then ends) or LINGER passes.
                    Ok(()) => {
                        let _ = writer.get_ref().shutdown(Shutdown::Write);
                        let _ = reader_done.recv_timeout(LINGER);
                    }
                    Err(e) => {
                        let err = link_error(e, peer);
                        *why.lock().unwrap_or_else(PoisonError::into_inner) = Some(err.to_string());
                    }
                }
                // Wakes the reader if it is still blocked in `read`.
                let _ = writer.get_ref().shutdown(Shutdown::Both);
            })
            .map_err(io_error(format!("starting the writer for {peer}")))?;

        Ok(WsLink {
            out: WsSender {
                queue,
                max_frame,
                failure,
                backlog,
                bound: None,
                socket,
            },
            incoming,
            peer,
            origin: PageOrigin::NotAPage,
            heard,
        })
    }

    /// The web page that opened this link, if one did (the listening side's view).
    pub fn origin(&self) -> &PageOrigin {
        &self.origin
    }

    /// [`Self::bound_sends`] as a helper's link bounds them: [`HELPER_SEND_QUEUE`] bytes,
    /// [`HELPER_SEND_STALL`].
    pub fn as_helper(self) -> Self {
        self.bound_sends(HELPER_SEND_QUEUE, HELPER_SEND_STALL)
    }

    /// Bounds what waits to be written to `limit` bytes (a frame into an empty queue always
    /// goes): past it, `send` waits for the peer to read, and fails, closing the link, once
    /// the peer has read nothing for `stall`. For a helper, whose replies are what its peer
    /// asks for; a host leaves its own queue unbounded (see the module's doc). Applies to
    /// handles taken after it.
    pub fn bound_sends(mut self, limit: usize, stall: Duration) -> Self {
        self.out.bound = Some((limit, stall));
        self
    }

    pub fn peer_addr(&self) -> SocketAddr {
        self.peer
    }

    fn ended(&self) -> LinkError {
        LinkError::Closed(format!("link to {} ended", self.peer))
    }
}

/// What ended the reading of frames.
enum Ended {
    /// This end's owner dropped the link.
    Dropped,
    /// The peer closed, broke the protocol, or the socket failed.
    Peer(LinkError),
}

/// Forwards binary messages until something ends the link, and returns what did.
fn read_frames(
    ws: &mut WebSocket<Watched>,
    frames: &SyncSender<Result<Vec<u8>, LinkError>>,
    peer: SocketAddr,
) -> Ended {
    let err = loop {
        match ws.read() {
            Ok(Message::Binary(bytes)) => {
                // Waits while the queue is full: the peer then waits on TCP.
                if frames.send(Ok(Vec::from(bytes))).is_err() {
                    return Ended::Dropped;
                }
            }
            // Unsolicited pongs are allowed and need no answer.
            Ok(Message::Pong(_)) => {}
            Ok(Message::Close(_)) => break LinkError::Closed(format!("{peer} closed the link")),
            Ok(Message::Ping(_)) => {
                break LinkError::Io(format!(
                "{peer} sent a WebSocket ping; this link answers only the protocol's Ping frames"
            ))
            }
            Ok(other) => {
                break LinkError::Io(format!(
                    "{peer} sent a non-binary message ({} bytes); link frames are binary",
                    other.len()
                ))
            }
            Err(e) => break link_error(e, peer),
        }
    };
    Ended::Peer(err)
}

/// Reads and discards until the socket ends, stopping (as [`read_frames`] does) at anything
/// tungstenite would answer from `read`, since only the writer thread writes.
fn drain(ws: &mut WebSocket<Watched>) {
    while let Ok(Message::Binary(_) | Message::Pong(_)) = ws.read() {}
}

/// Writes frames until every sending handle is dropped, then closes the WebSocket.
fn write_frames(
    ws: &mut WebSocket<TcpStream>,
    frames: &Receiver<Vec<u8>>,
    backlog: &Backlog,
) -> tungstenite::Result<()> {
    while let Ok(frame) = frames.recv() {
        write_frame(ws, frame, backlog)?;
        // Frames queued meanwhile share one flush, so small ones share TCP segments.
        for frame in frames.try_iter() {
            write_frame(ws, frame, backlog)?;
        }
        ws.flush()?;
    }
    ws.close(None)
}

/// Writes one frame, counted as written as it goes (tungstenite writes to the socket past its
/// buffer), so a bounded sender sees a peer that reads steadily through a long batch as
/// progress.
fn write_frame(
    ws: &mut WebSocket<TcpStream>,
    frame: Vec<u8>,
    backlog: &Backlog,
) -> tungstenite::Result<()> {
    let bytes = frame.len();
    ws.write(Message::Binary(frame.into()))?;
    backlog.written(bytes, false);
    Ok(())
}

impl Link for WsLink {
    fn send(&mut self, frame: Vec<u8>) -> Result<(), LinkError> {
        self.out.send(frame)
    }

    fn recv(&mut self) -> Result<Vec<u8>, LinkError> {
        self.incoming.recv().unwrap_or_else(|_| Err(self.ended()))
    }

    fn recv_timeout(&mut self, timeout: Duration) -> Result<Option<Vec<u8>>, LinkError> {
        match self.incoming.recv_timeout(timeout) {
            Ok(frame) => frame.map(Some),
            Err(RecvTimeoutError::Timeout) => Ok(None),
            Err(RecvTimeoutError::Disconnected) => Err(self.ended()),
        }
    }

    fn sender(&self) -> Box<dyn LinkSender> {
        Box::new(self.out.clone())
    }

    fn heard(&self) -> Option<Instant> {
        Some(self.heard.at())
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    const WAIT: Duration = Duration::from_secs(5);

    /// A server end and a client end over loopback.
    fn connected(server_max: usize, client_max: usize) -> (WsLink, WsLink) {
        let listener = WsListener::bind("127.0.0.1:0", server_max).unwrap();
        let url = format!("ws://{}/", listener.local_addr());
        thread::scope(|s| {
            let server = s.spawn(|| listener.accept().unwrap());
            let client = connect(&url, client_max).unwrap();
            (server.join().unwrap(), client)
        })
    }

    /// A server end and a bare tungstenite client, to send what a `WsLink` never would.
    fn raw_client(server_max: usize) -> (WsLink, WebSocket<TcpStream>) {
        let listener = WsListener::bind("127.0.0.1:0", server_max).unwrap();
        let addr = listener.local_addr();
        thread::scope(|s| {
            let server = s.spawn(|| listener.accept().unwrap());
            let stream = TcpStream::connect(addr).unwrap();
            let (client, _) = tungstenite::client(format!("ws://{addr}/"), stream).unwrap();
            (server.join().unwrap(), client)
        })
    }

    fn numbered(i: usize) -> Vec<u8> {
        let mut f = vec![i as u8; 16 + (i * 10_007) % 200_000];
        f[..4].copy_from_slice(&(i as u32).to_le_bytes());
        f
    }

    fn exchange(link: &mut WsLink, n: usize) {
        let mut side = link.sender();
        let sending = thread::spawn(move || {
            for i in 0..n {
                side.send(numbered(i)).unwrap();
            }
        });
        for i in 0..n {
            assert_eq!(
                link.recv_timeout(WAIT).unwrap().unwrap(),
                numbered(i),
                "frame {i}"
            );
        }
        sending.join().unwrap();
    }

    #[test]
    fn frames_cross_both_ways_at_once() {
        let (mut server, mut client) = connected(1 << 20, 1 << 20);
        let far = thread::spawn(move || {
            exchange(&mut client, 40);
            client
        });
        exchange(&mut server, 40);
        let mut client = far.join().unwrap();
        assert!(matches!(
            client.send(vec![0; (1 << 20) + 1]),
            Err(LinkError::TooLarge { len, limit: 1_048_576 }) if len == (1 << 20) + 1
        ));
        client.send(vec![1, 2, 3]).unwrap();
        assert_eq!(server.recv().unwrap(), vec![1, 2, 3]);
    }

    #[test]
    fn an_oversized_incoming_frame_is_refused_before_allocation() {
        let (mut server, mut client) = raw_client(1024);
        // A final binary frame, masked, announcing 2^40 bytes: were it allocated first, the
        // test would abort instead of failing cleanly.
        let mut header = vec![0x82, 0x80 | 127];
        header.extend_from_slice(&(1u64 << 40).to_be_bytes());
        header.extend_from_slice(&[1, 2, 3, 4]);
        client.get_mut().write_all(&header).unwrap();
        assert!(matches!(
            server.recv_timeout(WAIT),
            Err(LinkError::TooLarge { len, limit: 1024 }) if len == 1 << 40
        ));

        // A message just over the limit from a well-behaved peer with a larger limit.
        let (mut server, mut client) = connected(1024, 1 << 20);
        client.send(vec![0; 1025]).unwrap();
        assert!(matches!(
            server.recv_timeout(WAIT),
            Err(LinkError::TooLarge { .. })
        ));
        // The refusing side shut the connection, so the sender learns too.
        assert!(matches!(
            client.recv_timeout(WAIT),
            Err(LinkError::Closed(_))
        ));
    }

    /// A peer that sends faster than this end takes frames is held by TCP once the incoming
    /// queue is full: its writes stall until this end reads, and then every frame arrives, in
    /// order.
    #[test]
    fn a_fast_peer_waits_for_a_slow_reader() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        const FRAME: usize = 256 << 10;
        // 50 MiB: far more than the queue and the sockets' buffers hold.
        const TOTAL: usize = 200;
        let (mut server, mut client) = raw_client(FRAME);
        let written = Arc::new(AtomicUsize::new(0));
        let count = written.clone();
        let writer = thread::spawn(move || {
            for i in 0..TOTAL {
                client
                    .send(Message::Binary(vec![i as u8; FRAME].into()))
                    .unwrap();
                count.store(i + 1, Ordering::SeqCst);
            }
            client
        });
        let mut seen = usize::MAX;
        for _ in 0..20 {
            thread::sleep(Duration::from_millis(500));
            let now = written.load(Ordering::SeqCst);
            if now == seen {
                break;
            }
            seen = now;
        }
        assert!(
            seen < TOTAL,
            "the peer wrote all {TOTAL} frames into a link nobody read"
        );
        for i in 0..TOTAL {
            let frame = server.recv_timeout(WAIT).unwrap().expect("a frame");
            assert!(frame.len() == FRAME && frame[0] == i as u8, "frame {i}");
        }
        writer.join().unwrap();
    }

    #[test]
    fn web_pages_are_turned_away_unless_browsers_are_allowed() {
        use tungstenite::client::IntoClientRequest;
        for allowed in [false, true] {
            let listener = WsListener::bind("127.0.0.1:0", 1024)
                .unwrap()
                .allow_browsers(allowed);
            let addr = listener.local_addr();
            thread::scope(|s| {
                let server = s.spawn(|| listener.accept());
                let mut req = format!("ws://{addr}/").into_client_request().unwrap();
                req.headers_mut()
                    .insert("origin", "http://any-page.example".parse().unwrap());
                let client = tungstenite::client(req, TcpStream::connect(addr).unwrap());
                let server = server.join().unwrap();
                assert_eq!(client.is_ok(), allowed);
                assert_eq!(server.is_ok(), allowed);
                if let Err(HandshakeError::Failure(tungstenite::Error::Http(resp))) = client {
                    assert_eq!(resp.status(), 403);
                } else {
                    assert!(allowed, "refused, but not with an HTTP status");
                }
            });
        }
    }

    /// A listener that upgrades every connection it admits on a thread of its own, as a helper
    /// does, counting the upgrades that finished.
    fn upgrading(listener: WsListener) -> (SocketAddr, Arc<std::sync::atomic::AtomicUsize>) {
        let addr = listener.local_addr();
        let done = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let count = done.clone();
        thread::spawn(move || {
            while let Ok(pending) = listener.next() {
                let count = count.clone();
                thread::spawn(move || {
                    if let Ok(link) = pending.upgrade() {
                        count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        // Held until the peer goes.
                        let mut link = link;
                        while link.recv().is_ok() {}
                    }
                });
            }
        });
        (addr, done)
    }

    #[test]
    fn idle_sockets_do_not_lock_out_a_real_peer() {
        let listener = WsListener::bind("127.0.0.1:0", 1024).unwrap();
        let admission = listener.admission().clone();
        let (addr, upgraded) = upgrading(listener);
        // Twice the listener's total, from the real peer's own address, each saying nothing.
        let idle: Vec<TcpStream> = (0..2 * LISTENER_LIMITS.total)
            .map(|_| TcpStream::connect(addr).unwrap())
            .collect();
        let t0 = std::time::Instant::now();
        while admission.evicted() < (idle.len() - LISTENER_LIMITS.per_source) as u64 {
            assert!(t0.elapsed() < WAIT, "evicted {}", admission.evicted());
            thread::sleep(Duration::from_millis(10));
        }
        let t0 = std::time::Instant::now();
        let mut link = connect(&format!("ws://{addr}/"), 1024).expect("let in to try");
        assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());
        // The server's side counts once its thread is past the upgrade.
        while upgraded.load(std::sync::atomic::Ordering::SeqCst) == 0 {
            assert!(t0.elapsed() < WAIT);
            thread::sleep(Duration::from_millis(10));
        }
        assert!(admission.len() <= LISTENER_LIMITS.per_source);
        link.send(vec![1]).unwrap();
        drop(idle);
    }

    #[test]
    fn a_trickled_upgrade_is_closed_at_the_deadline() {
        let limits = Limits {
            deadline: Some(Duration::from_secs(1)),
            ..LISTENER_LIMITS
        };
        let listener = WsListener::bind("127.0.0.1:0", 1024)
            .unwrap()
            .admitting(Admission::new(limits));
        let addr = listener.local_addr();
        let server = thread::spawn(move || listener.next().unwrap().upgrade());
        let mut peer = TcpStream::connect(addr).unwrap();
        let t0 = std::time::Instant::now();
        // A byte every 200 ms: each read is quick, the whole never ends.
        for b in b"GET / HTTP/1.1\r\nHost: x\r\n".iter().cycle() {
            if peer.write_all(&[*b]).is_err() || server.is_finished() {
                break;
            }
            thread::sleep(Duration::from_millis(200));
            assert!(t0.elapsed() < WAIT, "still open after {:?}", t0.elapsed());
        }
        assert!(server.join().unwrap().is_err());
        assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
    }

    /// A helper's replies to a peer that never reads stop at the bound, and the link goes once
    /// the peer has read nothing for the stall time.
    #[test]
    fn a_peer_that_does_not_read_loses_a_bounded_link() {
        let (server, client) = raw_client(1 << 20);
        let mut server = server.bound_sends(4 << 20, Duration::from_secs(1));
        let t0 = std::time::Instant::now();
        let mut sent = 0usize;
        let err = loop {
            match server.send(vec![0; 256 << 10]) {
                Ok(()) => sent += 256 << 10,
                Err(e) => break e,
            }
            assert!(
                sent < 256 << 20,
                "256 MiB queued for a peer that reads nothing"
            );
        };
        assert!(err.to_string().contains("read nothing"), "{err}");
        assert!(t0.elapsed() < WAIT, "{:?}", t0.elapsed());
        assert!(server.send(vec![1]).is_err(), "it stays closed");
        drop(client);
    }

    /// A frame still arriving counts as hearing the peer: a slow link's large frame is not
    /// silence.
    #[test]
    fn bytes_of_a_frame_still_arriving_are_heard() {
        let (mut server, mut client) = raw_client(1 << 20);
        // A final binary frame of 1000 bytes, masked, sent a tenth at a time.
        let mut frame = vec![0x82, 0x80 | 126, 0x03, 0xe8, 1, 2, 3, 4];
        frame.extend(std::iter::repeat_n(0u8, 1000));
        let before = server.heard().unwrap();
        let mut seen = Vec::new();
        for part in frame.chunks(101) {
            client.get_mut().write_all(part).unwrap();
            thread::sleep(Duration::from_millis(100));
            seen.push(server.heard().unwrap());
            if seen.len() < 10 {
                assert_eq!(server.recv_timeout(Duration::ZERO).unwrap(), None);
            }
        }
        assert!(seen.windows(2).all(|w| w[1] > w[0]), "{before:?} {seen:?}");
        assert_eq!(server.recv_timeout(WAIT).unwrap().unwrap().len(), 1000);
    }

    #[test]
    fn a_text_message_is_a_protocol_error() {
        let (mut server, mut client) = raw_client(1024);
        client.send(Message::text("hello")).unwrap();
        assert!(matches!(server.recv_timeout(WAIT), Err(LinkError::Io(_))));
    }

    /// A refusal sent just before the drop reaches a peer that is sending meanwhile: its
    /// bytes arriving at the dropped end must not reset the connection under the refusal.
    #[test]
    fn the_last_frame_before_a_drop_reaches_a_peer_that_keeps_sending() {
        for _ in 0..20 {
            let (mut server, mut client) = connected(1 << 20, 1 << 20);
            server.send(b"busy".to_vec()).unwrap();
            drop(server);
            for _ in 0..8 {
                let _ = client.send(vec![7; 64 << 10]);
            }
            assert_eq!(client.recv_timeout(WAIT).unwrap().unwrap(), b"busy");
            assert!(matches!(client.recv(), Err(LinkError::Closed(_))));
        }
    }

    #[test]
    fn dropping_or_losing_the_peer_closes_the_link() {
        let (mut server, client) = connected(1024, 1024);
        let mut side = client.sender();
        side.send(vec![9]).unwrap();
        drop(client);
        side.send(vec![10]).unwrap();
        drop(side);
        assert_eq!(server.recv_timeout(WAIT).unwrap(), Some(vec![9]));
        assert_eq!(server.recv_timeout(WAIT).unwrap(), Some(vec![10]));
        assert!(matches!(
            server.recv_timeout(WAIT),
            Err(LinkError::Closed(_))
        ));
        assert!(matches!(
            server.recv_timeout(WAIT),
            Err(LinkError::Closed(_))
        ));

        // A peer that vanishes without a Close (a killed process) reads as closed too.
        let (mut server, client) = raw_client(1024);
        drop(client);
        assert!(matches!(
            server.recv_timeout(WAIT),
            Err(LinkError::Closed(_))
        ));
    }
}
