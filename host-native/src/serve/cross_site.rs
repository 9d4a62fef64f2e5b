//! What keeps a web page in the user's browser from using the server. A page may send another
//! origin a form or `text/plain` POST without asking (a CORS "simple" request), so POST bodies
//! must be declared `application/json`, which a browser sends cross-origin only after a
//! preflight; and CORS is off unless `--cors` names the origins that may call, so no preflight
//! is granted by default.

use std::sync::Arc;

use anyhow::{bail, Result};
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::api::ApiError;
use super::connections;

/// 415 for a POST whose body is not declared JSON (`application/json`, parameters such as
/// `charset` allowed): its body is read only to be dropped (see
/// [`connections::refuse_after_body`]), so nothing else can start a generation.
pub async fn require_json(limit: usize, req: Request, next: Next) -> Response {
    if req.method() == Method::POST && !is_json(req.headers()) {
        let refusal = ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "invalid_request_error",
            "the body must be JSON, sent with `Content-Type: application/json`",
        )
        .with_code("unsupported_media_type")
        .into_response();
        return connections::refuse_after_body(req.into_body(), limit, refusal).await;
    }
    next.run(req).await
}

fn is_json(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|t| t.trim().eq_ignore_ascii_case("application/json"))
}

/// The origins `--cors` allows: none by default, `*` for any.
pub struct Cors {
    origins: Vec<HeaderValue>,
    any: bool,
}

impl Cors {
    pub fn new(origins: &[String]) -> Result<Cors> {
        let mut cors = Cors {
            origins: Vec::new(),
            any: false,
        };
        for o in origins {
            if o == "*" {
                cors.any = true;
                continue;
            }
            // An Origin header is scheme://host[:port], never with a path.
            let o = o.trim_end_matches('/');
            if !o.contains("://") || o.split("://").nth(1).is_some_and(|h| h.contains('/')) {
                bail!("--cors {o}: expected an origin like http://localhost:3000, or *");
            }
            match HeaderValue::from_str(o) {
                Ok(v) => cors.origins.push(v),
                Err(_) => bail!("--cors {o}: not a valid origin"),
            }
        }
        Ok(cors)
    }

    /// The `Access-Control-Allow-Origin` value for a request from `origin`, if allowed.
    fn allow(&self, origin: &HeaderValue) -> Option<HeaderValue> {
        if self.any {
            Some(HeaderValue::from_static("*"))
        } else {
            self.origins.contains(origin).then(|| origin.clone())
        }
    }
}

/// Grant allowed origins what CORS asks: a preflight (`OPTIONS` with
/// `Access-Control-Request-Method`) is answered 204 with the methods and the headers it asked
/// for; every other response to them carries `Access-Control-Allow-Origin`. Requests from
/// other origins pass untouched: without those headers a browser keeps the page from sending a
/// JSON POST or reading any answer.
pub async fn cors(State(cors): State<Arc<Cors>>, req: Request, next: Next) -> Response {
    let Some(allow) = req
        .headers()
        .get(header::ORIGIN)
        .and_then(|o| cors.allow(o))
    else {
        return next.run(req).await;
    };
    let preflight = req.method() == Method::OPTIONS
        && req
            .headers()
            .contains_key(header::ACCESS_CONTROL_REQUEST_METHOD);
    let mut r = if preflight {
        let mut r = StatusCode::NO_CONTENT.into_response();
        let h = r.headers_mut();
        h.insert(
            header::ACCESS_CONTROL_ALLOW_METHODS,
            HeaderValue::from_static("GET, POST"),
        );
        if let Some(asked) = req.headers().get(header::ACCESS_CONTROL_REQUEST_HEADERS) {
            h.insert(header::ACCESS_CONTROL_ALLOW_HEADERS, asked.clone());
        }
        h.insert(header::ACCESS_CONTROL_MAX_AGE, HeaderValue::from(600));
        r
    } else {
        next.run(req).await
    };
    let h = r.headers_mut();
    if !cors.any {
        h.append(header::VARY, HeaderValue::from_static("origin"));
    }
    h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, allow);
    h.insert(
        header::ACCESS_CONTROL_EXPOSE_HEADERS,
        HeaderValue::from_static("retry-after"),
    );
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_content_types() {
        let with = |ct: &str| {
            let mut h = HeaderMap::new();
            h.insert(header::CONTENT_TYPE, HeaderValue::from_str(ct).unwrap());
            is_json(&h)
        };
        assert!(with("application/json"));
        assert!(with("Application/JSON; charset=utf-8"));
        assert!(!with("text/plain"));
        assert!(!with("application/x-www-form-urlencoded"));
        assert!(!with("application/jsonx"));
        assert!(!is_json(&HeaderMap::new()));
    }

    #[test]
    fn origins() {
        let cors = Cors::new(&["http://localhost:3000/".into()]).unwrap();
        let o = |s: &'static str| HeaderValue::from_static(s);
        assert_eq!(
            cors.allow(&o("http://localhost:3000")),
            Some(o("http://localhost:3000"))
        );
        assert_eq!(cors.allow(&o("http://evil.example")), None);
        assert_eq!(Cors::new(&[]).unwrap().allow(&o("http://a.b")), None);
        assert_eq!(
            Cors::new(&["*".into()]).unwrap().allow(&o("http://a.b")),
            Some(o("*"))
        );
        assert!(Cors::new(&["localhost".into()]).is_err());
        assert!(Cors::new(&["http://a.b/path".into()]).is_err());
    }
}
