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
/// 3: KV rows travel in their page's type, `Configure` carries the cache types.
pub const PROTOCOL_VERSION: u8 = 3;
pub const HEADER_LEN: usize = 16;

/// The message types are described with the messages (`message.rs`).
pub use super::message::MsgType;

/// The message type of an encoded frame, if its header is well formed. Links use this to
/// count bytes by type without decoding the payload.
pub fn peek_type(frame: &[u8]) -> Option<MsgType> {
    if frame.len() < HEADER_LEN || frame[..2] != MAGIC {
        return None;
    }
    MsgType::from_code(frame[3])
}
