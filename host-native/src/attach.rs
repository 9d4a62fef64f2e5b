//! The host's side of its helpers (`--helper ws://ADDR`, `--accept-helpers`): connect, pair,
//! plan their part and attach them to a sequence.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use engine_core::backend::CacheTypes;
use engine_core::host::calibrate;
use engine_core::host::page_file::PageFile;
use engine_core::host::plan::{Plan, PlanInput, Speeds, WeightBytes};
use engine_core::host::remote::{HelperClient, DEFAULT_MAX_FRAME};
use engine_core::host::split::SplitPlan;
use engine_core::host::Sequence;
use engine_core::identity::cache_dir;
use engine_core::link::doors::{self, DialOptions};
use engine_core::link::keys::{config_dir, KeyStore};
use engine_core::link::secure::{wire_limit, SecureLink};
use engine_core::link::ws::{self, WsLink};
use engine_core::link::{Link, LinkProfile, LinkStats, ShapedLink, StatsHandle};
use engine_core::protocol::Intro;
use engine_core::source::LoadOptions;
use engine_core::{Backend, Model, ModelConfig};

use crate::accept::Acceptor;
use crate::lend::{Lent, LentSlot};

#[derive(clap::Args, Clone, Debug)]
pub struct HelperArgs {
    /// A running `tether-helper` to hold KV pages: ws://HOST:PORT. Repeat it for several
    /// helpers: the pages that leave this host spread over all of them, and the first also
    /// runs the tail layers of a split prefill.
    #[arg(long)]
    helper: Vec<String>,
    /// Take helpers that dial this host (`tether-helper --join ws://ADDR`, or a browser tab)
    /// instead of dialing them: listen on ADDR (e.g. 0.0.0.0:7342; loopback is
    /// 127.0.0.1:7342). `tether serve` given no ADDR takes them on its own port at /helper.
    /// The host shows a pairing code for new helpers.
    #[arg(long, value_name = "ADDR", num_args = 0..=1, default_missing_value = "")]
    accept_helpers: Option<String>,
    /// With --accept-helpers: how many helpers to wait for before the first request (a server
    /// takes more as they join).
    #[arg(
        long,
        value_name = "N",
        default_value_t = 1,
        requires = "accept_helpers"
    )]
    wait_helpers: usize,
    /// With --accept-helpers: how long to wait for them, in seconds.
    #[arg(long, value_name = "SECS", default_value_t = 300)]
    helper_wait: u64,
    /// With --accept-helpers: keep pairing open for more new helpers after one pairs.
    #[arg(long, requires = "accept_helpers")]
    pair_new: bool,
    /// Where helpers join, once --accept-helpers has started listening (shared by clones, so
    /// a server's reconnects take the next helper from the same socket).
    #[arg(skip)]
    acceptor: Arc<OnceLock<Acceptor>>,
    /// The model lent to browser tabs that join (their weights over HTTP), once loaded.
    #[arg(skip)]
    lent: LentSlot,
    /// KV positions per full-attention layer kept on this host; older whole pages move to the
    /// helper (default: what fits in this host's free memory beside the weights, state and
    /// activations, by the plan).
    #[arg(long)]
    host_kv_tokens: Option<usize>,
    /// The memory the plan may use on this host, e.g. 24G (default: what the system says is
    /// available now); `tether plan` with it plans for another machine.
    #[arg(long, value_name = "SIZE", value_parser = engine_core::host::plan::parse_size)]
    host_memory: Option<u64>,
    /// The available memory, read once so that every plan of the session sees the same.
    #[arg(skip)]
    measured_memory: Arc<OnceLock<Option<u64>>>,
    /// Shape the link to the helper like a real one (usb-c-10g, usb2, wifi) or leave it
    /// (unlimited); bytes are counted by message type either way.
    #[arg(long, default_value = "unlimited")]
    link: String,
    /// Largest frame, in bytes.
    #[arg(long, default_value_t = DEFAULT_MAX_FRAME)]
    max_frame: usize,
    /// First layer the helper runs in a split prefill (a multiple of 4); by default the plan
    /// measures the helper's speed against this host's when it connects and gives it the
    /// layers that balance the two (without --no-calibrate), fewer if its memory offer cannot
    /// mirror their KV; the model's layer count disables the split.
    #[arg(long)]
    split_layer: Option<usize>,
    /// Do not measure the prefill helper's speed when it connects (a 32-row prefill on each
    /// side, run twice): give it DESIGN.md's share of the layers, the last ~3/8, or fewer if
    /// its offer cannot mirror them. The split then depends on nothing measured.
    #[arg(long)]
    no_calibrate: bool,
    /// Prompts of at most this many tokens prefill on the host alone.
    #[arg(long, default_value_t = 512)]
    split_min: usize,
    /// Tokens per ubatch of a split prefill (default: the plan's, 256).
    #[arg(long)]
    split_ubatch: Option<usize>,
    /// From this position on, prefill ubatches run in staggered pairs: the host runs one while
    /// the helper attends the other's queries over the old KV pages it holds.
    #[arg(long, default_value_t = 65536)]
    interleave_from: usize,
    /// The pairing code the helper shows: pairs with it on the first connection and remembers
    /// its key (later runs need no code).
    #[arg(long, requires = "helper")]
    pair: Option<String>,
    /// A plain link to a helper started with --insecure: no pairing, no encryption.
    #[arg(long)]
    insecure: bool,
    /// The disk tier: every KV page that leaves for the helper is also written to a page file
    /// here (append-only, checksummed, removed with the sequence), so a helper lost mid-decode
    /// costs time, not tokens. Default: `pages` in tether's cache directory
    /// ($TETHER_CACHE_DIR, else the platform's).
    #[arg(long, value_name = "DIR")]
    spill_dir: Option<std::path::PathBuf>,
}

/// What a command fixed before planning: its flags (`--page-size`, and `--ubatch` for a
/// prefill on the host alone) or what a server already chose (its host KV budget, the split
/// its prefill helper was configured with); `None`: the plan decides.
#[derive(Clone, Copy, Debug, Default)]
pub struct Fixed {
    pub page_size: Option<usize>,
    pub ubatch: Option<usize>,
    pub host_kv_tokens: Option<usize>,
    pub split_layer: Option<usize>,
    /// The KV pages' types (`--cache-type-k/-v`, or the sequence's): every caller sets them.
    pub kv_types: CacheTypes,
    /// `serve`'s conversation checkpoints (`--checkpoints`), which take host memory too.
    pub checkpoints: Option<usize>,
}

/// Where a helper comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    /// `--helper URL`: dialed.
    Dial(String),
    /// `--accept-helpers`: it dialed this host.
    Joined,
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::Dial(url) => write!(f, "the helper at {url}"),
            Source::Joined => write!(f, "a helper that joined"),
        }
    }
}

/// A helper attached to a sequence: its id there, where it came from, its link's traffic, and
/// its link's round trip when it attached (in ms; `None` if a ping failed).
#[derive(Clone)]
pub struct Attached {
    pub id: u32,
    pub source: Source,
    pub stats: StatsHandle,
    pub rtt_ms: Option<f64>,
}

/// Pings timed when a helper attaches; the least counts.
const PINGS: usize = 3;

impl Attached {
    /// Helper `id` of `seq`, just attached from `source`, its link's round trip measured
    /// now: the least of [`PINGS`] pings (the link's latency with the helper's least work).
    pub fn measured(seq: &mut Sequence, id: u32, source: Source, stats: StatsHandle) -> Attached {
        let rtt_ms = seq
            .placement
            .helpers
            .iter_mut()
            .find(|h| h.id == id)
            .and_then(|client| {
                (0..PINGS)
                    .map(|_| {
                        let t = std::time::Instant::now();
                        client.ping().ok().map(|()| t.elapsed().as_secs_f64() * 1e3)
                    })
                    .collect::<Option<Vec<f64>>>()?
                    .into_iter()
                    .reduce(f64::min)
            });
        Attached {
            id,
            source,
            stats,
            rtt_ms,
        }
    }
}

impl HelperArgs {
    /// Connect every helper named (and wait for --wait-helpers to join) and attach them to
    /// `state`, the first as the prefill helper (its speed measured against the host's on
    /// `be`), for a `context`-token context.
    pub fn attach(
        &self,
        model: &Model,
        be: &dyn Backend,
        seq: &mut Sequence,
        page_size: usize,
        context: usize,
    ) -> Result<Vec<Attached>> {
        if !self.has_helper() {
            if self.host_kv_tokens.is_some() {
                bail!(
                    "--host-kv-tokens needs --helper or --accept-helpers: there is nowhere to \
                     move pages to"
                );
            }
            return Ok(Vec::new());
        }
        if self.pair.is_some() && self.helper.len() > 1 {
            bail!(
                "--pair with several --helper: pair each helper once with `tether pair URL CODE`, \
                 then name them all"
            );
        }
        let joining = std::iter::repeat_n(Source::Joined, self.joining());
        let sources = self.helper.iter().cloned().map(Source::Dial).chain(joining);
        sources
            .map(|source| self.attach_from(model, be, seq, (page_size, context), source))
            .collect()
    }

    /// Helpers to wait for before the model's session starts: none without --accept-helpers,
    /// and none on `tether serve`'s own port, which listens only once the session is ready
    /// (its first request waits for them instead: [`Self::waits_on_port`]).
    fn joining(&self) -> usize {
        match self.accept_helpers.as_deref() {
            Some("") | None => 0,
            Some(_) => self.wait_helpers,
        }
    }

    /// Helpers `tether serve`'s first request waits for, when they join on its own port.
    pub fn waits_on_port(&self) -> (usize, Duration) {
        let n = match self.accept_helpers.as_deref() {
            Some("") => self.wait_helpers,
            _ => 0,
        };
        (n, Duration::from_secs(self.helper_wait))
    }

    /// `tether serve` with --accept-helpers and no address: where the doors for helpers
    /// that dial its /helper will be, for its route to hand their WebSockets to (filled by
    /// [`Self::open_on_port`] once the server knows its address).
    pub fn port_doors(&self) -> Option<Arc<OnceLock<Acceptor>>> {
        (self.accept_helpers.as_deref() == Some("")).then(|| self.acceptor.clone())
    }

    /// Open the doors of [`Self::port_doors`] for helpers dialing `url`.
    pub fn open_on_port(&self, url: &str) -> Result<()> {
        if self.port_doors().is_some() && self.acceptor.get().is_none() {
            let a = Acceptor::new(url, self.insecure, self.pair_new, self.lent.clone())?;
            let _ = self.acceptor.set(a);
        }
        Ok(())
    }

    /// Connect the helper from `source` (a joining one within --helper-wait) and attach it to
    /// `state` with its `(page_size, context)`.
    pub fn attach_from(
        &self,
        model: &Model,
        be: &dyn Backend,
        seq: &mut Sequence,
        shape: (usize, usize),
        source: Source,
    ) -> Result<Attached> {
        let stats = StatsHandle::default();
        let wait = Duration::from_secs(self.helper_wait);
        let link = self.connect(&source, &stats, wait)?;
        let id = self.attach_link(model, be, seq, shape, link, &source)?;
        Ok(Attached::measured(seq, id, source, stats))
    }

    /// The link to the helper from `source`, counting into `stats`: the part of attaching
    /// that may wait on the network (up to the connect and handshake timeouts, or `wait` for
    /// a helper to join), so a server can do it on a thread of its own.
    pub fn connect(
        &self,
        source: &Source,
        stats: &StatsHandle,
        wait: Duration,
    ) -> Result<Box<dyn Link>> {
        let profile = link_profile(&self.link)?;
        let link: Box<dyn Link> = match source {
            Source::Dial(url) => Box::new(
                self.secure(url)
                    .with_context(|| format!("connecting to the helper at {url}"))?,
            ),
            Source::Joined => self.acceptor()?.next(wait)?,
        };
        Ok(Box::new(
            ShapedLink::new(link, profile).counting_into(stats.clone()),
        ))
    }

    /// The link's bandwidth each way in bits per second, where `--link` names a profile that
    /// limits it (the live page shows link rates against it); a real link's is not known.
    pub fn link_capacity_bps(&self) -> Option<f64> {
        link_profile(&self.link)
            .ok()
            .map(|p| p.bandwidth_bps)
            .filter(|b| b.is_finite())
    }

    /// Whether a helper is named (--helper) or taken when it joins (--accept-helpers).
    pub fn has_helper(&self) -> bool {
        !self.helper.is_empty() || self.accept_helpers.is_some()
    }

    /// The helpers the server reconnects to when lost, and whether it takes helpers that join.
    pub fn sources(&self) -> (Vec<Source>, bool) {
        let dialed = self.helper.iter().cloned().map(Source::Dial).collect();
        (dialed, self.accept_helpers.is_some())
    }

    /// Start listening for helpers now (so a helper may join while the model loads); a no-op
    /// without --accept-helpers, or for helpers dialing the server's own port (`own_port`,
    /// which opens with the server).
    pub fn listen(&self, own_port: bool) -> Result<()> {
        match self.accept_helpers.as_deref() {
            None => Ok(()),
            Some("") if own_port => Ok(()),
            Some(_) => self.acceptor().map(|_| ()),
        }
    }

    /// Lend `model` (`--model spec`) to browser tabs that join: with --accept-helpers, the
    /// port they join serves its weights to paired tabs.
    pub fn lend(&self, spec: &str, synth: &LoadOptions, model: &Model) {
        if self.accept_helpers.is_some() {
            let _ = self.lent.set(Lent::new(spec, synth, model));
        }
    }

    pub fn max_frame(&self) -> usize {
        self.max_frame
    }

    /// The listener of --accept-helpers, started on first use.
    fn acceptor(&self) -> Result<&Acceptor> {
        if let Some(a) = self.acceptor.get() {
            return Ok(a);
        }
        let addr = match self.accept_helpers.as_deref() {
            None => bail!("no --accept-helpers"),
            Some("") => bail!(
                "--accept-helpers needs an address here (ADDR, e.g. 127.0.0.1:7342); only \
                 `tether serve` takes helpers on its own port"
            ),
            Some(addr) => addr,
        };
        let a = Acceptor::start(
            addr,
            self.max_frame,
            self.insecure,
            self.pair_new,
            self.lent.clone(),
        )?;
        // Only this session's thread starts it; a lost race keeps the first.
        Ok(self.acceptor.get_or_init(|| a))
    }

    /// The paired, encrypted link to the helper at `url` (plain with --insecure).
    fn secure(&self, url: &str) -> Result<SecureLink<WsLink>> {
        let opts = DialOptions {
            role: "host",
            peer: "helper",
            insecure: self.insecure,
            pair: self.pair.as_deref(),
            max_frame: self.max_frame,
        };
        Ok(doors::dial(url, &opts)?)
    }

    /// Configure the helper at the other end of `link` and attach it to `state` (pages of
    /// `page_size`, a `context`-token context): it runs the tail layers of a split prefill if
    /// no helper of `state` does yet (as many as its offer can hold, then, unless
    /// --split-layer is given, as many as balance its measured speed against the host's on
    /// `be`), else it holds pages only. Returns its id in `state`.
    pub fn attach_link(
        &self,
        model: &Model,
        be: &dyn Backend,
        seq: &mut Sequence,
        (page_size, context): (usize, usize),
        link: Box<dyn Link>,
        source: &Source,
    ) -> Result<u32> {
        let n = model.config.num_hidden_layers;
        if let Some(split) = self.split_layer {
            if split > n || (!split.is_multiple_of(4) && split != n) {
                bail!("--split-layer {split}: must be a multiple of 4 (a whole L L L F cycle) and at most {n}");
            }
        }
        let prefills = seq.placement.prefill_helper().is_none();
        u32::try_from(page_size).context("--page-size")?;
        // The helper's part comes from the plan for its offer (and, once measured, its
        // speed): the same choice `tether plan` and a server's plan print; its pages are the
        // sequence's types.
        let fixed = Fixed {
            page_size: Some(page_size),
            kv_types: seq.state.kv_types(),
            ..Fixed::default()
        };
        let configure = |helper: &Intro, speeds: Option<Speeds>| {
            self.plan_for(model, (vec![helper.mem_offer], speeds), fixed, context, 0)
                .configure_helper(&model.config, prefills)
        };
        let mut client = HelperClient::connect_with(
            link,
            model,
            |helper| configure(helper, None),
            self.max_frame,
        )
        .with_context(|| format!("handshake with {source}"))?;
        let calibrates = self.split_layer.is_none() && !self.no_calibrate;
        let speeds = match calibrates {
            true => calibrate::measure(model, be, &mut client)
                .with_context(|| format!("measuring the speed of {source}"))?,
            false => None,
        };
        if let Some(speeds) = speeds {
            let balanced = configure(&client.helper, Some(speeds));
            client
                .configure(balanced)
                .with_context(|| format!("configuring {source} after measuring it"))?;
            client.speeds = Some(speeds);
        }
        if seq.placement.spill.is_none() {
            seq.placement.spill = Some(self.page_file()?);
        }
        // A state that lost a helper keeps its pages in the page file; helpers are re-filled
        // from it a few pages per pass.
        let id = seq.placement.attach(client);
        // A budget the caller set (a server's, from its memory) stays unless one is given.
        seq.placement.host_kv_tokens = self.host_kv_tokens.or(seq.placement.host_kv_tokens);
        Ok(id)
    }

    /// A new page file in --spill-dir (or the default) for a sequence's disk tier.
    fn page_file(&self) -> Result<PageFile> {
        let dir = match &self.spill_dir {
            Some(d) => d.clone(),
            None => cache_dir()
                .context("no cache directory for the page file: give --spill-dir DIR")?
                .join("pages"),
        };
        PageFile::create(&dir).with_context(|| format!("--spill-dir {}", dir.display()))
    }
}

impl HelperArgs {
    /// The memory the plan may use on this host: --host-memory, else what the system says is
    /// available, read once.
    pub fn host_memory(&self) -> Option<u64> {
        self.host_memory.or_else(|| {
            *self
                .measured_memory
                .get_or_init(crate::serve::memory::available)
        })
    }

    /// The session plan for `model` with the helpers' `offers` (bytes each; before they
    /// attach, [`Self::expected_offers`]), the prefill helper's measured `speeds` and what the
    /// command `fixed`.
    pub fn plan_for(
        &self,
        model: &Model,
        offers: (Vec<u64>, Option<Speeds>),
        fixed: Fixed,
        context: usize,
        prompt: usize,
    ) -> Plan {
        let shape = (&model.config, WeightBytes::of(model));
        self.plan_shape(shape, offers, fixed, context, prompt)
    }

    /// [`Self::plan_for`] a model's shape and weight bytes, which need not be loaded (`tether
    /// plan --weights-type`).
    pub fn plan_shape(
        &self,
        (config, weights): (&ModelConfig, WeightBytes),
        (offers, speeds): (Vec<u64>, Option<Speeds>),
        fixed: Fixed,
        context: usize,
        prompt: usize,
    ) -> Plan {
        let ubatch = match offers.is_empty() {
            true => fixed.ubatch,
            false => self.split_ubatch,
        };
        let input = PlanInput {
            context,
            prompt,
            weights,
            host_memory: self.host_memory(),
            helpers: offers,
            page_size: fixed.page_size,
            host_kv_tokens: fixed.host_kv_tokens.or(self.host_kv_tokens),
            split_layer: self.split_layer.or(fixed.split_layer),
            ubatch,
            split_min: self.split_min,
            interleave_from: self.interleave_from,
            link: Some(&self.link)
                .filter(|_| self.has_helper())
                .and_then(|l| LinkProfile::preset(l))
                .filter(|l| l.bandwidth_bps.is_finite())
                .map(|l| (l.bandwidth_bps, l.latency.as_secs_f64())),
            speeds,
            kv_types: fixed.kv_types,
            checkpoints: fixed.checkpoints,
        };
        Plan::new(config, &input)
    }

    /// A session for `model`: the plan before helpers attach (its page size, host KV budget
    /// and ubatch are the session's), a fresh state with the helpers attached (the first runs
    /// the split its offer allows) and the host's KV budget set.
    pub fn session(
        &self,
        model: &Model,
        be: &dyn Backend,
        fixed: Fixed,
        context: usize,
        prompt: usize,
    ) -> Result<(Plan, Sequence, Vec<Attached>)> {
        if fixed.page_size == Some(0) || fixed.ubatch == Some(0) || self.split_ubatch == Some(0) {
            bail!("--page-size, --ubatch and --split-ubatch must be at least 1");
        }
        let expected = (self.expected_offers(), None);
        let plan = self.plan_for(model, expected, fixed, context, prompt);
        let mut seq = Sequence::typed(&model.config, plan.page_size, plan.kv_types, be)?;
        let attached = self.attach(model, be, &mut seq, plan.page_size, context)?;
        if !attached.is_empty() {
            seq.placement.host_kv_tokens = plan.host_kv_tokens;
        }
        Ok((plan, seq, attached))
    }

    /// The offers to plan with before any helper attaches: one unknown (0 bytes) if a helper
    /// will, none otherwise. The page size, host budget and ubatch depend only on whether
    /// one does; the split waits for the real offer ([`Self::attach_link`]).
    pub fn expected_offers(&self) -> Vec<u64> {
        match self.has_helper() {
            true => vec![0],
            false => Vec::new(),
        }
    }

    /// The offers of the helpers attached to `state`, and the prefill helper's measured
    /// speeds.
    pub fn offers(seq: &Sequence) -> (Vec<u64>, Option<Speeds>) {
        let offers = seq
            .placement
            .helpers
            .iter()
            .map(|h| h.helper.mem_offer)
            .collect();
        (
            offers,
            seq.placement.prefill_helper().and_then(|h| h.speeds),
        )
    }

    pub fn host_kv_tokens(&self) -> Option<usize> {
        self.host_kv_tokens
    }

    /// How `run` and `bench` prefill by `plan`: split when a helper is attached, else on the
    /// host in the plan's ubatches.
    pub fn split_plan(&self, plan: &Plan) -> SplitPlan {
        if self.has_helper() {
            SplitPlan {
                min_tokens: self.split_min,
                ubatch: plan.ubatch,
                interleave_from: self.interleave_from,
            }
        } else {
            SplitPlan {
                min_tokens: usize::MAX,
                ubatch: plan.ubatch,
                interleave_from: usize::MAX,
            }
        }
    }
}

/// `tether pair URL CODE`: pair with the helper at `url` by the code it shows and remember
/// its key, so later commands need no `--pair`.
pub fn pair(url: &str, code: &str) -> Result<()> {
    let dir = config_dir()?;
    let mut store =
        KeyStore::open(&dir, "host").with_context(|| format!("keys in {}", dir.display()))?;
    let ws = ws::connect(url, wire_limit(DEFAULT_MAX_FRAME))
        .with_context(|| format!("connecting to the helper at {url}"))?;
    doors::pair_with(url, ws, &mut store, code, "helper")?;
    Ok(())
}

/// A link profile by name, for `--link`.
pub fn link_profile(name: &str) -> Result<LinkProfile> {
    LinkProfile::preset(name).with_context(|| {
        format!(
            "--link {name}: known profiles are {}",
            LinkProfile::PRESETS.join(", ")
        )
    })
}

/// The link's traffic as JSON: bytes and messages by type, both directions.
pub fn stats_json(stats: &LinkStats) -> serde_json::Value {
    serde_json::to_value(stats).expect("link stats serialise")
}
