//! Text a peer sent, made safe to print. A refusal's reason, an error message, a model name
//! from a Hello: any of it may reach a terminal or a log, and raw it could carry escape codes
//! (move the cursor, rewrite a line, set the title) or newlines (print a fake "pairing code"
//! line under the real one). So every string that crosses the link is passed through
//! [`printable`] where it is decoded, once, and everything downstream may print it as is.

/// At most this many characters of one peer's string are kept (an error message is a line).
pub const MAX_CHARS: usize = 500;

/// `text` with control characters (C0, DEL, C1: escape codes, newlines, tabs), bidirectional
/// overrides and isolates (which reorder what is shown) written as `\u{..}` escapes, and cut to
/// [`MAX_CHARS`] characters (an ellipsis marks the cut).
pub fn printable(text: &str) -> String {
    let mut out = String::with_capacity(text.len().min(4 * MAX_CHARS));
    for (n, c) in text.chars().enumerate() {
        if n == MAX_CHARS {
            out.push('…');
            break;
        }
        if c.is_control() || matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}') {
            out.push_str(&format!("\\u{{{:x}}}", c as u32));
        } else {
            out.push(c);
        }
    }
    out
}

/// [`printable`] of bytes that may not be UTF-8.
pub fn printable_bytes(bytes: &[u8]) -> String {
    printable(&String::from_utf8_lossy(bytes))
}

/// `value` with every string in it, and every key, [`printable`] (a decoded message's JSON).
pub fn printable_json(value: serde_json::Value) -> serde_json::Value {
    use serde_json::Value;
    match value {
        Value::String(s) => Value::String(printable(&s)),
        Value::Array(items) => Value::Array(items.into_iter().map(printable_json).collect()),
        Value::Object(map) => Value::Object(
            map.into_iter()
                .map(|(k, v)| (printable(&k), printable_json(v)))
                .collect(),
        ),
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_newlines_and_terminal_codes_and_keeps_the_rest() {
        let fake = "busy\n\x1b[2K\rpairing code: 111-111\u{202e}";
        let shown = printable(fake);
        assert_eq!(
            shown,
            "busy\\u{a}\\u{1b}[2K\\u{d}pairing code: 111-111\\u{202e}"
        );
        assert!(!shown.chars().any(char::is_control));
        assert_eq!(
            printable("wrong pairing code — née"),
            "wrong pairing code — née"
        );
        assert_eq!(printable_bytes(b"a\xffb\x07"), "a\u{fffd}b\\u{7}");
        let long = printable(&"x".repeat(10_000));
        assert_eq!(long.chars().count(), MAX_CHARS + 1);
    }

    #[test]
    fn every_string_and_key_of_a_message_is_made_printable() {
        let v = serde_json::json!({"m\x1b": ["a\nb", {"c": "\x1b[31m"}], "n": 3});
        assert_eq!(
            printable_json(v),
            serde_json::json!({"m\\u{1b}": ["a\\u{a}b", {"c": "\\u{1b}[31m"}], "n": 3})
        );
    }
}
