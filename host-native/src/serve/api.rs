//! The OpenAI request bodies as this server reads them, the checks that turn a bad one into a
//! 4xx before anything is queued, and the error body every failure is answered with.
//!
//! Parameters that would change the answer but are not implemented (penalties, logprobs, tools,
//! `n > 1`, ...) are refused rather than silently ignored: a client that sends them expects
//! their effect. Unknown fields are refused too, as OpenAI does, except a short list that never
//! changes an answer.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use engine_core::generate::SamplingParams;
use engine_core::tokenizer::ChatMessage;
use serde::Deserialize;
use serde_json::{json, Map, Value};

/// An OpenAI-style error: `{"error": {"message", "type", "param", "code"}}` with its status.
#[derive(Clone, Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Seconds for a `Retry-After` header (503 only).
    pub retry_after: Option<u64>,
}

impl ApiError {
    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
            retry_after: None,
        }
    }

    /// 400: the request itself is wrong.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    /// 400 naming the offending parameter.
    pub fn param(param: &str, message: impl Into<String>) -> Self {
        Self::invalid(message).with_param(param)
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "invalid_request_error", message)
    }

    pub fn server(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    /// 503 with `Retry-After`: the queue is full or the engine is gone.
    pub fn unavailable(message: impl Into<String>, retry_after: u64) -> Self {
        let mut e = Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message);
        e.retry_after = Some(retry_after);
        e
    }

    /// The request's time limit ran out (in the queue or while generating).
    pub fn timeout(limit_s: u64) -> Self {
        Self::new(
            StatusCode::GATEWAY_TIMEOUT,
            "timeout_error",
            format!("the request ran past this server's time limit of {limit_s} s"),
        )
        .with_code("timeout")
    }

    pub fn with_param(mut self, param: &str) -> Self {
        self.param = Some(param.to_string());
        self
    }

    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        r
    }
}

/// `stop`: one string or up to four.
#[derive(Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// What both endpoints share: sampling, limits, streaming, and the parameters refused.
#[derive(Deserialize)]
pub struct Common {
    pub model: String,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub max_tokens: Option<i64>,
    /// The chat endpoint's newer name for `max_tokens`.
    pub max_completion_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    /// Extensions that llama.cpp-style clients send; the sampler has both.
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub seed: Option<i64>,
    pub stop: Option<Stop>,
    pub n: Option<i64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub logit_bias: Option<Map<String, Value>>,
    pub logprobs: Option<Value>,
    pub top_logprobs: Option<Value>,
    pub tools: Option<Vec<Value>>,
    pub functions: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub response_format: Option<Value>,
    pub echo: Option<bool>,
    pub best_of: Option<i64>,
    pub suffix: Option<String>,
    /// Everything else, checked by [`Common::validate`].
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// Fields accepted and ignored: they never change an answer.
const IGNORED: &[&str] = &[
    "user",
    "metadata",
    "store",
    "service_tier",
    "parallel_tool_calls",
];

/// Most stop strings, as OpenAI allows.
const MAX_STOP: usize = 4;

/// Longest stop string: every token's text is scanned for each one's prefixes.
const MAX_STOP_BYTES: usize = 1024;

/// A request's generation settings once checked.
#[derive(Clone, Debug)]
pub struct Settings {
    pub stream: bool,
    pub include_usage: bool,
    /// `None`: up to the context's end.
    pub max_tokens: Option<usize>,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
}

impl Common {
    /// Check every parameter's range and refuse what this server would otherwise ignore.
    pub fn validate(&self) -> Result<Settings, ApiError> {
        if let Some(key) = self.extra.keys().find(|k| !IGNORED.contains(&k.as_str())) {
            return Err(ApiError::param(
                key,
                format!("Unrecognized request argument supplied: {key}"),
            )
            .with_code("unknown_parameter"));
        }
        let unsupported = |param: &str, why: &str| {
            Err(ApiError::param(
                param,
                format!("`{param}`: {why} is not supported by this server"),
            )
            .with_code("unsupported_parameter"))
        };
        if self.n.is_some_and(|n| n != 1) {
            return unsupported("n", "more than one choice");
        }
        if self.best_of.is_some_and(|n| n != 1) {
            return unsupported("best_of", "more than one candidate");
        }
        for (param, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if v.is_some_and(|v| v != 0.0) {
                return unsupported(param, "a non-zero penalty");
            }
        }
        if self.logit_bias.as_ref().is_some_and(|m| !m.is_empty()) {
            return unsupported("logit_bias", "a logit bias");
        }
        for (param, v) in [
            ("logprobs", &self.logprobs),
            ("top_logprobs", &self.top_logprobs),
        ] {
            if v.as_ref()
                .is_some_and(|v| !matches!(v, Value::Null | Value::Bool(false)))
            {
                return unsupported(param, "returning log probabilities");
            }
        }
        if self.tools.as_ref().is_some_and(|t| !t.is_empty())
            || self.functions.as_ref().is_some_and(|t| !t.is_empty())
        {
            return unsupported("tools", "tool calling");
        }
        if self
            .tool_choice
            .as_ref()
            .is_some_and(|v| !matches!(v, Value::Null) && v != "none" && v != "auto")
        {
            return unsupported("tool_choice", "forcing a tool call");
        }
        if let Some(f) = &self.response_format {
            if f.get("type").and_then(Value::as_str) != Some("text") {
                return unsupported("response_format", "a structured response format");
            }
        }
        if self.echo == Some(true) {
            return unsupported("echo", "echoing the prompt");
        }
        if self.suffix.is_some() {
            return unsupported("suffix", "a suffix (fill-in-the-middle)");
        }

        let max_tokens = match self.max_completion_tokens.or(self.max_tokens) {
            None => None,
            Some(n) if n >= 1 => Some(usize::try_from(n).unwrap_or(usize::MAX)),
            Some(n) => {
                return Err(ApiError::param(
                    "max_tokens",
                    format!("max_tokens must be at least 1, got {n}"),
                ))
            }
        };
        let temperature = self.temperature.unwrap_or(1.0);
        if !(0.0..=2.0).contains(&temperature) {
            return Err(ApiError::param(
                "temperature",
                format!("temperature must be in [0, 2], got {temperature}"),
            ));
        }
        let top_p = self.top_p.unwrap_or(1.0);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(ApiError::param(
                "top_p",
                format!("top_p must be in (0, 1], got {top_p}"),
            ));
        }
        let top_k = match self.top_k {
            None => 0,
            Some(k) => usize::try_from(k)
                .map_err(|_| ApiError::param("top_k", format!("top_k must be >= 0, got {k}")))?,
        };
        let min_p = self.min_p.unwrap_or(0.0);
        if !(0.0..=1.0).contains(&min_p) {
            return Err(ApiError::param(
                "min_p",
                format!("min_p must be in [0, 1], got {min_p}"),
            ));
        }
        let stop = match &self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        };
        if stop.len() > MAX_STOP
            || stop
                .iter()
                .any(|s| s.is_empty() || s.len() > MAX_STOP_BYTES)
        {
            return Err(ApiError::param(
                "stop",
                format!(
                    "stop takes at most {MAX_STOP} non-empty strings of at most {MAX_STOP_BYTES} bytes"
                ),
            ));
        }
        let sampling = SamplingParams {
            temperature: temperature as f32,
            top_k,
            top_p: top_p as f32,
            min_p: min_p as f32,
            // Any integer is a seed; negative ones keep their bits.
            seed: self.seed.map_or(0, |s| s as u64),
        };
        sampling
            .validate()
            .map_err(|e| ApiError::invalid(e.to_string()))?;
        Ok(Settings {
            stream: self.stream,
            include_usage: self
                .stream_options
                .as_ref()
                .is_some_and(|o| o.include_usage),
            max_tokens,
            sampling,
            stop,
        })
    }
}

#[derive(Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<Message>,
    #[serde(flatten)]
    pub common: Common,
}

#[derive(Deserialize)]
pub struct Message {
    pub role: String,
    /// `null` for an assistant turn that only called tools (refused below).
    pub content: Option<Content>,
    pub tool_calls: Option<Vec<Value>>,
}

#[derive(Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Deserialize)]
pub struct Part {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

impl ChatRequest {
    /// The conversation as the chat template wants it: text only, `developer` read as `system`.
    pub fn chat_messages(&self) -> Result<Vec<ChatMessage>, ApiError> {
        if self.messages.is_empty() {
            return Err(ApiError::param("messages", "messages must not be empty"));
        }
        self.messages
            .iter()
            .enumerate()
            .map(|(i, m)| {
                let role = match m.role.as_str() {
                    "system" | "developer" => "system",
                    "user" => "user",
                    "assistant" => "assistant",
                    other => {
                        return Err(ApiError::param(
                            &format!("messages[{i}].role"),
                            format!("role `{other}` is not supported (system, developer, user, assistant)"),
                        ))
                    }
                };
                if m.tool_calls.as_ref().is_some_and(|t| !t.is_empty()) {
                    return Err(ApiError::param(
                        &format!("messages[{i}].tool_calls"),
                        "tool calls are not supported by this server",
                    ));
                }
                let content = match &m.content {
                    None => String::new(),
                    Some(Content::Text(t)) => t.clone(),
                    Some(Content::Parts(parts)) => {
                        let mut text = String::new();
                        for p in parts {
                            match (p.kind.as_str(), &p.text) {
                                ("text", Some(t)) => text.push_str(t),
                                (kind, _) => {
                                    return Err(ApiError::param(
                                        &format!("messages[{i}].content"),
                                        format!("content parts of type `{kind}` are not supported (text only)"),
                                    ))
                                }
                            }
                        }
                        text
                    }
                };
                Ok(ChatMessage::new(role, content))
            })
            .collect()
    }
}

#[derive(Deserialize)]
pub struct CompletionRequest {
    /// A string, token ids, or a one-element list of either.
    pub prompt: Value,
    #[serde(flatten)]
    pub common: Common,
}

/// A completion prompt: text to tokenise, or token ids as given.
pub enum Prompt {
    Text(String),
    Ids(Vec<u32>),
}

impl CompletionRequest {
    pub fn prompt(&self) -> Result<Prompt, ApiError> {
        let bad = || {
            ApiError::param(
                "prompt",
                "prompt must be a string, an array of token ids, or a one-element array of either",
            )
        };
        let one = match &self.prompt {
            Value::Array(items) if items.len() == 1 && !items[0].is_number() => &items[0],
            Value::Array(items) if items.len() > 1 && !items[0].is_number() => {
                return Err(ApiError::param(
                    "prompt",
                    "only one prompt per request is supported",
                ))
            }
            other => other,
        };
        match one {
            Value::String(s) => Ok(Prompt::Text(s.clone())),
            Value::Array(ids) => ids
                .iter()
                .map(|v| {
                    v.as_u64()
                        .and_then(|n| u32::try_from(n).ok())
                        .ok_or_else(bad)
                })
                .collect::<Result<_, _>>()
                .map(Prompt::Ids),
            _ => Err(bad()),
        }
    }
}

/// Parse a JSON body into `T`, answering malformed JSON and wrong types with a 400 that says
/// where.
pub fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| {
        let what = if e.is_syntax() || e.is_eof() {
            "malformed JSON"
        } else {
            "invalid request"
        };
        ApiError::invalid(format!("{what}: {e}"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn common(body: Value) -> Result<Settings, ApiError> {
        let mut body = body;
        body["model"] = json!("m");
        parse::<Common>(body.to_string().as_bytes())?.validate()
    }

    #[test]
    fn defaults_and_ranges() {
        let s = common(json!({})).unwrap();
        assert_eq!(s.sampling.temperature, 1.0);
        assert_eq!(s.max_tokens, None);
        assert!(common(json!({"temperature": 2.5})).is_err());
        assert!(common(json!({"temperature": -0.1})).is_err());
        assert!(common(json!({"top_p": 0})).is_err());
        assert!(common(json!({"max_tokens": 0})).is_err());
        assert!(common(json!({"top_k": -1})).is_err());
        assert!(common(json!({"stop": ["a", "b", "c", "d", "e"]})).is_err());
        assert!(common(json!({"stop": ""})).is_err());
        assert!(common(json!({"stop": "x".repeat(2000)})).is_err());
        assert_eq!(common(json!({"stop": "x"})).unwrap().stop, vec!["x"]);
        assert_eq!(common(json!({"seed": -1})).unwrap().sampling.seed, u64::MAX);
    }

    #[test]
    fn unknown_and_unsupported_fields() {
        let e = common(json!({"frobnicate": 1})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("frobnicate"));
        assert!(common(json!({"user": "u", "n": 1, "presence_penalty": 0})).is_ok());
        assert!(common(json!({"n": 2})).is_err());
        assert!(common(json!({"logprobs": true})).is_err());
        assert!(common(json!({"response_format": {"type": "json_object"}})).is_err());
        assert!(common(json!({"max_tokens": "ten"})).is_err());
    }

    #[test]
    fn completion_prompts() {
        let p = |v: Value| {
            parse::<CompletionRequest>(json!({"model": "m", "prompt": v}).to_string().as_bytes())
                .unwrap()
                .prompt()
        };
        assert!(matches!(p(json!("hi")), Ok(Prompt::Text(t)) if t == "hi"));
        assert!(matches!(p(json!(["hi"])), Ok(Prompt::Text(_))));
        assert!(matches!(p(json!([1, 2])), Ok(Prompt::Ids(v)) if v == [1, 2]));
        assert!(matches!(p(json!([[1, 2]])), Ok(Prompt::Ids(_))));
        assert!(p(json!(["a", "b"])).is_err());
        assert!(p(json!([-1])).is_err());
        assert!(p(json!(7)).is_err());
    }
}
