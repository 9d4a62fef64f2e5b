//! Any bytes a peer sends must decode to a message or an error, never a panic or a huge
//! allocation. Run: `cd engine-core && cargo +nightly fuzz run decode_frame` (see docs/PROTOCOL.md).
#![no_main]

use engine_core::protocol::{decode, encode};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok((req, msg)) = decode(data, 1 << 24) {
        // What decodes must encode back to a frame that decodes again (tensor values may be
        // NaN, so the messages themselves are not compared).
        let again = encode(req, &msg);
        assert!(decode(&again, 1 << 24).is_ok());
    }
});
