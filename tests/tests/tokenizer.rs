//! The tokenizer against samples encoded by the reference tokenizer, streaming detokenisation,
//! the byte-level fallback, chat templates and bad input.

use std::path::PathBuf;
use std::sync::OnceLock;

use engine_core::tokenizer::{ChatMessage, StreamDecoder, Tokenizer};
use engine_core::Error;
use tests::fixtures_dir;

struct Sample {
    text: String,
    ids: Vec<u32>,
}

/// The 33 MB tokenizer.json is loaded once for all tests in this file.
fn qwen() -> &'static Tokenizer {
    static TOKENIZER: OnceLock<Tokenizer> = OnceLock::new();
    TOKENIZER.get_or_init(|| {
        Tokenizer::from_dir(fixtures_dir().join("tokenizer")).expect("fixture tokenizer loads")
    })
}

fn samples() -> Vec<Sample> {
    let path = fixtures_dir().join("tokenizer/samples.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let json: serde_json::Value = serde_json::from_str(&text).expect("samples.json parses");
    json["samples"]
        .as_array()
        .expect("samples array")
        .iter()
        .map(|s| Sample {
            text: s["text"].as_str().expect("text").to_string(),
            ids: s["ids"]
                .as_array()
                .expect("ids")
                .iter()
                .map(|v| v.as_u64().expect("id") as u32)
                .collect(),
        })
        .collect()
}

/// The tokenizer normalises to NFC, so the one sample written with a combining accent decodes
/// to the composed character.
fn nfc(text: &str) -> String {
    text.replace("e\u{301}", "\u{e9}")
}

/// A fresh directory per test and process, so parallel runs never share files.
fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tether-tokenizer-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

const TINY_TOKENIZER_JSON: &str = r#"{"version": "1.0", "truncation": null, "padding": null,
  "added_tokens": [], "normalizer": null, "pre_tokenizer": {"type": "Whitespace"},
  "post_processor": null, "decoder": null,
  "model": {"type": "WordLevel", "vocab": {"<unk>": 0, "hi": 1}, "unk_token": "<unk>"}}"#;

#[test]
fn samples_encode_to_reference_ids_and_decode_back() {
    let tok = qwen();
    let samples = samples();
    assert_eq!(samples.len(), 10);
    for s in &samples {
        assert_eq!(tok.encode(&s.text).unwrap(), s.ids, "encoding {:?}", s.text);
        assert_eq!(
            tok.decode(&s.ids).unwrap(),
            nfc(&s.text),
            "decoding {:?}",
            s.ids
        );
    }
}

#[test]
fn special_tokens_and_vocab_size() {
    let tok = qwen();
    assert_eq!(tok.token_id("<|im_start|>"), Some(248045));
    assert_eq!(tok.token_id("<|im_end|>"), Some(248046));
    assert_eq!(tok.token_id("<|endoftext|>"), Some(248044));
    assert_eq!(tok.token_id("<no such token>"), None);
    assert_eq!(tok.vocab_size(), 248044 + 33);
}

#[test]
fn streaming_decode_matches_full_decode_and_never_splits_characters() {
    let tok = qwen();
    let mut saw_held_token = false;
    for s in samples() {
        let mut stream = StreamDecoder::new(tok);
        let mut pieces = Vec::new();
        for &id in &s.ids {
            let piece = stream.push(id).unwrap();
            saw_held_token |= piece.is_empty();
            assert!(!piece.contains('\u{FFFD}'), "{:?} in {:?}", piece, s.text);
            pieces.push(piece);
        }
        let rest = stream.finish().unwrap();
        assert!(!rest.contains('\u{FFFD}'));
        let streamed = pieces.concat() + &rest;
        assert_eq!(streamed, tok.decode(&s.ids).unwrap());
        if s.text.starts_with("The quick") {
            assert_eq!(pieces[1], " quick", "leading space kept");
        }
    }
    assert!(
        saw_held_token,
        "some sample splits a character across tokens (the emoji), so a push must hold text back"
    );
}

#[test]
fn stream_decoder_is_reusable_after_finish() {
    let tok = qwen();
    let ids = tok.encode("🚀 go").unwrap();
    let mut stream = StreamDecoder::new(tok);
    for _ in 0..2 {
        let text: String = ids.iter().map(|&id| stream.push(id).unwrap()).collect();
        assert_eq!(text + &stream.finish().unwrap(), "🚀 go");
    }
}

#[test]
fn byte_level_round_trip_and_streaming() {
    let tok = Tokenizer::byte_level(300);
    let text = "héllo 🚀!";
    let ids = tok.encode(text).unwrap();
    assert_eq!(ids, text.bytes().map(u32::from).collect::<Vec<_>>());
    assert_eq!(tok.decode(&ids).unwrap(), text);
    assert_eq!(
        tok.decode(&[104, 256, 299, 105]).unwrap(),
        "hi",
        "ids >= 256 are empty"
    );
    assert_eq!(tok.vocab_size(), 300);
    assert_eq!(tok.token_id("<|im_end|>"), None);

    let mut stream = StreamDecoder::new(&tok);
    let rocket: Vec<String> = "🚀"
        .bytes()
        .map(|b| stream.push(u32::from(b)).unwrap())
        .collect();
    assert_eq!(rocket, ["", "", "", "🚀"]);
    assert_eq!(stream.push(299).unwrap(), "");
    assert_eq!(
        stream.push(0xF0).unwrap(),
        "",
        "an incomplete lead byte is held"
    );
    assert_eq!(
        stream.finish().unwrap(),
        "\u{FFFD}",
        "and replaced only at the end"
    );

    let err = Tokenizer::byte_level(128).encode("é").unwrap_err();
    assert!(
        matches!(err, Error::TokenOutOfRange { vocab: 128, .. }),
        "{err}"
    );
}

#[test]
fn chatml_is_the_fallback_template() {
    let tok = Tokenizer::byte_level(256);
    let messages = [
        ChatMessage::new("system", "You are terse."),
        ChatMessage::new("user", "Hi!"),
    ];
    let expected = "<|im_start|>system\nYou are terse.<|im_end|>\n\
                    <|im_start|>user\nHi!<|im_end|>\n";
    assert_eq!(tok.apply_chat_template(&messages, false).unwrap(), expected);
    let prompt = tok.apply_chat_template(&messages, true).unwrap();
    assert_eq!(prompt, format!("{expected}<|im_start|>assistant\n"));
    // The fixture tokenizer has no tokenizer_config.json, so it falls back too.
    assert_eq!(qwen().apply_chat_template(&messages, true).unwrap(), prompt);
}

#[test]
fn chat_template_from_tokenizer_config_renders() {
    let dir = temp_dir("template");
    std::fs::write(dir.join("tokenizer.json"), TINY_TOKENIZER_JSON).unwrap();
    // Exercises what HF templates rely on: block trimming, python string methods,
    // raise_exception, and special tokens given as strings or AddedToken objects.
    let template = "{{ bos_token }}{% for m in messages %}\n\
          {% if m.role not in ['user', 'assistant'] %}{{ raise_exception('bad role ' + m.role) }}{% endif %}\n\
          [{{ m.role.upper() }}]{% if m.content.lstrip().startswith('Q') %} (question){% endif %} {{ m.content.strip() }}\n\
        {% endfor %}\n\
        {% if add_generation_prompt %}[ASSISTANT]{% endif %}\
        {% if eos_token is defined %}{{ eos_token }}{% endif %}";
    let config = serde_json::json!({
        "chat_template": template,
        "bos_token": "<s>",
        "eos_token": {"content": "</s>", "special": true},
    });
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    let tok = Tokenizer::from_dir(&dir).unwrap();
    let messages = [
        ChatMessage::new("user", "  Q1  "),
        ChatMessage::new("assistant", "A1"),
    ];
    assert_eq!(
        tok.apply_chat_template(&messages, true).unwrap(),
        "<s>[USER] (question) Q1\n[ASSISTANT] A1\n[ASSISTANT]</s>"
    );
    let err = tok
        .apply_chat_template(&[ChatMessage::new("tool", "x")], false)
        .unwrap_err();
    assert!(matches!(err, Error::Template(_)), "{err}");
    assert!(err.to_string().contains("bad role tool"), "{err}");

    // A separate chat_template.jinja takes precedence, as in transformers.
    std::fs::write(dir.join("chat_template.jinja"), "{{ messages | length }}").unwrap();
    let tok = Tokenizer::from_dir(&dir).unwrap();
    assert_eq!(tok.apply_chat_template(&messages, true).unwrap(), "2");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn malformed_or_missing_files_are_errors_naming_the_file() {
    let err = Tokenizer::from_bytes(b"{ not json", None).unwrap_err();
    assert!(matches!(err, Error::Tokenizer(_)), "{err}");
    assert!(err.to_string().contains("tokenizer.json"), "{err}");

    let dir = temp_dir("malformed");
    std::fs::write(dir.join("tokenizer.json"), r#"{"model": 42}"#).unwrap();
    let err = Tokenizer::from_dir(&dir).unwrap_err().to_string();
    assert!(
        err.contains(&dir.join("tokenizer.json").display().to_string()),
        "{err}"
    );

    std::fs::write(dir.join("tokenizer.json"), TINY_TOKENIZER_JSON).unwrap();
    std::fs::write(dir.join("tokenizer_config.json"), "[1, 2").unwrap();
    let err = Tokenizer::from_dir(&dir).unwrap_err().to_string();
    assert!(err.contains("tokenizer_config.json"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();

    let err = Tokenizer::from_dir(dir.join("absent")).unwrap_err();
    assert!(matches!(err, Error::Io { .. }), "{err}");
    assert!(err.to_string().contains("tokenizer.json"), "{err}");
}

/// A chat's breaks fall where each of its messages ends: the rendering of the messages up to
/// there, a prefix of the prompt (found from the `<|im_start|>` tokens with this tokenizer).
#[test]
fn chat_breaks_fall_at_message_ends() {
    let t = qwen();
    let m = [
        ChatMessage::new("system", "Be brief."),
        ChatMessage::new("user", "What is a page?"),
        ChatMessage::new("assistant", "Rows of keys."),
        ChatMessage::new("user", "And a frame?"),
    ];
    let prompt = t.encode_chat(&m, true).unwrap();
    let ends: Vec<usize> = [1, 2, 3, 4]
        .iter()
        .map(|&k| t.encode_chat(&m[..k], false).unwrap())
        .inspect(|h| assert_eq!(prompt[..h.len()], h[..]))
        .map(|h| h.len())
        .collect();
    assert!(ends.windows(2).all(|w| w[0] < w[1]) && ends[3] < prompt.len());
    assert_eq!(t.chat_breaks(&m, &prompt), ends);
    // One message: its end; two: both ends once.
    let one = t.encode_chat(&m[1..2], true).unwrap();
    let user_end = t.encode_chat(&m[1..2], false).unwrap().len();
    assert_eq!(t.chat_breaks(&m[1..2], &one), [user_end]);
    let two = t.encode_chat(&m[..2], true).unwrap();
    assert_eq!(t.chat_breaks(&m[..2], &two), ends[..2]);
}
