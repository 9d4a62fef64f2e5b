//! What the server may take of this machine's memory. The context is sized to the memory free
//! at start, by the plan's rule, rather than to the model's maximum (262144 positions for
//! Qwen3.5, whose KV alone would take 6 GiB on the 0.8B model), and the queue is bounded by
//! the bytes its requests hold rather than by their number.

use std::mem::size_of;

use anyhow::{bail, Result};
pub use engine_core::host::plan::{Footprint, Room};

/// The share of the available memory the queue may hold by default (one sixteenth).
const QUEUE_SHARE: u64 = 16;

/// The queue's budget where the available memory is unknown.
const QUEUE_FALLBACK: u64 = 256 << 20;

/// Memory the system can give now without swapping (see
/// [`engine_core::resident::available_memory`]).
pub use engine_core::resident::available_memory as available;

pub fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
}

/// How the context was chosen, for the log and `/health`.
pub struct ContextChoice {
    pub tokens: usize,
    /// Positions whose KV fits on this host in whole pages (unknown: `None`); with a helper,
    /// the host keeps at most these and the older pages move to the helper.
    pub on_host: Option<usize>,
    /// Positions of the context the helpers hold: what their offers have room for, in whole
    /// pages, at most the context (a helper with gigabytes to offer holds no more than the
    /// model's positions).
    pub on_helper: usize,
    pub footprint: Footprint,
    /// Set when `--ctx-size` asked for more than fits: what to warn about.
    pub warning: Option<String>,
}

/// The context to serve: `asked` (`--ctx-size`), or the whole pages of `page_size` the plan's
/// `room` says fit (`tether plan`'s "context that fits": the host's free memory less the
/// weights, states, checkpoints, activations and an eighth for the rest of the machine, plus
/// what the helpers' offers hold); never more than the model's `max` positions. `available`
/// is the free memory the plan was made for, for the messages.
pub fn choose_context(
    asked: Option<usize>,
    room: Option<Room>,
    (fp, page_size): (Footprint, usize),
    max: usize,
    available: Option<u64>,
) -> Result<ContextChoice> {
    let pages = |n: usize| n / page_size.max(1) * page_size;
    let on_host = room.map(|r| pages(r.host));
    let fits = room.map(|r| pages(r.with_helpers.unwrap_or(r.host)));
    let with_helper = room.is_some_and(|r| r.with_helpers.is_some());
    let free = || gib(available.unwrap_or_default());
    let (tokens, warning) = match (asked, fits) {
        (Some(n), _) if n == 0 || n > max => {
            bail!("--ctx-size {n}: must be between 1 and the model's {max} positions")
        }
        (Some(n), Some(fits)) if n > fits => {
            let why = format!(
                "--ctx-size {n}: its KV and state take {} ({} bytes per token), more than fits beside the weights in the {} available{} ({fits} tokens would fit); the server may swap or be killed",
                gib(fp.bytes(n, page_size)),
                fp.per_token,
                free(),
                if with_helper { " and the helpers' offers" } else { "" }
            );
            (n, Some(why))
        }
        (Some(n), _) => (n, None),
        (None, Some(0)) => bail!(
            "not even one KV page of {page_size} positions ({}) fits beside the weights in the {} available: free some memory, or pass a smaller --page-size or --ctx-size",
            gib(fp.bytes(1, page_size) - fp.fixed),
            free()
        ),
        (None, Some(fits)) => (fits.min(max), None),
        (None, None) => (
            max,
            Some(format!(
                "the free memory is unknown on this system: the context is the model's maximum, {max} tokens ({}); pass --ctx-size or --host-memory to fit this machine",
                gib(fp.bytes(max, page_size))
            )),
        ),
    };
    let on_helper = room.and_then(|r| r.on_helpers).map_or(0, pages).min(tokens);
    Ok(ContextChoice {
        tokens,
        on_host,
        on_helper,
        footprint: fp,
        warning,
    })
}

/// The queue's byte budget by default: a sixteenth of the available memory.
pub fn queue_budget(available: Option<u64>) -> u64 {
    available.map_or(QUEUE_FALLBACK, |a| a / QUEUE_SHARE)
}

/// Bytes a request waiting in the queue counts as holding: its body, and its token ids (4
/// bytes each), as many as a whole context of `ctx` positions.
pub fn request_bytes(body: usize, ctx: usize) -> u64 {
    (body + ctx * size_of::<u32>()) as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use engine_core::backend::{CacheTypes, KvType};
    use engine_core::synth::preset;
    use engine_core::{CpuBackend, Logits, State};

    /// The tiny256 preset: 4 layers, L L L F, so 1 full-attention layer of 2 KV heads of 64
    /// dimensions: (K and V) x a row of 128 values a position: 1024 bytes in f32, 512 in f16,
    /// 272 in q8_0 (four 34-byte blocks a row), 144 in q4_0 (four of 18 bytes).
    #[test]
    fn the_footprint_is_what_a_state_holds_at_every_cache_type() {
        let c = preset("tiny256").unwrap();
        let model = engine_core::source::load_model("tiny256", &Default::default()).unwrap();
        for (ty, bytes) in KvType::ALL.into_iter().zip([1024, 512, 272, 144]) {
            let types = CacheTypes { k: ty, v: ty };
            let fp = Footprint::of(&c, types, 4);
            assert_eq!(fp.per_token, bytes, "{}", ty.name());
            // What a real sequence holds after a forward pass of 3 positions.
            let mut state = State::typed(&c, 16, types).unwrap();
            model
                .forward(&CpuBackend, &mut state, &[1, 2, 3], Logits::Last, None)
                .unwrap();
            assert_eq!(state.kv_bytes() as u64, 3 * fp.per_token);
            // The live state, the origin and 4 checkpoints, each checkpoint with 1024 logits.
            assert_eq!(fp.fixed, 6 * state.delta_bytes() as u64 + 4 * 1024 * 4);
        }
    }

    fn fp() -> Footprint {
        Footprint {
            per_token: 512,
            types: CacheTypes::F32,
            fixed: 1000,
        }
    }

    #[test]
    fn the_context_is_the_whole_pages_the_plan_says_fit() {
        let fp = fp();
        assert_eq!(fp.bytes(17, 16), 1000 + 32 * 512);
        let alone = |host| Room {
            host,
            with_helpers: None,
            on_helpers: None,
        };
        let ctx = |asked, room| choose_context(asked, room, (fp, 16), 4096, Some(1 << 30));
        // 3 pages of 16 positions and a bit.
        let c = ctx(None, Some(alone(50))).unwrap();
        assert_eq!(
            (c.tokens, c.on_host, c.warning.is_none()),
            (48, Some(48), true)
        );
        // Capped at the model's maximum.
        assert_eq!(ctx(None, Some(alone(1 << 40))).unwrap().tokens, 4096);
        // Asking for more than fits is served, with a warning naming the numbers.
        let c = ctx(Some(64), Some(alone(50))).unwrap();
        assert_eq!(c.tokens, 64);
        let w = c.warning.unwrap();
        assert!(
            w.contains("512 bytes per token") && w.contains("48 tokens would fit"),
            "{w}"
        );
        assert!(ctx(Some(5000), Some(alone(1 << 40))).is_err());
        let e = ctx(None, Some(alone(15))).err().unwrap().to_string();
        assert!(e.contains("not even one KV page of 16 positions"), "{e}");
        // Unknown free memory: the model's maximum, with a warning.
        let c = ctx(None, None).unwrap();
        assert_eq!((c.tokens, c.warning.is_some()), (4096, true));
    }

    #[test]
    fn a_helper_adds_the_positions_it_holds_to_the_context() {
        // The helpers' offers hold 160 positions by themselves.
        let room = |host, all| {
            Some(Room {
                host,
                with_helpers: Some(all),
                on_helpers: Some(all.min(160)),
            })
        };
        let ctx = |asked, room| choose_context(asked, room, (fp(), 16), 4096, Some(1 << 30));
        let c = ctx(None, room(50, 210)).unwrap();
        assert_eq!((c.tokens, c.on_host, c.on_helper), (208, Some(48), 160));
        // What fits with the helper is served without a warning; past it, warned.
        assert!(ctx(Some(200), room(50, 210)).unwrap().warning.is_none());
        let w = ctx(Some(300), room(50, 210)).unwrap().warning.unwrap();
        assert!(
            w.contains("the helpers' offers") && w.contains("208 tokens"),
            "{w}"
        );
        // Even a host with no room for a page serves what the helper holds.
        let c = ctx(None, room(10, 40)).unwrap();
        assert_eq!((c.tokens, c.on_host, c.on_helper), (32, Some(0), 32));
        // Where the host holds most of it, the helper still holds what its offer has room for.
        let c = ctx(None, room(4000, 4100)).unwrap();
        assert_eq!((c.tokens, c.on_helper), (4096, 160));
        // A helper with room for more than the context holds the context, no more.
        let big = Some(Room {
            host: 50,
            with_helpers: Some(1 << 23),
            on_helpers: Some(1 << 23),
        });
        let c = ctx(None, big).unwrap();
        assert_eq!((c.tokens, c.on_helper), (4096, 4096));
        let c = ctx(Some(100), big).unwrap();
        assert_eq!((c.tokens, c.on_helper), (100, 100));
    }
}
