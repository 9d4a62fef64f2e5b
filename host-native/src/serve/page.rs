//! The split page at `/` (wasm-demo/www's index.html, split.js, sim.js, sim-worker.js and
//! split.css, built into the binary so `tether serve` needs no files beside it): a chat box on
//! the OpenAI endpoint and the split drawn from `/v1/telemetry`, or with `?sim` the simulator,
//! which runs engine-core in a worker of the page from the WebAssembly module checked in at
//! wasm-demo/www/pkg (built in as the helper page is: crate::lend::PAGE). The same files work
//! as static files (the live view then names its server with `?server=http://HOST:PORT`, which
//! needs `--cors`; the simulator needs no server).

use axum::http::{header, StatusCode, Uri};
use axum::response::{IntoResponse, Response};

const HTML: &str = "text/html; charset=utf-8";
const JS: &str = "text/javascript; charset=utf-8";
const CSS: &str = "text/css; charset=utf-8";

/// Each file by the path it is served at, with its type.
const FILES: &[(&str, &str, &[u8])] = &[
    (
        "/",
        HTML,
        include_bytes!("../../../wasm-demo/www/index.html"),
    ),
    (
        "/split.js",
        JS,
        include_bytes!("../../../wasm-demo/www/split.js"),
    ),
    (
        "/sim.js",
        JS,
        include_bytes!("../../../wasm-demo/www/sim.js"),
    ),
    (
        "/sim-worker.js",
        JS,
        include_bytes!("../../../wasm-demo/www/sim-worker.js"),
    ),
    (
        "/split.css",
        CSS,
        include_bytes!("../../../wasm-demo/www/split.css"),
    ),
];

/// The simulator's module, by the path it is served at (its name under wasm-demo/www after
/// the `/`), with its type.
const MODULE: &[(&str, &str)] = &[
    ("/pkg/wasm_demo.js", JS),
    ("/pkg/wasm_demo_bg.wasm", "application/wasm"),
];

/// The paths this module serves.
pub fn paths() -> impl Iterator<Item = &'static str> {
    FILES.iter().map(|f| f.0).chain(MODULE.iter().map(|m| m.0))
}

pub async fn file(uri: Uri) -> Response {
    let path = uri.path();
    if let Some((_, kind, body)) = FILES.iter().find(|(p, ..)| *p == path) {
        return answer(kind, body);
    }
    let Some((_, kind)) = MODULE.iter().find(|(p, _)| *p == path) else {
        return StatusCode::NOT_FOUND.into_response();
    };
    let built = crate::lend::PAGE.and_then(|files| files.iter().find(|(n, _)| *n == &path[1..]));
    match built {
        Some((_, body)) => answer(kind, body),
        None => (
            StatusCode::NOT_FOUND,
            "this tether was built without the page's WebAssembly module, which the simulator \
             runs: its source tree lacked wasm-demo/www/pkg, which is checked in; restore it \
             (or rebuild it with scripts/build-wasm.sh), then build tether again",
        )
            .into_response(),
    }
}

fn answer(kind: &'static str, body: &'static [u8]) -> Response {
    (
        [
            (header::CONTENT_TYPE, kind),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}
