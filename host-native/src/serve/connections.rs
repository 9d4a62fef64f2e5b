//! Connections of `tether serve`: accepted, served and closed so that none can hold the server
//! forever. axum's own `serve` sets no deadline, so a client that sent half a request head, or
//! nothing at all, or half a body, kept its connection (and its task) open indefinitely; many
//! such clients would run the server out of connections.
//!
//! - The request head must arrive within [`HEAD_TIMEOUT`] (hyper's header read timeout, which
//!   also ends a keep-alive connection idle that long between requests).
//! - The body must arrive within [`BODY_TIMEOUT`] (408 otherwise).
//! - At most [`MAX_CONNECTIONS`] are open at once; one more is closed at accept. A connection
//!   upgraded to a helper's WebSocket (/helper) leaves this count: the acceptor bounds those
//!   (handshakes under way, helpers waiting) and the helper session its link.
//!
//! A response being streamed is not cut: generation has its own time limit (`--timeout`).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use axum::body::{to_bytes, Body};
use axum::extract::Request;
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Router;
use http_body_util::{BodyExt, LengthLimitError};
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tower::ServiceExt;
use tracing::{debug, warn};

use super::api::ApiError;

/// Time for a request head (or for the next one on a kept-alive connection).
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(10);

/// Time for a request body: the 64 MiB limit at about 1 MiB/s.
pub const BODY_TIMEOUT: Duration = Duration::from_secs(60);

/// Connections open at once, at most.
pub const MAX_CONNECTIONS: usize = 1024;

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
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                // Out of file descriptors, a connection reset before accept: go on.
                Err(e) => {
                    warn!("accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            debug!("{MAX_CONNECTIONS} connections open: closing a new one");
            continue;
        };
        let router = router.clone();
        let service = hyper::service::service_fn(move |req: Request<Incoming>| {
            let router = router.clone();
            async move { router.oneshot(req.map(Body::new)).await }
        });
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
            };
            if let Err(e) = ended {
                debug!("connection ended: {e}");
            }
            drop(slot);
        });
    }
    let _ = stop.send(true);
    // Every connection's slot back: all of them have finished.
    let _ = slots.acquire_many(MAX_CONNECTIONS as u32).await;
    Ok(())
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
