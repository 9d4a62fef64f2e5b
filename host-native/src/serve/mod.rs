//! `tether serve`: an OpenAI-compatible HTTP server in front of one engine.
//!
//! Many clients, one sequence: HTTP runs on tokio, the model on one plain thread
//! ([`engine::Engine`]) fed by a FIFO ([`queue::Queue`]) bounded by count and by memory. A
//! request is admitted before its prompt is tokenised; a full queue answers 503 with
//! `Retry-After`; a client that disconnects cancels its request. The engine keeps the last
//! conversation's state, so a request that extends it prefills only the new tokens
//! ([`conversation`]). The context is sized to the free memory ([`memory`]); only JSON POSTs
//! are read and CORS is off by default ([`cross_site`]). docs/SERVE.md describes the
//! endpoints, limits, queueing, reuse and metrics.

mod api;
mod batched;
mod connections;
mod conversation;
mod cross_site;
mod engine;
#[cfg(test)]
mod fuzz_bodies;
mod helper_socket;
mod helpers;
pub mod memory;
mod metrics;
mod page;
mod prefix;
mod queue;
mod routes;
mod telemetry;
mod terminal;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use tracing::{info, warn};

use crate::attach::{Fixed, HelperArgs};
use crate::load::{fresh_sequence, DraftArgs, EngineArgs};
use batched::Batched;
use conversation::Conversation;
use cross_site::Cors;
use engine::Engine;
use engine_core::backend::KvType;
use engine_core::draft::{DraftKind, MtpDrafts};
use engine_core::host::plan::Speeds;
use engine_core::host::Sequence;
use helpers::Helpers;
use memory::Footprint;
use metrics::Metrics;
use queue::Queue;
use routes::App;
use telemetry::Hub;

#[derive(clap::Args)]
#[command(after_help = "\
Endpoints: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health,
GET /metrics (Prometheus). Try:
  tether serve --model tiny --port 8080 &
  curl -s localhost:8080/v1/chat/completions -H 'content-type: application/json' \\
    -d '{\"model\": \"tiny\", \"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}], \"max_tokens\": 16}'
docs/SERVE.md describes the limits, queueing, conversation reuse, errors and metrics.")]
pub struct Args {
    #[command(flatten)]
    engine: EngineArgs,
    #[command(flatten)]
    draft: DraftArgs,
    /// The model id clients name in requests (`model`); by default the directory's name or the
    /// preset.
    #[arg(long)]
    name: Option<String>,
    /// Address to listen on. Loopback by default: expose the server to a network only on
    /// purpose (there is no authentication).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on; 0 picks a free one. The first line on stdout gives the address.
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Requests that may wait (being tokenised or queued) while one is generated; more are
    /// refused with 503.
    #[arg(long, default_value_t = 512)]
    queue: usize,
    /// Bytes the waiting requests may hold together, each counted as its body plus 4 bytes per
    /// position of the context; past it requests are refused with 503. A size like 512M
    /// (default: a sixteenth of the memory available at start).
    #[arg(long, value_parser = engine_core::host::plan::parse_size)]
    queue_memory: Option<u64>,
    /// Time limit of a request in seconds, from its arrival (waiting included); past it the
    /// request ends with a timeout error.
    #[arg(long, default_value_t = 600)]
    timeout: u64,
    /// Positions a request may use, prompt and completion together (default: as many as fit
    /// in half the memory available at start, at most the model's max_position_embeddings).
    #[arg(long)]
    ctx_size: Option<usize>,
    /// State checkpoints kept for conversation reuse (the end of each of the latest prompts,
    /// and for chats where the first and the last message end); each is a copy of every
    /// DeltaNet layer's state.
    #[arg(long, default_value_t = 4)]
    checkpoints: usize,
    /// Prompt tokens per forward pass on the host alone.
    #[arg(long, default_value_t = 512)]
    ubatch: usize,
    /// Requests generated together (continuous batching): their decode rows share each pass
    /// over the weights, and a prompt prefills one ubatch a step beside them. The context is
    /// divided among them. 1 (the default) runs one request at a time, with conversation
    /// reuse, helpers and drafts, which --parallel does not have yet.
    #[arg(long, default_value_t = 1)]
    parallel: usize,
    /// With --parallel: MiB the prefix cache may hold (sequences kept where chat prompts
    /// break and where prompts end, for later requests that start the same way; 0: none).
    /// Taken from the memory the context is sized to.
    #[arg(long, default_value_t = 1024, value_name = "MIB")]
    prefix_cache_mib: usize,
    /// A tokenizer.json to use instead of the model's.
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Seconds between attempts to reconnect to a helper that was lost, made before a request
    /// (0: before every request).
    #[arg(long, default_value_t = 10)]
    helper_retry: u64,
    /// Let web pages from this origin call the server (CORS), e.g. http://localhost:3000;
    /// repeatable; `*` allows any page. Off by default: browsers keep pages from calling.
    #[arg(long = "cors", value_name = "ORIGIN")]
    cors: Vec<String>,
    /// Log level: error, warn, info, debug, trace, or a tracing filter (RUST_LOG wins).
    #[arg(long, default_value = "info")]
    log: String,
    /// Testing only: the engine panics after prefilling a prompt that contains this text,
    /// to exercise the recovery from a panic.
    #[arg(long, hide = true)]
    debug_panic_on: Option<String>,
}

/// A directory's last component, or the preset's name.
fn model_id(spec: &str) -> String {
    Path::new(spec)
        .file_name()
        .map_or_else(|| spec.to_string(), |n| n.to_string_lossy().into_owned())
}

pub fn run(a: Args) -> Result<()> {
    terminal::init_logging(&a.log)?;
    a.engine.start(true)?;
    a.draft.drafts().validate()?;
    if a.engine.page_size == Some(0) || a.ubatch == 0 || a.parallel == 0 {
        bail!("--page-size, --ubatch and --parallel must be at least 1");
    }
    let alone_only = a.engine.helper.has_helper() || a.draft.drafts().kind != DraftKind::None;
    if a.parallel > 1 && alone_only {
        bail!(
            "--parallel {} runs requests on the host alone without drafts: helpers and --draft \
             work with one request at a time (--parallel 1) for now",
            a.parallel
        );
    }
    let l = terminal::spinner(format!("loading {}", a.engine.model), || {
        a.engine.load(a.tokenizer.as_deref())
    })?;
    let config = &l.model.config;
    info!(
        "loaded {} ({} layers, {:.1} MiB of weights; {})",
        l.source,
        config.num_hidden_layers,
        l.model.weight_bytes() as f64 / (1u64 << 20) as f64,
        crate::load::residence()
    );
    let (backend, what) = a.engine.backend_for(&l.model)?;
    info!("backend: {what}");
    a.draft.drafts().check_backend(&*backend)?;
    // The plan decides: the page size before the state (as a session's is, for the largest
    // context the server may choose), then, with the helpers attached and their offers known,
    // the context that fits (`Plan::room`, counting the conversation checkpoints), then the
    // host's KV budget for that context.
    let most = a.ctx_size.unwrap_or(config.max_position_embeddings);
    let kv_types = a.engine.cache.types_or(KvType::F16);
    let start = a.engine.helper.plan_for(
        &l.model,
        (a.engine.helper.expected_offers(), None),
        Fixed {
            page_size: a.engine.page_size,
            ubatch: Some(a.ubatch),
            kv_types,
            checkpoints: Some(a.checkpoints),
            ..Fixed::default()
        },
        most,
        most.min(2048),
    );
    let page_size = start.page_size;
    let freeze_pages = a.engine.freeze_pages;
    let mut seq = fresh_sequence(
        &l.model.config,
        page_size,
        kv_types,
        freeze_pages,
        &*backend,
    )?;
    let attached = a
        .engine
        .helper
        .attach(&l.model, &*backend, &mut seq, page_size, most)?;
    let has_helpers = a.engine.helper.has_helper();
    let planned = |seq: &Sequence, ctx: usize| {
        a.engine.helper.plan_for(
            &l.model,
            serving_offers(&a.engine.helper, seq),
            fixed(seq, (page_size, a.ubatch), a.checkpoints),
            ctx,
            ctx.min(2048),
        )
    };
    let prefix_budget = match a.parallel {
        1 => 0,
        _ => a.prefix_cache_mib.saturating_mul(1 << 20),
    };
    let available = (a.engine.helper.host_memory()).map(|m| m.saturating_sub(prefix_budget as u64));
    let context = memory::choose_context(
        a.ctx_size,
        planned(&seq, most).room,
        (Footprint::of(config, kv_types, a.checkpoints), page_size),
        config.max_position_embeddings,
        available,
    )?;
    let ctx = context.tokens;
    info!(
        "context: {ctx} tokens (KV {} bytes/token, {} free; {} on the helpers)",
        context.footprint.per_token,
        available.map_or_else(|| "unknown".into(), memory::gib),
        context.on_helper
    );
    // As llama-server's slots: the requests of a batch share the context's memory.
    let per_request = ctx / a.parallel;
    if a.parallel > 1 {
        info!(
            "--parallel {}: up to {} requests together, {per_request} positions each",
            a.parallel, a.parallel
        );
        if per_request == 0 {
            bail!(
                "--parallel {}: a {ctx}-token context leaves no position per request",
                a.parallel
            );
        }
    }
    if let Some(w) = &context.warning {
        warn!("{w}");
    }
    // With a helper the host keeps what fits here, older pages move out, unless
    // --host-kv-tokens said otherwise.
    if !seq.placement.helpers.is_empty() && seq.placement.host_kv_tokens.is_none() {
        seq.placement.host_kv_tokens = context.on_host;
    }
    let plan = planned(&seq, ctx);
    let prompt = ctx.min(2048);
    eprint!(
        "plan for a {ctx}-token context and a {prompt}-token prompt:\n{}",
        plan.text
    );
    let split = a.engine.helper.split_plan(&plan);
    let name = a.name.clone().unwrap_or_else(|| model_id(&a.engine.model));
    let hub = Hub::new(serde_json::json!({
        "version": 1,
        "model": name,
        "layers": config.layer_types,
        "page_size": page_size,
        "ubatch": split.ubatch,
        "host_kv_tokens": a.engine.helper.host_kv_tokens().or(seq.placement.host_kv_tokens),
        "context_tokens": ctx,
        "kv_types": kv_types.to_string(),
        "kv_bytes_per_position": config.kv_row_bytes(kv_types),
        "weights_bytes": l.model.weight_bytes(),
        "plan": plan.text,
        "link_capacity_bps": a.engine.helper.link_capacity_bps(),
    }));
    seq.placement.telemetry = hub.telemetry();
    // Segments of whole ubatches (pairs stay pairs past interleave_from); with a helper long
    // enough that only one ubatch in 32 misses the pipeline (the last runs on the host).
    let segment = split.ubatch * if has_helpers { 32 } else { 4 };
    let mut stop_ids = config.eos_token_ids.clone();
    stop_ids.extend(
        ["<|im_end|>", "<|endoftext|>"]
            .iter()
            .filter_map(|t| l.tokenizer.token_id(t)),
    );
    let metrics = Arc::new(Metrics::default());
    metrics.set_parallel(a.parallel);
    metrics.set_helpers_attached(seq.placement.helpers.len());
    let helpers = has_helpers.then(|| {
        Helpers::new(
            a.engine.helper.clone(),
            attached,
            (Duration::from_secs(a.helper_retry), a.checkpoints),
        )
    });
    let budget = a
        .queue_memory
        .unwrap_or_else(|| memory::queue_budget(available));
    if budget < memory::request_bytes(0, ctx) {
        bail!(
            "--queue-memory {budget}: not even one request fits (each counts as its body and 4 bytes per position of the {ctx}-token context)"
        );
    }
    let queue = Arc::new(Queue::new(a.queue, budget));
    let app = Arc::new(App {
        name,
        created: routes::unix_now(),
        tokenizer: l.tokenizer.clone(),
        vocab: config.vocab_size,
        ctx: per_request,
        ctx_on_helper: context.on_helper,
        footprint: context.footprint,
        queue: queue.clone(),
        tokenisers: tokio::sync::Semaphore::new(
            std::thread::available_parallelism().map_or(1, usize::from),
        ),
        cors: Arc::new(Cors::new(&a.cors)?),
        metrics: metrics.clone(),
        helpers: helpers.as_ref().map(Helpers::shared),
        acceptor: a.engine.helper.port_doors(),
        helper_frame: a.engine.helper.max_frame(),
        timeout: Duration::from_secs(a.timeout),
        next_id: AtomicU64::new(0),
        hub: hub.clone(),
    });
    if a.parallel > 1 {
        let worker = Batched {
            model: l.model,
            backend,
            tokenizer: l.tokenizer,
            page_size,
            kv_types,
            freeze_pages,
            plan: split,
            stop_ids,
            parallel: a.parallel,
            panic_on: a.debug_panic_on.clone(),
            prefix_budget,
            metrics,
            timeout_s: a.timeout,
            hub,
        };
        engine_core::batch::Batch::new(&worker.model, &*worker.backend, worker.plan.clone())?;
        return listen(&a, app, queue, move |q| worker.run(q));
    }
    let drafts = a.draft.drafts();
    let mtp = match drafts.kind {
        DraftKind::Mtp => Some(MtpDrafts::new(&l.model, &seq.state, drafts.max)?),
        _ => None,
    };
    let engine = Engine {
        conversation: Conversation::new(&*backend, &seq.state, a.checkpoints),
        mtp,
        backend,
        tokenizer: l.tokenizer,
        model: l.model,
        seq,
        page_size,
        kv_types,
        freeze_pages,
        plan: split,
        segment,
        stop_ids,
        drafts,
        metrics,
        timeout_s: a.timeout,
        helpers,
        panic_on: a.debug_panic_on.clone(),
        hub,
        plan_for: (ctx, prompt),
    };
    listen(&a, app, queue, move |q| engine.run(q))
}

/// Run `engine` on its own thread over `queue`, and the HTTP server in front of it until a
/// shutdown signal.
fn listen(
    a: &Args,
    app: Arc<App>,
    queue: Arc<Queue>,
    engine: impl FnOnce(&Queue) + Send + 'static,
) -> Result<()> {
    let worker = {
        let queue = queue.clone();
        std::thread::Builder::new()
            .name("engine".into())
            .spawn(move || {
                // However the engine ends (a panic outside a job included), waiting and later
                // requests are answered rather than left hanging.
                let _close = CloseOnDrop(queue.clone());
                engine(&queue);
            })
            .context("starting the engine thread")?
    };

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    connections::raise_file_limit();
    rt.block_on(async {
        let listener = tokio::net::TcpListener::bind((a.host.as_str(), a.port))
            .await
            .with_context(|| format!("listening on {}:{}", a.host, a.port))?;
        let addr = listener.local_addr()?;
        // The first stdout line, for scripts and tests that started us on port 0.
        println!("listening on http://{addr}");
        std::io::stdout().flush()?;
        a.engine
            .helper
            .open_on_port(&format!("ws://{addr}/helper"))?;
        let load = app.queue.load();
        info!(
            "serving `{}` on http://{addr}/v1 (queue {} requests, {} MiB; time limit {} s)",
            app.name,
            load.capacity,
            load.budget >> 20,
            a.timeout
        );
        let hub = app.hub.clone();
        let stop = async move {
            shutdown_signal().await;
            hub.close();
        };
        connections::serve(listener, routes::router(app), stop)
            .await
            .context("serving HTTP")
    })?;
    queue.close();
    // The engine notices at its next job; a generation in progress ends with its client.
    drop(worker);
    Ok(())
}

/// Ctrl-C, or SIGTERM (what a service manager or `docker stop` sends): stop accepting, let
/// requests in flight finish, then exit 0.
async fn shutdown_signal() {
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term => {}
    }
    info!("shutting down");
}

struct CloseOnDrop(Arc<Queue>);

impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        self.0.close();
    }
}

/// The helpers' offers a server plans with: the attached ones' (and the prefill helper's
/// measured speeds), else one not known yet if helpers may come.
pub fn serving_offers(h: &HelperArgs, seq: &Sequence) -> (Vec<u64>, Option<Speeds>) {
    match seq.placement.helpers.is_empty() {
        true => (h.expected_offers(), None),
        false => HelperArgs::offers(seq),
    }
}

/// What a server fixed before planning: its page size, its ubatch on the host alone, the
/// host's KV budget its context rule chose, the split its prefill helper was configured with
/// (so the plan it prints gives the split that runs) and its conversation checkpoints.
pub fn fixed(seq: &Sequence, (page_size, ubatch): (usize, usize), checkpoints: usize) -> Fixed {
    Fixed {
        page_size: Some(page_size),
        kv_types: seq.state.kv_types(),
        ubatch: Some(ubatch),
        host_kv_tokens: seq.placement.host_kv_tokens,
        split_layer: seq
            .placement
            .prefill_helper()
            .map(|h| h.prefill_layers.start),
        checkpoints: Some(checkpoints),
    }
}
