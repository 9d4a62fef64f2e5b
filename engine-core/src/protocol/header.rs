//! The fixed 16-byte frame header. Every frame is one WebSocket binary message:
//!
//! ```text
//! offset  size  field
//! 0       2     magic "TH"
//! 2       1     protocol version (PROTOCOL_VERSION)
//! 3       1     message type (MsgType)
//! 4       4     request id, u32 LE (matches a reply to its request)
//! 8       4     metadata length in bytes, u32 LE (UTF-8 JSON)
//! 12      4     tensor data length in bytes, u32 LE (raw little-endian tensors)
//! 16      ...   metadata, then tensor data
//! ```
//! The lengths are read and checked against the agreed frame limit before anything else is
//! looked at, so a peer cannot make us allocate by announcing a size.

pub const MAGIC: [u8; 2] = *b"TH";
pub const PROTOCOL_VERSION: u8 = 2;
pub const HEADER_LEN: usize = 16;

macro_rules! msg_types {
    ($($name:ident = $code:literal, $doc:literal;)*) => {
        /// What a frame carries. The code is the header's byte 3.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum MsgType {
            $(#[doc = $doc] $name = $code,)*
        }

        impl MsgType {
            pub const ALL: &'static [MsgType] = &[$(MsgType::$name),*];

            pub fn from_code(code: u8) -> Option<MsgType> {
                match code {
                    $($code => Some(MsgType::$name),)*
                    _ => None,
                }
            }

            /// A stable name, used as the key of per-type byte counts.
            pub fn name(self) -> &'static str {
                match self {
                    $(MsgType::$name => stringify!($name),)*
                }
            }
        }
    };
}

msg_types! {
    Hello = 1, "Either side's introduction: version, model name and digest, role, memory, backends, frame limit.";
    Welcome = 2, "The helper accepts a host's Hello.";
    Configure = 3, "The host assigns layers and page geometry to the helper.";
    PrefillChunk = 4, "Residual rows entering the helper's layers for one ubatch.";
    ChunkState = 5, "New KV rows of the helper's full layers (and DeltaNet state at batch end).";
    KvAppend = 6, "KV rows the helper keeps for a layer.";
    KvTruncate = 7, "Drop positions at and after a length (a rewind).";
    KvFetch = 8, "Ask for KV rows back.";
    KvRows = 9, "KV rows, answering KvFetch.";
    AttnQuery = 10, "A decode step's queries for one full-attention layer.";
    AttnPartials = 11, "Per-page (o, m, l) partials answering AttnQuery.";
    Stats = 12, "Counters of a peer.";
    Ping = 13, "Liveness probe.";
    Pong = 14, "Answer to Ping.";
    Ack = 15, "A request without a payload answer completed.";
    Error = 16, "A request failed; the message says why.";
    Bye = 17, "Orderly close.";
}

/// The message type of an encoded frame, if its header is well formed. Links use this to
/// count bytes by type without decoding the payload.
pub fn peek_type(frame: &[u8]) -> Option<MsgType> {
    if frame.len() < HEADER_LEN || frame[..2] != MAGIC {
        return None;
    }
    MsgType::from_code(frame[3])
}
