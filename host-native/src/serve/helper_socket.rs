//! `GET /helper` upgraded to a WebSocket: a helper (a `tether-helper --join`, a browser tab)
//! dialing `tether serve` on its own port. The socket lives on the server's async runtime; the
//! helper runtime's link is blocking (`Link`), used from the engine thread and the handshake
//! thread. [`SocketLink`] bridges the two with bounded channels: two tasks move frames between
//! the socket and the channels, and the blocking side waits on the runtime's handle.

use std::time::Duration;

use axum::extract::ws::{Message as WsMessage, WebSocket};
use engine_core::link::{Link, LinkError, LinkSender};
use futures_util::{SinkExt, StreamExt};
use tokio::runtime::Handle;
use tokio::sync::mpsc;
use tokio::task::AbortHandle;

/// Frames read from the socket and not yet taken, at most: the socket's reader waits beyond
/// that, so a peer cannot fill the server's memory faster than the engine reads.
const INCOMING: usize = 4;

/// Frames queued for the socket, at most: a sender waits beyond that, for [`SEND_TIMEOUT`].
const OUTGOING: usize = 16;

/// How long a frame may wait for room in the queue: a helper that stops reading (a suspended
/// phone with a full TCP window) counts as gone instead of holding the engine.
const SEND_TIMEOUT: Duration = Duration::from_secs(60);

/// The blocking end of a helper's WebSocket.
pub struct SocketLink {
    out: SocketSender,
    incoming: mpsc::Receiver<Result<Vec<u8>, LinkError>>,
    handle: Handle,
    /// The two tasks that move frames, to close the socket from outside ([`Self::closer`]).
    tasks: [AbortHandle; 2],
}

#[derive(Clone)]
struct SocketSender {
    queue: mpsc::Sender<Vec<u8>>,
    max_frame: usize,
    handle: Handle,
}

impl LinkSender for SocketSender {
    fn send(&mut self, frame: Vec<u8>) -> Result<(), LinkError> {
        if frame.len() > self.max_frame {
            return Err(LinkError::TooLarge {
                len: frame.len(),
                limit: self.max_frame,
            });
        }
        let queue = &self.queue;
        // The timer is made inside the runtime (block_on's future), which it needs.
        let sent = self
            .handle
            .block_on(async { tokio::time::timeout(SEND_TIMEOUT, queue.send(frame)).await });
        match sent {
            Ok(Ok(())) => Ok(()),
            Ok(Err(_)) => Err(LinkError::Closed("the helper's WebSocket closed".into())),
            Err(_) => Err(LinkError::Closed(format!(
                "the helper read nothing for {} s",
                SEND_TIMEOUT.as_secs()
            ))),
        }
    }
}

impl SocketLink {
    /// Start moving frames between `socket` and the returned link, on the current runtime.
    /// Frames over `max_frame` bytes are refused both ways (the upgrade set the socket's own
    /// limit to the same).
    pub fn start(socket: WebSocket, max_frame: usize) -> SocketLink {
        let (mut sink, mut stream) = socket.split();
        let (in_tx, incoming) = mpsc::channel(INCOMING);
        let (queue, mut out_rx) = mpsc::channel::<Vec<u8>>(OUTGOING);
        let writer = tokio::spawn(async move {
            while let Some(frame) = out_rx.recv().await {
                if sink.send(WsMessage::Binary(frame.into())).await.is_err() {
                    return;
                }
            }
            let _ = sink.close().await;
        });
        let reader = tokio::spawn(async move {
            loop {
                // Ends with the link too (its receiver dropped), so a silent peer's socket
                // does not outlive the session.
                let next = tokio::select! {
                    next = stream.next() => next,
                    () = in_tx.closed() => return,
                };
                let item = match next {
                    Some(Ok(WsMessage::Binary(b))) => Ok(b.to_vec()),
                    Some(Ok(WsMessage::Ping(_) | WsMessage::Pong(_))) => continue,
                    Some(Ok(WsMessage::Text(_))) => {
                        Err(LinkError::Io("a text message on a binary link".into()))
                    }
                    Some(Ok(WsMessage::Close(_))) | None => {
                        Err(LinkError::Closed("the helper closed its WebSocket".into()))
                    }
                    Some(Err(e)) => Err(LinkError::Closed(format!("the helper's WebSocket: {e}"))),
                };
                let last = item.is_err();
                if in_tx.send(item).await.is_err() || last {
                    return;
                }
            }
        });
        let handle = Handle::current();
        SocketLink {
            out: SocketSender {
                queue,
                max_frame,
                handle: handle.clone(),
            },
            incoming,
            handle,
            tasks: [writer.abort_handle(), reader.abort_handle()],
        }
    }

    /// Closes the socket when called, from any thread: both tasks stop (the socket drops
    /// with them), and the link's `recv` then reports it closed.
    pub fn closer(&self) -> impl FnOnce() + Send + 'static {
        let tasks = self.tasks.clone();
        move || tasks.iter().for_each(AbortHandle::abort)
    }
}

impl Link for SocketLink {
    fn send(&mut self, frame: Vec<u8>) -> Result<(), LinkError> {
        self.out.send(frame)
    }

    fn recv(&mut self) -> Result<Vec<u8>, LinkError> {
        let (handle, incoming) = (&self.handle, &mut self.incoming);
        handle
            .block_on(incoming.recv())
            .unwrap_or_else(|| Err(LinkError::Closed("the helper's WebSocket closed".into())))
    }

    fn recv_timeout(&mut self, timeout: Duration) -> Result<Option<Vec<u8>>, LinkError> {
        let (handle, incoming) = (&self.handle, &mut self.incoming);
        // The timer is made inside the runtime (block_on's future), which it needs.
        let next = async { tokio::time::timeout(timeout, incoming.recv()).await };
        match handle.block_on(next) {
            Err(_) => Ok(None),
            Ok(Some(item)) => item.map(Some),
            Ok(None) => Err(LinkError::Closed("the helper's WebSocket closed".into())),
        }
    }

    fn sender(&self) -> Box<dyn LinkSender> {
        Box::new(self.out.clone())
    }
}
