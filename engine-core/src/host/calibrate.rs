//! The quick calibration at connect: how fast the host and its prefill helper each run the
//! model's layers, so that the plan splits a prefill where the two pipeline stages take the
//! same time (`plan::Speeds::balanced_split`) instead of at DESIGN.md's fixed 5/8.
//!
//! Both sides run the same rows through layers: the host one 4-layer cycle on a scratch
//! state, the helper the prefill layers it was first configured with, as a prefill chunk of a
//! scratch sequence (so the measure includes its link and needs nothing a helper does not
//! already serve: a browser tab or a phone answers it as it answers a real chunk). Each side
//! runs twice and the faster run counts: the first also touches the weights. The caller then
//! configures the helper again with the balanced layers, which drops the scratch sequence.

use web_time::Instant;

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::host::plan::Speeds;
use crate::host::remote::HelperClient;
use crate::kv::NoPagesAway;
use crate::protocol::{Message, WireTensor};
use crate::Model;

/// Rows each side runs: enough that a layer's matrix products dominate its fixed costs, few
/// enough that a 27B-sized cycle takes well under a second on a laptop.
pub const ROWS: usize = 32;

/// The helper's scratch sequence: far from the host's own sequence ids.
const SCRATCH_SEQ: u64 = u64::MAX - 1;

/// Runs at each side; the fastest counts.
const RUNS: usize = 2;

/// The host's and `helper`'s speeds on `model` (the host computing on `be`); None if the
/// helper is configured with no whole cycle of prefill layers (nothing to balance).
pub fn measure(
    model: &Model,
    be: &dyn Backend,
    helper: &mut HelperClient,
) -> Result<Option<Speeds>> {
    let cycles = helper.prefill_layers.len() / 4;
    if cycles == 0 {
        return Ok(None);
    }
    let h = model.config.hidden_size;
    let rows = synthetic_rows(ROWS * h);
    let host = fastest(|| {
        let mut st = model.new_state(ROWS);
        let mut x = be.upload(rows.clone());
        let t = Instant::now();
        model.run_layers(be, &mut st, &mut NoPagesAway, &mut x, 0, 0..4, None)?;
        // The read-back waits for a device's queue.
        be.download(&x);
        Ok(t.elapsed().as_secs_f64())
    })?;
    let mut seq = SCRATCH_SEQ;
    let helper_s = fastest(|| {
        seq -= 1;
        let chunk = Message::PrefillChunk {
            seq,
            pos: 0,
            want_state: false,
            residual: WireTensor::f32(vec![ROWS, h], rows.clone()),
        };
        let t = Instant::now();
        match helper.request(chunk)? {
            Message::ChunkState { .. } => Ok(t.elapsed().as_secs_f64()),
            other => Err(Error::Remote(format!(
                "calibration chunk: expected ChunkState, got {:?}",
                other.msg_type()
            ))),
        }
    })?;
    Ok(Some(Speeds {
        rows: ROWS,
        host_cycle_s: host,
        helper_cycle_s: helper_s / cycles as f64,
    }))
}

/// The least of [`RUNS`] timings.
fn fastest(mut run: impl FnMut() -> Result<f64>) -> Result<f64> {
    (0..RUNS).try_fold(f64::INFINITY, |best, _| Ok(best.min(run()?)))
}

/// Residual-like rows: deterministic values spread over [-1, 1) (the layers normalise their
/// input, so only the work matters, not the values).
fn synthetic_rows(len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| ((i as u64).wrapping_mul(2_654_435_761) % 2000) as f32 / 1000.0 - 1.0)
        .collect()
}
