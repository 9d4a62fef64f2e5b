//! The wire protocol between a host and a helper: pure (bytes in, typed messages out), so it
//! runs in the browser and can be fuzzed. See docs/PROTOCOL.md.

pub mod header;
pub mod message;
pub mod tensor;

pub use header::{peek_type, MsgType, HEADER_LEN, MAGIC, PROTOCOL_VERSION};
pub use message::{decode, device_kind, encode, Configure, Intro, Message, ProtocolError, Role};
pub use tensor::{TensorDesc, WireTensor};
