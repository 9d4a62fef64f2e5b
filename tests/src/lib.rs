//! Shared helpers of the cross-crate tests: where the fixtures are and how to read them, how
//! to tether a state to a helper, seeded random values, the GPU backend.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::OnceLock;

use engine_core::backend::gpu::{GpuBackend, GpuOptions};
use engine_core::host::remote::{HelperClient, DEFAULT_MAX_FRAME};
use engine_core::host::Sequence;
use engine_core::link::Link;
use engine_core::protocol::Configure;
use engine_core::Model;

/// The reference fixtures: `$TETHER_FIXTURES`, else `../shared/fixtures` beside the checkout,
/// else `/work/shared/fixtures` (where a clone made elsewhere, as CI's is, finds them).
pub fn fixtures_dir() -> PathBuf {
    if let Ok(d) = std::env::var("TETHER_FIXTURES") {
        return PathBuf::from(d);
    }
    let beside = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/fixtures");
    if beside.is_dir() {
        return beside;
    }
    PathBuf::from("/work/shared/fixtures")
}

/// The tiny256 preset (heads of 64 values: whole blocks of every KV type, and Qwen3.5's groups
/// of 4 query heads per KV head) with f32 weights, seeded.
pub fn tiny256() -> Model {
    let synth = engine_core::source::LoadOptions {
        weight_dtype: "f32".into(),
        weight_seed: 5,
        ..Default::default()
    };
    engine_core::source::load_model("tiny256", &synth).unwrap()
}

/// A model from the committed GGUF fixtures (tests/fixtures/gguf), read as the engine reads it.
pub fn gguf_model(name: &str) -> Model {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("fixtures/gguf/{name}"));
    let (config, tensors) = engine_core::gguf::qwen35::load(&path).unwrap();
    Model::from_tensors(config, &tensors).unwrap()
}

/// The GPU backend the tests share (lavapipe in CI). With no adapter at all the tests that use
/// it fail, saying what to install.
pub fn gpu() -> &'static GpuBackend {
    static GPU: OnceLock<GpuBackend> = OnceLock::new();
    GPU.get_or_init(|| {
        GpuBackend::new(&GpuOptions::default()).unwrap_or_else(|e| {
            panic!("{e}\nThe GPU tests need a Vulkan adapter: apt-get install mesa-vulkan-drivers")
        })
    })
}

/// The tensors of a reference (or `tether eval`) file: f32 tensors and i64 token ids.
pub struct Reference {
    pub tensors: HashMap<String, (Vec<usize>, Vec<u8>, safetensors::Dtype)>,
}

impl Reference {
    pub fn load(fixture: &str) -> Reference {
        let path = fixtures_dir().join(fixture).join("reference.safetensors");
        let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        Reference::from_bytes(&bytes)
    }

    /// Any safetensors file (e.g. what `tether eval` wrote).
    pub fn from_bytes(bytes: &[u8]) -> Reference {
        let st = safetensors::SafeTensors::deserialize(bytes).expect("a valid safetensors file");
        let tensors = st
            .tensors()
            .into_iter()
            .map(|(n, v)| (n, (v.shape().to_vec(), v.data().to_vec(), v.dtype())))
            .collect();
        Reference { tensors }
    }

    pub fn f32(&self, name: &str) -> (Vec<usize>, Vec<f32>) {
        let (shape, data, dt) = &self.tensors[name];
        assert_eq!(*dt, safetensors::Dtype::F32, "{name}");
        (shape.clone(), bytemuck::pod_collect_to_vec(data))
    }

    pub fn ids(&self, name: &str) -> Vec<u32> {
        let (_, data, dt) = &self.tensors[name];
        assert_eq!(*dt, safetensors::Dtype::I64, "{name}");
        bytemuck::pod_collect_to_vec::<u8, i64>(data)
            .into_iter()
            .map(|v| v as u32)
            .collect()
    }
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Start `cmd` with its stdout piped and return it with the first line it prints, trimmed: the
/// address a server says it is listening on (`tether serve`, `tether-helper`).
pub fn spawn_announcing(cmd: &mut std::process::Command) -> (std::process::Child, String) {
    let (child, mut lines) = spawn_announcing_lines(cmd, 1);
    (child, lines.remove(0))
}

/// [`spawn_announcing`] for the first `n` lines (a helper's address, then its pairing code).
pub fn spawn_announcing_lines(
    cmd: &mut std::process::Command,
    n: usize,
) -> (std::process::Child, Vec<String>) {
    use std::io::BufRead;
    let mut child = cmd
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("starting {cmd:?}: {e}"));
    let mut out = std::io::BufReader::new(child.stdout.take().expect("stdout is piped"));
    let lines = (0..n)
        .map(|_| {
            let mut line = String::new();
            out.read_line(&mut line).unwrap();
            line.trim().to_string()
        })
        .collect();
    (child, lines)
}

/// A small deterministic generator (xorshift), so the tests need no RNG crate.
pub struct Rng(pub u64);

impl Rng {
    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 40) as f32 / (1u64 << 24) as f32
    }

    /// `n` values uniform in [-1, 1).
    pub fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.uniform() * 2.0 - 1.0).collect()
    }

    /// `n` values roughly standard normal (the sum of 12 uniforms, less 6).
    pub fn normal_vec(&mut self, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| (0..12).map(|_| self.uniform()).sum::<f32>() - 6.0)
            .collect()
    }
}

/// A helper on `be` with a 1 GiB budget, serving on a thread of `scope` until the returned
/// host end of its in-memory link is dropped.
pub fn spawn_helper<'scope, 'env>(
    scope: &'scope std::thread::Scope<'scope, 'env>,
    m: &'env Model,
    be: &'env dyn engine_core::Backend,
) -> engine_core::link::MemoryLink {
    let (host_end, mut helper_end) = engine_core::link::pair();
    scope.spawn(move || {
        let opts = engine_core::helper::HelperOptions {
            mem_budget: 1 << 30,
            max_frame: DEFAULT_MAX_FRAME,
        };
        engine_core::helper::Helper::new(m, be, opts).serve(&mut helper_end)
    });
    host_end
}

/// Tether `st` (a host's sequence) to the helper at the other end of `link`: it runs the layers from `split` on
/// (none when `split` is the layer count) and holds KV pages of `page` positions in the
/// sequence's cache types; the host
/// keeps at most `budget` positions of KV (`None`: all of them).
pub fn attach(
    m: &Model,
    st: &mut Sequence,
    link: impl Link + 'static,
    split: usize,
    page: usize,
    budget: Option<usize>,
) {
    let layers = m.config.num_hidden_layers as u32;
    let cfg = Configure {
        first_layer: (split as u32).min(layers),
        end_layer: layers,
        page_size: page as u32,
        kv_types: st.state.kv_types(),
    };
    let client = HelperClient::connect(Box::new(link), m, cfg, DEFAULT_MAX_FRAME).unwrap();
    st.placement.attach(client);
    st.placement.host_kv_tokens = budget;
}

/// A new page file (the disk tier of a sequence's KV) in the temp directory.
pub fn page_file() -> engine_core::host::page_file::PageFile {
    let dir = std::env::temp_dir().join(format!("tether-test-pages-{}", std::process::id()));
    engine_core::host::page_file::PageFile::create(&dir).unwrap()
}

/// A link that dies after a fixed number of operations (sends and receives): a helper
/// unplugged at a chosen point of a sequence, the same point on every run. The inner link is
/// dropped then, so the helper sees it close too. `ops` counts what went through; `peak` is
/// the most frames sent and not yet matched by a frame received (requests in flight).
pub struct Fuse<L: Link> {
    inner: Option<L>,
    left: usize,
    pub ops: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    in_flight: usize,
    pub peak: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl<L: Link> Fuse<L> {
    /// `link`, cut after `ops` operations (`usize::MAX`: never).
    pub fn new(link: L, ops: usize) -> Fuse<L> {
        Fuse {
            inner: Some(link),
            left: ops,
            ops: Default::default(),
            in_flight: 0,
            peak: Default::default(),
        }
    }

    /// The inner link if the fuse still holds for one more operation.
    fn live(&mut self) -> Result<&mut L, engine_core::link::LinkError> {
        if self.left == 0 {
            self.inner = None;
        }
        self.left = self.left.saturating_sub(1);
        self.ops.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.inner.as_mut().ok_or_else(|| {
            engine_core::link::LinkError::Closed("the fuse blew: the helper is unplugged".into())
        })
    }
}

impl<L: Link> Link for Fuse<L> {
    fn send(&mut self, frame: Vec<u8>) -> Result<(), engine_core::link::LinkError> {
        self.live()?.send(frame)?;
        self.in_flight += 1;
        self.peak
            .fetch_max(self.in_flight, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    fn recv(&mut self) -> Result<Vec<u8>, engine_core::link::LinkError> {
        let frame = self.live()?.recv()?;
        self.in_flight = self.in_flight.saturating_sub(1);
        Ok(frame)
    }

    fn recv_timeout(
        &mut self,
        timeout: std::time::Duration,
    ) -> Result<Option<Vec<u8>>, engine_core::link::LinkError> {
        let frame = self.live()?.recv_timeout(timeout)?;
        if frame.is_some() {
            self.in_flight = self.in_flight.saturating_sub(1);
        }
        Ok(frame)
    }

    fn sender(&self) -> Box<dyn engine_core::link::LinkSender> {
        self.inner
            .as_ref()
            .expect("a fuse is asked for a sender before it blows")
            .sender()
    }
}

/// A process whose stderr lines are read on a thread and come through a channel, so a test
/// can wait for a line it announces (an address, a pairing code) while the process runs.
pub struct Process {
    pub child: std::process::Child,
    lines: std::sync::mpsc::Receiver<String>,
    /// Every stderr line read so far.
    seen: Vec<String>,
}

impl Process {
    /// Start `cmd` with stdout and stderr piped.
    pub fn start(cmd: &mut std::process::Command) -> Process {
        use std::io::BufRead;
        use std::process::Stdio;
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("starting {cmd:?}: {e}"));
        let err = child.stderr.take().expect("stderr is piped");
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(err).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        Process {
            child,
            lines,
            seen: Vec::new(),
        }
    }

    /// The rest of the next stderr line that starts with `prefix` (within 60 s).
    pub fn wait_for(&mut self, prefix: &str) -> String {
        loop {
            let line = self
                .lines
                .recv_timeout(std::time::Duration::from_secs(60))
                .unwrap_or_else(|_| panic!("no {prefix:?} on stderr; saw {:?}", self.seen));
            self.seen.push(line.clone());
            if let Some(rest) = line.strip_prefix(prefix) {
                return rest.trim().to_string();
            }
        }
    }

    /// The first line of stdout (trimmed).
    pub fn stdout_line(&mut self) -> String {
        use std::io::BufRead;
        let mut line = String::new();
        let out = self.child.stdout.as_mut().expect("stdout is piped");
        std::io::BufReader::new(out).read_line(&mut line).unwrap();
        line.trim().to_string()
    }

    /// Waits for the process to end: whether it succeeded, its stdout, and all of its stderr.
    pub fn finish(mut self) -> (bool, String, String) {
        use std::io::Read;
        let mut out = String::new();
        if let Some(mut stdout) = self.child.stdout.take() {
            stdout.read_to_string(&mut out).unwrap();
        }
        let ok = self.child.wait().unwrap().success();
        self.seen.extend(self.lines.iter());
        (ok, out, self.seen.join("\n"))
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The split plan of the conversation tests: a prompt over 20 tokens splits, in ubatches of
/// 8, interleaved from position 120.
pub fn conversation_plan() -> engine_core::host::split::SplitPlan {
    engine_core::host::split::SplitPlan {
        min_tokens: 20,
        ubatch: 8,
        interleave_from: 120,
    }
}

/// The conversation the helper tests run: a prompt (pipelined with the prefill helper, then
/// interleaved past 120), greedy steps, a second turn (the helper's mirror is synced first),
/// more steps. Returns every logit it saw. `between` runs after the first steps (a helper
/// joins there).
pub fn conversation(
    m: &Model,
    st: &mut Sequence,
    prompt: &[u32],
    between: &mut dyn FnMut(&mut Sequence),
) -> Vec<f32> {
    use engine_core::host::split::prefill;
    let be = &engine_core::CpuBackend;
    let plan = conversation_plan();
    let (mut logits, _) = prefill(m, be, st, prompt, &plan).unwrap();
    let mut all = logits.clone();
    let step = |st: &mut Sequence, logits: &mut Vec<f32>, all: &mut Vec<f32>| {
        let next = engine_core::generate::argmax(logits);
        *logits = st
            .forward(m, be, &[next], engine_core::Logits::Last, None)
            .unwrap();
        all.extend_from_slice(logits);
    };
    for _ in 0..6 {
        step(st, &mut logits, &mut all);
    }
    between(st);
    let turn: Vec<u32> = prompt[..40].iter().map(|t| (t * 3 + 1) % 256).collect();
    let (l, _) = prefill(m, be, st, &turn, &plan).unwrap();
    logits = l;
    all.extend_from_slice(&logits);
    for _ in 0..6 {
        step(st, &mut logits, &mut all);
    }
    all
}

/// A prompt long enough to split its prefill and move pages to a helper with [`SPLIT_FLAGS`]
/// (the `tether` command tests: join.rs, tab.rs, split_page.rs).
pub const SPLIT_PROMPT: &str = "The quick brown fox jumps over the lazy dog while the cat \
                                watches from the warm windowsill and the birds sing in the \
                                tall green trees";

/// `tether` flags that make a helper do real work on the tiny model: pages beyond 16
/// positions leave the host, and a prompt of more than 16 tokens prefills split in 8-token
/// ubatches, layers 4.. on the helper.
pub const SPLIT_FLAGS: &[&str] = &[
    "--page-size",
    "8",
    "--host-kv-tokens",
    "16",
    "--split-min",
    "16",
    "--split-ubatch",
    "8",
    "--split-layer",
    "4",
];
