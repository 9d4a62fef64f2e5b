//! Text ⇄ token ids, chat prompts and streaming detokenisation.
//!
//! Real checkpoints ship a Hugging Face `tokenizer.json` (byte-level BPE for Qwen3.5), so that
//! format is delegated to the `tokenizers` crate rather than reimplemented: matching its
//! pre-tokeniser regex and merge order bit for bit is the whole job. Synthetic test models have
//! no tokenizer at all; [`Tokenizer::byte_level`] gives them one whose ids are raw UTF-8 bytes
//! so generation can still round-trip text. Chat prompts come from the checkpoint's Jinja
//! template, rendered the way `transformers` does, because prompt formatting the model was not
//! trained on silently degrades its answers. Text from users ([`Tokenizer::encode_text`],
//! [`Tokenizer::encode_chat`]) never turns into control tokens: `<|im_start|>` typed in a
//! message is text, and only the template's own markers are special.

use std::collections::BTreeMap;
use std::fmt;
#[cfg(not(target_arch = "wasm32"))]
use std::path::Path;
use std::sync::Arc;

use minijinja::{Environment, ErrorKind, Value};
use serde::{Deserialize, Serialize};
use tokenizers::{Model as _, PreTokenizer as _};

use crate::error::{Error, Result};

/// One turn of a conversation, shaped like the `messages` entries chat templates index into.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A vocabulary plus the chat formatting that goes with it.
///
/// Cheap to clone (shared behind an `Arc`) so that every [`StreamDecoder`] can own a handle
/// and live in per-request state without borrowing from the model.
#[derive(Clone)]
pub struct Tokenizer {
    inner: Arc<Inner>,
}

struct Inner {
    vocab: Vocab,
    chat: ChatConfig,
    /// The texts of the vocabulary's special tokens (`<|im_start|>`, ...), which user text is
    /// kept from spelling.
    specials: Vec<String>,
}

enum Vocab {
    Hf(Box<tokenizers::Tokenizer>),
    /// Ids `0..256` are bytes; the rest of `vocab_size` exists only so the model's output
    /// width and the tokenizer agree.
    ByteLevel {
        vocab_size: usize,
    },
}

/// What `tokenizer_config.json` contributes: the template and the tokens it may refer to.
#[derive(Default)]
struct ChatConfig {
    template: Option<String>,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl fmt::Debug for Tokenizer {
    /// Deliberately summary-only: the derived form would print a quarter-million-entry vocab.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.inner.vocab {
            Vocab::Hf(_) => "tokenizer.json",
            Vocab::ByteLevel { .. } => "byte-level",
        };
        f.debug_struct("Tokenizer")
            .field("kind", &kind)
            .field("vocab_size", &self.vocab_size())
            .field("chat_template", &self.inner.chat.template.is_some())
            .finish()
    }
}

impl Tokenizer {
    /// Loads `tokenizer.json` and, when present, `tokenizer_config.json` and
    /// `chat_template.jinja` from a checkpoint directory. Newer `transformers` releases save
    /// the template in that separate `.jinja` file, and it then wins over the config's copy,
    /// as it does in `transformers`.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Tokenizer> {
        let dir = dir.as_ref();
        let json_path = dir.join("tokenizer.json");
        let json = std::fs::read(&json_path).map_err(|e| Error::io(&json_path, e))?;
        let vocab = parse_tokenizer_json(&json, &json_path.display().to_string())?;

        let config_path = dir.join("tokenizer_config.json");
        let mut chat = match read_optional(&config_path)? {
            Some(config) => ChatConfig::parse(&config, &config_path.display().to_string())?,
            None => ChatConfig::default(),
        };
        if let Some(template) = read_optional(&dir.join("chat_template.jinja"))? {
            chat.template = Some(template);
        }
        Ok(Tokenizer::new(vocab, chat))
    }

    /// The file-free loader, for wasm32 where the host fetches the files and hands over bytes.
    pub fn from_bytes(json: &[u8], config_json: Option<&str>) -> Result<Tokenizer> {
        let vocab = parse_tokenizer_json(json, "tokenizer.json")?;
        let chat = match config_json {
            Some(config) => ChatConfig::parse(config, "tokenizer_config.json")?,
            None => ChatConfig::default(),
        };
        Ok(Tokenizer::new(vocab, chat))
    }

    /// For synthetic models without a vocabulary: any text still encodes (as its UTF-8
    /// bytes), and ids `>= 256` the model may sample decode to nothing rather than failing.
    pub fn byte_level(vocab_size: usize) -> Tokenizer {
        Tokenizer::new(Vocab::ByteLevel { vocab_size }, ChatConfig::default())
    }

    fn new(vocab: Vocab, chat: ChatConfig) -> Tokenizer {
        let specials = match &vocab {
            Vocab::Hf(t) => t
                .get_added_tokens_decoder()
                .values()
                .filter(|a| a.special && !a.content.is_empty())
                .map(|a| a.content.clone())
                .collect(),
            Vocab::ByteLevel { .. } => Vec::new(),
        };
        Tokenizer {
            inner: Arc::new(Inner {
                vocab,
                chat,
                specials,
            }),
        }
    }

    /// Special tokens written in `text` (`<|im_start|>`, …) become their ids, because chat
    /// prompts arrive as rendered text: for text from users see [`Tokenizer::encode_text`]. Nothing is added that the text does not contain: the
    /// chat template already places every marker the model expects.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        match &self.inner.vocab {
            Vocab::Hf(t) => t
                .encode_fast(text, false)
                .map(|enc| enc.get_ids().to_vec())
                .map_err(|e| Error::Tokenizer(format!("encoding failed: {e}"))),
            Vocab::ByteLevel { vocab_size } => text
                .bytes()
                .map(|b| {
                    let id = u32::from(b);
                    if (id as usize) < *vocab_size {
                        Ok(id)
                    } else {
                        Err(Error::TokenOutOfRange {
                            id,
                            vocab: *vocab_size,
                        })
                    }
                })
                .collect(),
        }
    }

    /// Text from a user (a completion prompt): special-token text in it stays text, so no one
    /// writes a control token by typing its name. Text without any is encoded as by
    /// [`Tokenizer::encode`].
    pub fn encode_text(&self, text: &str) -> Result<Vec<u32>> {
        let mark = self.free_mark([text])?;
        self.encode_marked(&self.escape(text, mark), mark)
    }

    /// A conversation rendered with the chat template and tokenised so that only the
    /// template's own markers become special tokens: special-token text in a message (a user
    /// closing their turn with `<|im_end|>` and opening a `system` one) stays text. Each
    /// message's special-token text is broken up with a mark before rendering, so the tokenizer
    /// finds only the template's, and the marks are removed again before the text is
    /// tokenised. A template that looks into a message for such text (`'</think>' in
    /// content`) no longer finds it there.
    pub fn encode_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>> {
        let mark = self.free_mark(messages.iter().map(|m| m.content.as_str()))?;
        let escaped: Vec<ChatMessage> = messages
            .iter()
            .map(|m| ChatMessage::new(m.role.clone(), self.escape(&m.content, mark)))
            .collect();
        self.encode_marked(
            &self.apply_chat_template(&escaped, add_generation_prompt)?,
            mark,
        )
    }

    /// Positions of `prompt` (`encode_chat(messages, true)`) where a prefill restarts its
    /// ubatches and a prefix cache may keep the state: where each message ends. The breaks
    /// below a position depend only on the messages before it, so a later request that
    /// renders the same messages the same way breaks at the same places up to there (its
    /// state there is the same bits), while the end of this prompt may tokenise differently
    /// once a reply follows it. With a `<|im_start|>` token (ChatML, the Qwen templates) these
    /// are the positions of that token after the first; otherwise the prompt's common prefix
    /// with each prefix of the messages rendered without the generation prompt (a template
    /// that cannot render one gives no break there). Ascending, inside the prompt.
    pub fn chat_breaks(&self, messages: &[ChatMessage], prompt: &[u32]) -> Vec<usize> {
        let mut ends: Vec<usize> = match self.token_id("<|im_start|>") {
            // User text never becomes this token (see `encode_chat`).
            Some(start) => (prompt.iter().enumerate().skip(1))
                .filter(|&(_, &t)| t == start)
                .map(|(i, _)| i)
                .collect(),
            None => (1..=messages.len())
                .filter_map(|k| self.encode_chat(&messages[..k], false).ok())
                .map(|h| prompt.iter().zip(&h).take_while(|(a, b)| a == b).count())
                .collect(),
        };
        ends.retain(|&p| p > 0 && p < prompt.len());
        ends.sort_unstable();
        ends.dedup();
        ends
    }

    /// A private-use character in none of `texts` and not in the template: it cannot be
    /// confused with anything else in a rendered prompt. Found in one pass over the texts.
    fn free_mark<'a>(&self, texts: impl IntoIterator<Item = &'a str>) -> Result<char> {
        const FIRST: u32 = 0xE000;
        const LAST: u32 = 0xF8FF;
        let mut used = vec![false; (LAST - FIRST + 1) as usize];
        let template = self.inner.chat.template.as_deref().unwrap_or_default();
        let chars = texts
            .into_iter()
            .flat_map(str::chars)
            .chain(template.chars());
        for c in chars {
            if let Some(i) = (c as u32).checked_sub(FIRST).filter(|&i| i <= LAST - FIRST) {
                used[i as usize] = true;
            }
        }
        used.iter()
            .position(|&u| !u)
            .and_then(|i| char::from_u32(FIRST + i as u32))
            .ok_or_else(|| {
                Error::Tokenizer("the text uses every private-use character; cannot mark it".into())
            })
    }

    /// `text` with `mark` after the first character of every special token's text in it
    /// (overlapping ones too), so that the tokenizer no longer matches them.
    fn escape(&self, text: &str, mark: char) -> String {
        let mut cuts = Vec::new();
        for s in &self.inner.specials {
            let first = s.chars().next().map_or(0, char::len_utf8);
            let mut from = 0;
            while let Some(at) = text[from..].find(s.as_str()) {
                from += at + first;
                cuts.push(from);
            }
        }
        cuts.sort_unstable();
        cuts.dedup();
        let mut out = String::with_capacity(text.len() + cuts.len() * mark.len_utf8());
        let mut at = 0;
        for cut in cuts {
            out.push_str(&text[at..cut]);
            out.push(mark);
            at = cut;
        }
        out.push_str(&text[at..]);
        out
    }

    /// Tokenise `text` in which `mark` breaks up special-token text from users: the pipeline
    /// [`Tokenizer::encode`] runs (added tokens found, normalisation, pre-tokenisation, the
    /// model), with the marks removed once the special tokens are found, so the text they
    /// broke up is tokenised as its user wrote it, as text.
    fn encode_marked(&self, text: &str, mark: char) -> Result<Vec<u32>> {
        let Vocab::Hf(t) = &self.inner.vocab else {
            // No special tokens: nothing was marked.
            return self.encode(text);
        };
        let failed = |e: tokenizers::Error| Error::Tokenizer(format!("encoding failed: {e}"));
        let mut pieces = t
            .get_added_vocabulary()
            .extract_and_normalize(t.get_normalizer(), text);
        pieces
            .normalize(|s| {
                s.filter(|c| c != mark);
                Ok(())
            })
            .map_err(failed)?;
        if let Some(p) = t.get_pre_tokenizer() {
            p.pre_tokenize(&mut pieces).map_err(failed)?;
        }
        pieces
            .tokenize(|s| t.get_model().tokenize(s.get()))
            .map_err(failed)?;
        let encoding = pieces
            .into_encoding(None, 0, tokenizers::OffsetType::None)
            .map_err(failed)?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Special tokens are kept so that `decode(encode(text)) == text`; ids the vocabulary does
    /// not know decode to nothing, as in `transformers`, since a model's embedding table is
    /// often padded past the tokenizer's size.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        match &self.inner.vocab {
            Vocab::Hf(t) => t
                .decode(ids, false)
                .map_err(|e| Error::Tokenizer(format!("decoding failed: {e}"))),
            Vocab::ByteLevel { .. } => Ok(String::from_utf8_lossy(&raw_bytes(ids)).into_owned()),
        }
    }

    /// Renders the conversation into the prompt the model was trained on. Without a template
    /// in the checkpoint, ChatML is used: it is Qwen's native format.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let chat = &self.inner.chat;
        let Some(source) = &chat.template else {
            return Ok(chatml(messages, add_generation_prompt));
        };
        // Absent tokens must stay *undefined*, not `none`: templates test `is defined`, and
        // minijinja would print a `none` value as the text "none".
        let mut ctx: BTreeMap<&str, Value> = BTreeMap::new();
        ctx.insert("messages", Value::from_serialize(messages));
        ctx.insert("add_generation_prompt", Value::from(add_generation_prompt));
        if let Some(bos) = &chat.bos_token {
            ctx.insert("bos_token", Value::from(bos.as_str()));
        }
        if let Some(eos) = &chat.eos_token {
            ctx.insert("eos_token", Value::from(eos.as_str()));
        }
        let env = template_env();
        env.template_from_named_str("chat_template", source)
            .and_then(|t| t.render(ctx))
            .map_err(|e| Error::Template(e.to_string()))
    }

    /// Lets callers find stop tokens such as `<|im_end|>` without hard-coding ids that differ
    /// between model families. The byte-level tokenizer has no named tokens.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        match &self.inner.vocab {
            Vocab::Hf(t) => t.token_to_id(token),
            Vocab::ByteLevel { .. } => None,
        }
    }

    /// Includes added (special) tokens, which sit above the BPE ranks.
    pub fn vocab_size(&self) -> usize {
        match &self.inner.vocab {
            Vocab::Hf(t) => t.get_vocab_size(true),
            Vocab::ByteLevel { vocab_size } => *vocab_size,
        }
    }
}

fn parse_tokenizer_json(json: &[u8], name: &str) -> Result<Vocab> {
    tokenizers::Tokenizer::from_bytes(json)
        .map(|t| Vocab::Hf(Box::new(t)))
        .map_err(|e| Error::Tokenizer(format!("{name}: {e}")))
}

#[cfg(not(target_arch = "wasm32"))]
fn read_optional(path: &Path) -> Result<Option<String>> {
    match std::fs::read_to_string(path) {
        Ok(text) => Ok(Some(text)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::io(path, e)),
    }
}

impl ChatConfig {
    fn parse(config_json: &str, name: &str) -> Result<ChatConfig> {
        #[derive(Deserialize)]
        struct Raw {
            chat_template: Option<RawTemplate>,
            bos_token: Option<RawToken>,
            eos_token: Option<RawToken>,
        }
        /// Multi-template checkpoints list `{name, template}` pairs, one of them "default".
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum RawTemplate {
            One(String),
            Named(Vec<NamedTemplate>),
        }
        #[derive(Deserialize)]
        struct NamedTemplate {
            name: String,
            template: String,
        }
        /// Older configs serialise special tokens as `AddedToken` objects instead of strings.
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum RawToken {
            Text(String),
            Added { content: String },
        }
        impl RawToken {
            fn into_string(self) -> String {
                match self {
                    RawToken::Text(s) | RawToken::Added { content: s } => s,
                }
            }
        }

        let raw: Raw = serde_json::from_str(config_json)
            .map_err(|e| Error::Tokenizer(format!("{name}: {e}")))?;
        let template = raw.chat_template.and_then(|t| match t {
            RawTemplate::One(s) => Some(s),
            RawTemplate::Named(list) => {
                let default = list.iter().position(|t| t.name == "default").unwrap_or(0);
                list.into_iter().nth(default).map(|t| t.template)
            }
        });
        Ok(ChatConfig {
            template,
            bos_token: raw.bos_token.map(RawToken::into_string),
            eos_token: raw.eos_token.map(RawToken::into_string),
        })
    }
}

fn chatml(messages: &[ChatMessage], add_generation_prompt: bool) -> String {
    let mut out = String::new();
    for m in messages {
        out.push_str("<|im_start|>");
        out.push_str(&m.role);
        out.push('\n');
        out.push_str(&m.content);
        out.push_str("<|im_end|>\n");
    }
    if add_generation_prompt {
        out.push_str("<|im_start|>assistant\n");
    }
    out
}

/// Mirrors the Jinja environment `transformers` renders chat templates in: block trimming on,
/// Python string/dict methods (`.startswith`, `.strip()`, `.items()`), and the helper
/// functions it injects. Templates are written against that environment, not plain Jinja.
fn template_env() -> Environment<'static> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", raise_exception);
    // wasm32 has no clock; templates guard `strftime_now is defined` and fall back to a date.
    #[cfg(not(target_arch = "wasm32"))]
    env.add_function("strftime_now", strftime_now);
    env
}

fn raise_exception(message: String) -> Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
}

/// UTC rather than local time: the engine has no time-zone database, and a date in a system
/// prompt is only ever a hint to the model.
#[cfg(not(target_arch = "wasm32"))]
fn strftime_now(format: &str) -> Result<String, minijinja::Error> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    strftime_utc(format, now.as_secs())
}

/// The handful of `strftime` directives chat templates use for "today's date"; anything else
/// is an error rather than a silently wrong prompt.
#[cfg(not(target_arch = "wasm32"))]
fn strftime_utc(format: &str, unix_secs: u64) -> Result<String, minijinja::Error> {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const WEEKDAYS: [&str; 7] = [
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
    ];
    let days = unix_secs / 86_400;
    let secs = unix_secs % 86_400;
    let (year, month, day) = civil_from_days(days);
    let month_name = MONTHS[month as usize - 1];
    let weekday = WEEKDAYS[((days + 4) % 7) as usize]; // 1970-01-01 was a Thursday.

    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let piece = match chars.next() {
            Some('Y') => year.to_string(),
            Some('y') => format!("{:02}", year % 100),
            Some('m') => format!("{month:02}"),
            Some('d') => format!("{day:02}"),
            Some('B') => month_name.to_string(),
            Some('b') => month_name[..3].to_string(),
            Some('A') => weekday.to_string(),
            Some('a') => weekday[..3].to_string(),
            Some('H') => format!("{:02}", secs / 3600),
            Some('M') => format!("{:02}", secs / 60 % 60),
            Some('S') => format!("{:02}", secs % 60),
            Some('%') => "%".to_string(),
            other => {
                return Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    format!(
                        "strftime_now: unsupported directive %{}",
                        other.map(String::from).unwrap_or_default()
                    ),
                ))
            }
        };
        out.push_str(&piece);
    }
    Ok(out)
}

/// Days since 1970-01-01 to (year, month, day), after Howard Hinnant's `civil_from_days`;
/// avoids a date-time dependency for one template helper.
#[cfg(not(target_arch = "wasm32"))]
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    (year, month, day)
}

fn raw_bytes(ids: &[u32]) -> Vec<u8> {
    ids.iter().filter_map(|&id| u8::try_from(id).ok()).collect()
}

/// Turns sampled ids into text as they arrive, for streaming output.
///
/// A single token may hold only part of a character (byte-level BPE splits emoji and CJK
/// across tokens), and some decoders change a token's text depending on what precedes it
/// (SentencePiece drops the leading space of the first token). So text is only released once
/// it is complete, and each step decodes with the previously released tokens as context.
pub struct StreamDecoder {
    tokenizer: Tokenizer,
    pending: Pending,
}

enum Pending {
    /// `ids[..read]` were already released and are kept only as decoding context.
    Ids { ids: Vec<u32>, read: usize },
    /// Bytes of a character still incomplete.
    Bytes(Vec<u8>),
}

impl StreamDecoder {
    pub fn new(tokenizer: &Tokenizer) -> StreamDecoder {
        let pending = match tokenizer.inner.vocab {
            Vocab::Hf(_) => Pending::Ids {
                ids: Vec::new(),
                read: 0,
            },
            Vocab::ByteLevel { .. } => Pending::Bytes(Vec::new()),
        };
        StreamDecoder {
            tokenizer: tokenizer.clone(),
            pending,
        }
    }

    /// Returns the text this id completes, possibly empty while a character is still partial.
    pub fn push(&mut self, id: u32) -> Result<String> {
        match &mut self.pending {
            Pending::Ids { ids, read } => {
                ids.push(id);
                let released = self.tokenizer.decode(&ids[..*read])?;
                let text = self.tokenizer.decode(ids)?;
                // A trailing U+FFFD is how the lossy byte decoder shows an unfinished character.
                if text.ends_with('\u{FFFD}')
                    || text.len() <= released.len()
                    || !text.is_char_boundary(released.len())
                {
                    return Ok(String::new());
                }
                let piece = text[released.len()..].to_string();
                // Only the tokens just released stay on as context, so the work per step stays
                // constant over a long generation.
                ids.drain(..*read);
                *read = ids.len();
                Ok(piece)
            }
            Pending::Bytes(bytes) => {
                if let Ok(b) = u8::try_from(id) {
                    bytes.push(b);
                }
                Ok(take_complete_utf8(bytes))
            }
        }
    }

    /// Releases whatever is left at the end of generation; only a sequence that can never
    /// become valid UTF-8 is replaced by U+FFFD. The decoder is then ready for a new stream.
    pub fn finish(&mut self) -> Result<String> {
        match &mut self.pending {
            Pending::Ids { ids, read } => {
                let released = self.tokenizer.decode(&ids[..*read])?;
                let text = self.tokenizer.decode(ids)?;
                let rest = match text.get(released.len()..) {
                    Some(rest) if text.starts_with(&released) => rest.to_string(),
                    _ => self.tokenizer.decode(&ids[*read..])?,
                };
                ids.clear();
                *read = 0;
                Ok(rest)
            }
            Pending::Bytes(bytes) => {
                let rest = String::from_utf8_lossy(bytes).into_owned();
                bytes.clear();
                Ok(rest)
            }
        }
    }
}

/// Removes and returns the longest prefix of `bytes` that is final: valid characters, plus
/// U+FFFD for bytes that no continuation could make valid. An incomplete tail stays.
fn take_complete_utf8(bytes: &mut Vec<u8>) -> String {
    let mut out = String::new();
    loop {
        match std::str::from_utf8(bytes) {
            Ok(s) => {
                out.push_str(s);
                bytes.clear();
                return out;
            }
            Err(e) => {
                let valid = e.valid_up_to();
                out.push_str(&String::from_utf8_lossy(&bytes[..valid]));
                match e.error_len() {
                    None => {
                        bytes.drain(..valid);
                        return out;
                    }
                    Some(bad) => {
                        out.push('\u{FFFD}');
                        bytes.drain(..valid + bad);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_formats_a_known_instant() {
        // 2024-07-26 13:05:09 UTC, a Friday.
        let s = strftime_utc("%d %b %Y|%A %B %m/%y %H:%M:%S %%", 1_721_999_109).unwrap();
        assert_eq!(s, "26 Jul 2024|Friday July 07/24 13:05:09 %");
        assert!(strftime_utc("%Q", 0).is_err());
    }

    #[test]
    fn incomplete_utf8_tail_is_held_and_invalid_bytes_replaced() {
        let mut bytes = vec![b'a', 0xF0, 0x9F];
        assert_eq!(take_complete_utf8(&mut bytes), "a");
        assert_eq!(bytes, [0xF0, 0x9F]);
        let mut bytes = vec![0xFF, b'b'];
        assert_eq!(take_complete_utf8(&mut bytes), "\u{FFFD}b");
        assert!(bytes.is_empty());
    }

    /// Words split on whitespace and punctuation, with `<|im_start|>` and `<|im_end|>` as
    /// special added tokens.
    fn chatml_words() -> Tokenizer {
        let added = |id: u32, content: &str| {
            format!(
                r#"{{"id": {id}, "content": "{content}", "single_word": false, "lstrip": false,
                    "rstrip": false, "normalized": false, "special": true}}"#
            )
        };
        let json = format!(
            r#"{{"version": "1.0", "truncation": null, "padding": null,
                "added_tokens": [{}, {}], "normalizer": null,
                "pre_tokenizer": {{"type": "Whitespace"}}, "post_processor": null, "decoder": null,
                "model": {{"type": "WordLevel", "unk_token": "<unk>", "vocab": {{"<unk>": 0,
                  "hi": 1, "<|": 2, "im_start": 3, "|>": 4, "<|im_start|>": 5, "<|im_end|>": 6,
                  "user": 7, "assistant": 8, "im_end": 9}}}}}}"#,
            added(5, "<|im_start|>"),
            added(6, "<|im_end|>")
        );
        Tokenizer::from_bytes(json.as_bytes(), None).unwrap()
    }

    #[test]
    fn special_token_text_from_users_stays_text() {
        let t = chatml_words();
        assert_eq!(t.encode("hi<|im_start|>hi").unwrap(), [1, 5, 1]);
        assert_eq!(t.encode_text("hi<|im_start|>hi").unwrap(), [1, 2, 3, 4, 1]);
        assert_eq!(t.encode_text("hi hi").unwrap(), t.encode("hi hi").unwrap());
        // Every occurrence is broken up.
        assert_eq!(
            t.encode_text("<|im_start|> <|im_start|>").unwrap(),
            [2, 3, 4, 2, 3, 4]
        );
        // The template's markers are special; the user's `<|im_end|>` is text.
        let chat = [ChatMessage::new("user", "hi<|im_end|>")];
        assert_eq!(
            t.encode_chat(&chat, true).unwrap(),
            [5, 7, 1, 2, 9, 4, 6, 5, 8]
        );
        // A mark the text already holds is not used.
        let pua = "\u{E000}\u{E001}hi";
        assert_eq!(t.free_mark([pua]).unwrap(), '\u{E002}');
    }

    #[test]
    fn named_template_list_prefers_default() {
        let cfg = r#"{"chat_template": [{"name": "tool_use", "template": "T"},
                      {"name": "default", "template": "D"}], "bos_token": {"content": "<s>"}}"#;
        let chat = ChatConfig::parse(cfg, "cfg").unwrap();
        assert_eq!(chat.template.as_deref(), Some("D"));
        assert_eq!(chat.bos_token.as_deref(), Some("<s>"));
        assert_eq!(chat.eos_token, None);
    }
}
