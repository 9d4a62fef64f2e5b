//! The live view of the split at `/` (wasm-demo/www's index.html, split.js and split.css, built
//! into the binary so `tether serve` needs no files beside it): a chat box on the OpenAI
//! endpoint and the split drawn from `/v1/telemetry`. The same files work as static files
//! (the page then names its server with `?server=http://HOST:PORT`, which needs `--cors`).

use axum::http::{header, StatusCode, Uri};
use axum::response::{IntoResponse, Response};

/// Each file by the path it is served at, with its type.
const FILES: &[(&str, &str, &[u8])] = &[
    (
        "/",
        "text/html; charset=utf-8",
        include_bytes!("../../../wasm-demo/www/index.html"),
    ),
    (
        "/split.js",
        "text/javascript; charset=utf-8",
        include_bytes!("../../../wasm-demo/www/split.js"),
    ),
    (
        "/split.css",
        "text/css; charset=utf-8",
        include_bytes!("../../../wasm-demo/www/split.css"),
    ),
];

/// The paths this module serves.
pub const PATHS: [&str; 3] = [FILES[0].0, FILES[1].0, FILES[2].0];

pub async fn file(uri: Uri) -> Response {
    match FILES.iter().find(|(path, ..)| *path == uri.path()) {
        Some((_, kind, body)) => (
            [
                (header::CONTENT_TYPE, *kind),
                (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
                (header::CACHE_CONTROL, "no-cache"),
            ],
            *body,
        )
            .into_response(),
        None => StatusCode::NOT_FOUND.into_response(),
    }
}
