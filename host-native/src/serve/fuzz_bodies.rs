//! Fuzzing the request bodies of `tether serve`: whatever a client POSTs to
//! `/v1/chat/completions` or `/v1/completions` is answered with settings or a 4xx, before
//! anything is queued, and never with a panic (which would drop the connection and count as a
//! server fault). The bodies go through what the handlers run on them (`routes::chat`,
//! `routes::completions`): `api::parse`, `Common::validate`, then the messages or the prompt.
//! The router itself needs a loaded model; these functions do not.
//!
//! `scripts/fuzz` runs these with many more cases.

use proptest::prelude::*;
use proptest::test_runner::Config;
use serde_json::{json, Map, Value};

use super::api::{parse, ApiError, ChatRequest, CompletionRequest, Settings};

/// `default` cases, or `PROPTEST_CASES` when set (a test that sets `cases` overrides the
/// variable, which proptest reads only into its own default).
fn cases(default: u32) -> Config {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default);
    Config {
        cases,
        ..Config::default()
    }
}

#[derive(Clone, Copy, Debug)]
enum Endpoint {
    Chat,
    Completions,
}

/// What the endpoint's handler makes of `body` before admission: its settings, or the error
/// it answers with.
fn read(endpoint: Endpoint, body: &[u8]) -> Result<Settings, ApiError> {
    match endpoint {
        Endpoint::Chat => {
            let req: ChatRequest = parse(body)?;
            let settings = req.common.validate()?;
            req.chat_messages()?;
            Ok(settings)
        }
        Endpoint::Completions => {
            let req: CompletionRequest = parse(body)?;
            let settings = req.common.validate()?;
            req.prompt()?;
            Ok(settings)
        }
    }
}

/// Settings or a 4xx: the client's fault is never answered as the server's.
fn client_error_or_ok(endpoint: Endpoint, body: &[u8]) -> Result<(), TestCaseError> {
    if let Err(e) = read(endpoint, body) {
        prop_assert!(
            e.status.is_client_error(),
            "{:?} answered {}: {}",
            endpoint,
            e.status,
            e.message
        );
    }
    Ok(())
}

fn endpoint() -> impl Strategy<Value = Endpoint> {
    prop_oneof![Just(Endpoint::Chat), Just(Endpoint::Completions)]
}

/// Every field either endpoint reads.
const FIELDS: &[&str] = &[
    "model",
    "messages",
    "prompt",
    "stream",
    "stream_options",
    "include_usage",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "tools",
    "functions",
    "tool_choice",
    "response_format",
    "echo",
    "best_of",
    "suffix",
    "user",
    "role",
    "content",
    "type",
    "text",
    "tool_calls",
];

fn key() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => proptest::sample::select(FIELDS).prop_map(str::to_string),
        1 => any::<String>(),
    ]
}

/// Any JSON value, with the numbers and strings at the edges of the checks.
fn arb_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        prop_oneof![
            Just(0i64),
            Just(1),
            Just(-1),
            Just(i64::MIN),
            Just(i64::MAX),
            any::<i64>()
        ]
        .prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        prop_oneof![
            Just(0.0f64),
            Just(-0.0),
            Just(1e-300),
            Just(2.0),
            Just(2.0000001),
            Just(f64::MAX),
            any::<f64>()
        ]
        .prop_map(Value::from),
        prop_oneof![
            Just("none".to_string()),
            Just("auto".to_string()),
            Just("text".to_string()),
            Just("user".to_string()),
            Just("m".to_string()),
            any::<String>()
        ]
        .prop_map(Value::from),
    ];
    leaf.prop_recursive(3, 24, 5, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
            proptest::collection::vec((key(), inner), 0..5)
                .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}

/// A body each endpoint accepts.
fn valid_body(endpoint: Endpoint) -> Value {
    match endpoint {
        Endpoint::Chat => json!({
            "model": "m",
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            ],
            "temperature": 0.5,
            "max_tokens": 8,
            "stop": ["\n"],
            "stream": true,
            "stream_options": {"include_usage": true},
            "user": "u",
        }),
        Endpoint::Completions => json!({
            "model": "m",
            "prompt": ["once upon"],
            "top_p": 0.9,
            "seed": -3,
            "n": 1,
        }),
    }
}

/// Parameters in their valid ranges, and the settings they must give.
fn arb_valid_params() -> impl Strategy<Value = (Map<String, Value>, Settings)> {
    // Multiples of 2^-10: exact in JSON text, so the settings can be compared exactly.
    let frac = |lo: u32, hi: u32| (lo..=hi).prop_map(|k| f64::from(k) / 1024.0);
    (
        frac(0, 2048),
        frac(1, 1024),
        proptest::option::of(0..100_000i64),
        frac(0, 1024),
        proptest::option::of(1..=i64::MAX),
        any::<i64>(),
        proptest::collection::vec("[^\u{0}]{1,16}", 0..=4),
        any::<bool>(),
    )
        .prop_map(
            |(temperature, top_p, top_k, min_p, max_tokens, seed, stop, stream)| {
                let mut m = Map::new();
                m.insert("temperature".into(), temperature.into());
                m.insert("top_p".into(), top_p.into());
                if let Some(k) = top_k {
                    m.insert("top_k".into(), k.into());
                }
                m.insert("min_p".into(), min_p.into());
                if let Some(n) = max_tokens {
                    m.insert("max_tokens".into(), n.into());
                }
                m.insert("seed".into(), seed.into());
                m.insert("stop".into(), stop.clone().into());
                m.insert("stream".into(), stream.into());
                let settings = Settings {
                    stream,
                    include_usage: false,
                    max_tokens: max_tokens.map(|n| n as usize),
                    sampling: engine_core::generate::SamplingParams {
                        temperature: temperature as f32,
                        top_k: top_k.unwrap_or(0) as usize,
                        top_p: top_p as f32,
                        min_p: min_p as f32,
                        seed: seed as u64,
                    },
                    stop,
                };
                (m, settings)
            },
        )
}

proptest! {
    #![proptest_config(cases(2048))]

    /// Any bytes: a 4xx (almost always "malformed JSON"), never a panic.
    #[test]
    fn random_bytes_are_client_errors(
        endpoint in endpoint(),
        body in prop_oneof![
            proptest::collection::vec(any::<u8>(), 0..256),
            any::<String>().prop_map(String::into_bytes),
        ],
    ) {
        client_error_or_ok(endpoint, &body)?;
    }

    /// Any JSON value as the body: settings or a 4xx.
    #[test]
    fn any_json_is_settings_or_a_client_error(endpoint in endpoint(), body in arb_json()) {
        client_error_or_ok(endpoint, body.to_string().as_bytes())?;
    }

    /// A valid body with fields set to anything, removed, or the text cut short: settings or
    /// a 4xx.
    #[test]
    fn edited_bodies_are_settings_or_client_errors(
        endpoint in endpoint(),
        edits in proptest::collection::vec((key(), proptest::option::of(arb_json())), 1..5),
        cut in proptest::option::of(any::<usize>()),
    ) {
        let mut body = valid_body(endpoint);
        prop_assert!(read(endpoint, body.to_string().as_bytes()).is_ok());
        for (k, v) in edits {
            let obj = body.as_object_mut().unwrap();
            match v {
                Some(v) => obj.insert(k, v),
                None => obj.remove(&k),
            };
        }
        let mut text = body.to_string().into_bytes();
        if let Some(at) = cut {
            text.truncate(at % text.len());
        }
        client_error_or_ok(endpoint, &text)?;
    }

    /// An unknown field is refused by name, whatever else the body holds.
    #[test]
    fn unknown_fields_are_refused_by_name(
        endpoint in endpoint(),
        name in "[a-z_]{1,12}",
        value in arb_json(),
    ) {
        let ignored = ["metadata", "store", "service_tier", "parallel_tool_calls"];
        prop_assume!(!FIELDS.contains(&name.as_str()) && !ignored.contains(&name.as_str()));
        let mut body = valid_body(endpoint);
        body[&name] = value;
        let e = read(endpoint, body.to_string().as_bytes()).err();
        prop_assert_eq!(e.as_ref().and_then(|e| e.param.as_deref()), Some(name.as_str()));
        prop_assert_eq!(e.and_then(|e| e.code), Some("unknown_parameter"));
    }

    /// Parameters in range give exactly the settings they say; each one pushed out of range
    /// is refused, naming it.
    #[test]
    fn parameters_in_range_give_their_settings(
        endpoint in endpoint(),
        (params, want) in arb_valid_params(),
        bad in proptest::option::of((0..5usize, -1e6..1e6f64)),
    ) {
        let mut body = valid_body(endpoint);
        let obj = body.as_object_mut().unwrap();
        // Only the generated parameters: the valid body's own are dropped.
        obj.retain(|k, _| ["model", "messages", "prompt"].contains(&k.as_str()));
        obj.extend(params);
        let got = read(endpoint, body.to_string().as_bytes());
        let got = got.map_err(|e| TestCaseError::fail(format!("{}: {}", body, e.message)))?;
        prop_assert_eq!(format!("{:?}", got), format!("{:?}", want));

        // Out of range: temperature past [0, 2], top_p past (0, 1], min_p past [0, 1],
        // max_tokens below 1, top_k below 0.
        if let Some((which, x)) = bad {
            // Below `lo` when x < 0, else above `hi`.
            let outside = |lo: f64, hi: f64| {
                if x < 0.0 {
                    lo + x.min(-1e-9)
                } else {
                    hi + x.max(1e-9)
                }
            };
            let (param, value): (&str, Value) = match which {
                0 => ("temperature", outside(0.0, 2.0).into()),
                1 => ("top_p", (if x <= 0.0 { x } else { 1.0 + x.max(1e-9) }).into()),
                2 => ("min_p", outside(0.0, 1.0).into()),
                3 => ("max_tokens", (-(x.abs() as i64).max(0)).into()),
                _ => ("top_k", (-(x.abs() as i64).max(1)).into()),
            };
            body[param] = value;
            let e = read(endpoint, body.to_string().as_bytes())
                .err()
                .ok_or_else(|| TestCaseError::fail(format!("{param} accepted: {body}")))?;
            prop_assert!(e.status.is_client_error());
            prop_assert_eq!(e.param.as_deref(), Some(param));
        }
    }
}
