//! Pooled device buffers. Creating a buffer (and binding it the first time) is expensive on
//! every GPU API, and a forward pass makes and drops dozens of activations per layer, so freed
//! buffers go back to a free list keyed by size class and are handed out again.
//!
//! Safety of reuse: a [`Pooled`] buffer returns to the pool only when its last owner drops it,
//! and the recording batch owns a reference to every buffer it binds until it is submitted
//! (`Gpu::flush`). Anything done with a recycled buffer afterwards (an upload, a new dispatch)
//! is ordered after that submission on the one queue.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::device::Buffer;

/// Buffers at most this large are rounded up to a power of two; larger ones to a multiple of
/// it, so big activations waste at most this much.
const POW2_UP_TO: u64 = 16 << 20;

/// Smallest buffer handed out (also covers the 4-byte minimum of a binding).
const MIN_BYTES: u64 = 256;

fn size_class(bytes: u64) -> u64 {
    let b = bytes.max(MIN_BYTES);
    if b <= POW2_UP_TO {
        b.next_power_of_two()
    } else {
        b.next_multiple_of(POW2_UP_TO)
    }
}

pub(super) struct BufferPool {
    /// Free buffers by size class.
    free: Mutex<HashMap<u64, Vec<Buffer>>>,
}

impl BufferPool {
    pub(super) fn new() -> Arc<BufferPool> {
        Arc::new(BufferPool {
            free: Mutex::new(HashMap::new()),
        })
    }

    /// A buffer of at least `bytes` (`make` makes one of the size class when none is free);
    /// its contents are whatever it held last.
    pub(super) fn take(self: &Arc<Self>, bytes: u64, make: impl FnOnce(u64) -> Buffer) -> Pooled {
        let size = size_class(bytes);
        let reused = self
            .free
            .lock()
            .expect("buffer pool lock")
            .get_mut(&size)
            .and_then(Vec::pop);
        Pooled {
            buffer: Some(reused.unwrap_or_else(|| make(size))),
            pool: self.clone(),
        }
    }
}

/// A buffer on loan from the pool; dropping it gives it back.
pub(super) struct Pooled {
    buffer: Option<Buffer>,
    pool: Arc<BufferPool>,
}

impl std::ops::Deref for Pooled {
    type Target = Buffer;
    fn deref(&self) -> &Buffer {
        self.buffer.as_ref().expect("a pooled buffer until dropped")
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        if let Some(b) = self.buffer.take() {
            if let Ok(mut free) = self.pool.free.lock() {
                free.entry(b.size()).or_default().push(b);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::size_class;

    #[test]
    fn size_classes() {
        assert_eq!(size_class(0), 256);
        assert_eq!(size_class(257), 512);
        assert_eq!(size_class(16 << 20), 16 << 20);
        assert_eq!(size_class((16 << 20) + 1), 32 << 20);
        assert_eq!(size_class((40 << 20) + 1), 48 << 20);
    }
}
