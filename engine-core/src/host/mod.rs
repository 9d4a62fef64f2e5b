//! The host's distribution of a sequence: which helpers hold which of its KV pages, the page
//! file behind them, the split of prefill between host and helper, and the plan that decides
//! all of it. `model`, `kv` and `backend` know nothing of links: a sequence's [`crate::State`]
//! holds its pages, recurrent states and position, and attention asks this module's placement
//! for the partials of the pages that left this device.

pub mod calibrate;
pub mod page_file;
pub mod plan;
pub mod remote;
pub mod split;
pub mod telemetry;
