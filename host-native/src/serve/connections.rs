//! Connections of `tether serve`: accepted, served and closed so that none can hold the server
//! forever. axum's own `serve` sets no deadline, so a client that sent half a request head, or
//! nothing at all, or half a body, kept its connection (and its task) open indefinitely; many
//! such clients would run the server out of connections.
//!
//! - The request head must arrive within [`HEAD_TIMEOUT`] (hyper's header read timeout, which
//!   also ends a keep-alive connection idle that long between requests).
//! - The body must arrive within [`BODY_TIMEOUT`] (408 otherwise).
//! - At most [`LIMITS`] are open at once, from one address and in all. A new connection past
//!   them closes the oldest idle one (waiting for a request head, or kept alive between
//!   requests) of the address that holds the most, so idle or half-open sockets cannot lock
//!   real clients out; only when every one is busy with a request is the new one closed. A
//!   connection upgraded to a helper's WebSocket (/helper) leaves this count: the acceptor
//!   bounds those (handshakes under way, helpers waiting) and the helper session its link.
//!
//! A response being streamed is not cut: generation has its own time limit (`--timeout`).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use axum::body::{to_bytes, Body};
use axum::extract::{ConnectInfo, Request};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Router;
use engine_core::link::admission::{Admission, Limits, Ticket};
use http_body_util::{BodyExt, LengthLimitError};
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use std::net::SocketAddr;
use tokio::net::TcpListener;
use tower::ServiceExt;
use tracing::{debug, warn};

use super::api::ApiError;

/// Time for a request head (or for the next one on a kept-alive connection).
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(10);

/// Time for a request body: the 64 MiB limit at about 1 MiB/s.
pub const BODY_TIMEOUT: Duration = Duration::from_secs(60);

/// Connections open at once, at most, from one address and in all (the process raises its
/// file limit to hold them, see `raise_file_limit`).
pub const LIMITS: Limits = Limits {
    per_source: 256,
    total: 1024,
    deadline: None,
};

/// Raises the soft limit on open files to the hard one (many systems start processes at
/// 1024, which [`LIMITS`] and the model's files would exhaust: `accept` then fails for
/// everyone instead of the oldest idle connection being closed). Best effort.
pub fn raise_file_limit() {
    #[cfg(unix)]
    // SAFETY: getrlimit and setrlimit only read and write the struct passed.
    unsafe {
        let mut lim: libc::rlimit = std::mem::zeroed();
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            let _ = libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}

/// Serve `router` on `listener` until `shutdown` completes, then let the requests in flight
/// finish.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    shutdown: impl Future<Output = ()>,
) -> Result<()> {
    // Set once to stop: every connection then finishes the request it serves and closes.
    // (hyper-util's GracefulShutdown takes no connection that can upgrade, as /helper's does.)
    let (stop, stopping) = tokio::sync::watch::channel(false);
    let admission = Admission::new(LIMITS);
    // Every connection's task holds a clone: the receiver ends once all have finished.
    let (open, mut all_closed) = tokio::sync::mpsc::channel::<()>(1);
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                // Out of file descriptors, a connection reset before accept: go on.
                Err(e) => {
                    warn!("accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let (evict, evicted) = tokio::sync::oneshot::channel::<()>();
        let Some(ticket) = admission.admit(peer.ip(), move || {
            let _ = evict.send(());
        }) else {
            debug!("every connection is busy: closing a new one from {peer}");
            continue;
        };
        let service = connection_service(router.clone(), peer, ticket);
        let open = open.clone();
        let mut http = hyper::server::conn::http1::Builder::new();
        http.timer(TokioTimer::new())
            .header_read_timeout(HEAD_TIMEOUT);
        let mut stopping = stopping.clone();
        tokio::spawn(async move {
            // Upgrades: a helper's WebSocket at /helper.
            let conn = http
                .serve_connection(TokioIo::new(stream), service)
                .with_upgrades();
            let mut conn = std::pin::pin!(conn);
            let ended = tokio::select! {
                ended = conn.as_mut() => ended,
                _ = stopping.changed() => {
                    conn.as_mut().graceful_shutdown();
                    conn.await
                }
                // Pushed out for a newer connection while idle: dropped, so closed.
                _ = evicted => Ok(()),
            };
            if let Err(e) = ended {
                debug!("connection ended: {e}");
            }
            drop(open);
        });
    }
    let _ = stop.send(true);
    drop(open);
    let _ = all_closed.recv().await;
    Ok(())
}

/// The service of one connection from `peer`: the router, with the peer's address for the
/// handlers that need it (`ConnectInfo`), and the connection marked busy in its admission
/// `ticket` from a request's head until its response (a stream, maybe) has been sent.
fn connection_service(
    router: Router,
    peer: SocketAddr,
    ticket: Ticket,
) -> impl hyper::service::Service<
    Request<Incoming>,
    Response = Response,
    Error = std::convert::Infallible,
    Future = impl Future<Output = Result<Response, std::convert::Infallible>> + Send,
> + Clone {
    let ticket = Arc::new(ticket);
    hyper::service::service_fn(move |mut req: Request<Incoming>| {
        let router = router.clone();
        req.extensions_mut().insert(ConnectInfo(peer));
        let busy = ticket.busy();
        async move {
            let response = router.oneshot(req.map(Body::new)).await?;
            // The guard lives as long as the body does.
            Ok(response.map(|body| {
                Body::new(body.map_frame(move |frame| {
                    std::hint::black_box(&busy);
                    frame
                }))
            }))
        }
    })
}

/// Answer a request refused before its body was read, reading and dropping that body first
/// (up to `limit` bytes, within [`BODY_TIMEOUT`], nothing kept). A connection closed with
/// unread bytes in its receive buffer is reset by the kernel, and a client still sending its
/// body may then lose the answer with it; read, the connection also stays open for the next
/// request. A body past the limit or the time is left, and the connection closed.
pub async fn refuse_after_body(body: Body, limit: usize, answer: Response) -> Response {
    let mut body = body;
    let mut read = 0usize;
    let drained = tokio::time::timeout(BODY_TIMEOUT, async {
        while let Some(frame) = body.frame().await {
            let Ok(frame) = frame else { return false };
            read += frame.data_ref().map_or(0, |d| d.len());
            if read > limit {
                return false;
            }
        }
        true
    })
    .await
    .unwrap_or(false);
    let mut answer = answer;
    if !drained {
        answer
            .headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    answer
}

/// Read a POST's body within [`BODY_TIMEOUT`] and up to `limit` bytes before the handler sees
/// it: a client that stops sending mid-body gets 408 instead of holding the request open.
pub async fn body_in_time(limit: usize, req: Request, next: Next) -> Response {
    if req.method() != Method::POST {
        return next.run(req).await;
    }
    let (parts, body) = req.into_parts();
    match tokio::time::timeout(BODY_TIMEOUT, to_bytes(body, limit)).await {
        Ok(Ok(bytes)) => {
            next.run(Request::from_parts(parts, Body::from(bytes)))
                .await
        }
        Ok(Err(e)) => {
            let e = e.into_inner();
            let status = if e.is::<LengthLimitError>() {
                StatusCode::PAYLOAD_TOO_LARGE
            } else {
                StatusCode::BAD_REQUEST
            };
            ApiError::new(
                status,
                "invalid_request_error",
                format!("the body could not be read (at most {limit} bytes): {e}"),
            )
            .into_response()
        }
        Err(_) => ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            "invalid_request_error",
            format!(
                "the body did not arrive within {} s",
                BODY_TIMEOUT.as_secs()
            ),
        )
        .with_code("request_timeout")
        .into_response(),
    }
}
