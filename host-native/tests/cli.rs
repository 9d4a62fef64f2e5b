//! The `tether` binary as a user runs it.

use std::path::{Path, PathBuf};
use std::process::Command;

use tests::{fixtures_dir, max_abs_diff, Reference};

mod broken;

fn tether(args: &[&str]) -> std::process::Output {
    let out = Command::new(env!("CARGO_BIN_EXE_tether"))
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "tether {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// A test's own folder under the temporary directory, removed when the test ends (a 27B
/// plan's GGUF and the quantised models are megabytes each, and every run used to leave them).
struct Scratch(PathBuf);

impl std::ops::Deref for Scratch {
    type Target = Path;

    fn deref(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A new folder each call (tests run in parallel threads of one process, and two may ask for
/// the same name: helpers' key folders).
fn scratch(name: &str) -> Scratch {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let pid = std::process::id();
    let d = std::env::temp_dir().join(format!("tether-cli-{pid}-{n}-{name}"));
    std::fs::create_dir_all(&d).unwrap();
    Scratch(d)
}

fn read_eval(path: &PathBuf) -> Reference {
    Reference::from_bytes(&std::fs::read(path).unwrap())
}

#[test]
fn eval_reproduces_the_fixture_on_both_backends() {
    let r = Reference::load("tiny_fp32_T150");
    let dir = scratch("eval");
    let model = fixtures_dir().join("tiny_fp32_T150");
    // On a Mac, Metal itself too (not run here: docs/PHONE.md).
    let backends: &[&str] = if cfg!(target_vendor = "apple") {
        &["cpu", "gpu", "metal"]
    } else {
        &["cpu", "gpu"]
    };
    for &backend in backends {
        let model = model.to_str().unwrap();
        let got = eval(model, &r.ids("prompt_ids"), &["--backend", backend], &dir);
        assert_eq!(got.ids("gen_ids"), r.ids("gen_ids"), "{backend}");
        for name in ["prefill_logits", "gen_logits"] {
            let (shape, want) = r.f32(name);
            let (got_shape, got) = got.f32(name);
            assert_eq!(got_shape, shape, "{name}");
            let d = max_abs_diff(&got, &want);
            assert!(d < 1e-4, "{backend}: {name} differs by {d}");
        }
    }
}

#[test]
fn synth_writes_a_directory_that_loads_back_identically() {
    let dir = scratch("synth");
    let model = dir.join("model");
    tether(&[
        "synth",
        "--preset",
        "tiny",
        "--out",
        model.to_str().unwrap(),
        "--dtype",
        "f16",
        "--layers",
        "4",
    ]);
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(model.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["num_hidden_layers"], 4);
    std::fs::write(dir.join("ids.txt"), "1 2 3 4 5 6 7 8").unwrap();
    let ids = dir.join("ids.txt");
    let (a, b) = (dir.join("a.safetensors"), dir.join("b.safetensors"));
    let common = [
        "--ids-file",
        ids.to_str().unwrap(),
        "--gen",
        "4",
        "--dtype",
        "f16",
        "--layers",
        "4",
    ];
    tether(
        &[
            &[
                "eval",
                "--model",
                model.to_str().unwrap(),
                "--out",
                a.to_str().unwrap(),
            ],
            &common[..],
        ]
        .concat(),
    );
    tether(
        &[
            &["eval", "--model", "tiny", "--out", b.to_str().unwrap()],
            &common[..],
        ]
        .concat(),
    );
    let (a, b) = (read_eval(&a), read_eval(&b));
    assert_eq!(a.f32("prefill_logits"), b.f32("prefill_logits"));
    assert_eq!(a.ids("gen_ids"), b.ids("gen_ids"));
}

#[test]
fn tokenize_prints_the_reference_ids() {
    let samples: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures_dir().join("tokenizer/samples.json")).unwrap(),
    )
    .unwrap();
    let s = &samples["samples"][0];
    let tok = fixtures_dir().join("tokenizer/tokenizer.json");
    let out = tether(&[
        "tokenize",
        "--tokenizer",
        tok.to_str().unwrap(),
        "--text",
        s["text"].as_str().unwrap(),
    ]);
    let ids: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(ids, s["ids"]);
}

#[test]
fn run_streams_greedy_text_and_bench_reports_json() {
    let out = tether(&[
        "run",
        "--model",
        "tiny",
        "--prompt",
        "hello",
        "--max-tokens",
        "8",
        "--temperature",
        "0",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("prompt 5 tokens"), "{err}");
    let out = tether(&[
        "bench",
        "--model",
        "tiny",
        "--prompt-tokens",
        "16",
        "--gen",
        "4",
        "--threads",
        "1",
        "--json",
    ]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for key in ["prefill_tok_s", "decode_tok_s", "peak_rss_bytes"] {
        assert!(v[key].as_f64().is_some_and(|x| x > 0.0), "{key} in {v}");
    }
}

/// `tether eval` of `ids` on `model`, 20 greedy tokens, pages of 64, with `extra` flags.
fn eval(model: &str, ids: &[u32], extra: &[&str], dir: &Path) -> Reference {
    let ids: Vec<String> = ids.iter().map(u32::to_string).collect();
    std::fs::write(dir.join("ids.txt"), ids.join(", ")).unwrap();
    let out = dir.join(format!("out-{}.safetensors", extra.join("-")));
    let (ids, out_arg) = (dir.join("ids.txt"), out.to_str().unwrap());
    let base = [
        "eval",
        "--model",
        model,
        "--ids-file",
        ids.to_str().unwrap(),
    ];
    let rest = ["--gen", "20", "--out", out_arg, "--page-size", "64"];
    tether(&[&base[..], &rest, extra].concat());
    read_eval(&out)
}

/// [`eval`] with keys and values stored as `k` and `v`.
fn eval_with_cache(model: &str, ids: &[u32], (k, v): (&str, &str), dir: &Path) -> Reference {
    eval(model, ids, &["--cache-type-k", k, "--cache-type-v", v], dir)
}

/// A compact KV cache keeps the answer within what its rounding allows: the same 20 greedy
/// tokens, and logits as near as each type's rounding of keys and values puts them. f16
/// against the fixture (`tiny`'s heads of 16 are not whole 32-value blocks, so q8_0 and q4_0
/// run on `tiny256`, against its own f32 pages). Bounds are about three times what was
/// measured (f16 7.4e-4; on tiny256 q8_0 0.012, q8_0/f16 0.0064, q4_0 0.22), far below what
/// a page read wrong would give.
#[test]
fn eval_with_compact_kv_pages_stays_near_f32() {
    let r = Reference::load("tiny_fp32_T150");
    let dir = scratch("eval-kv");
    let fixture = fixtures_dir().join("tiny_fp32_T150");
    let ids = r.ids("prompt_ids");
    let check = |got: &Reference, want: &Reference, what: &str, bound: f32| {
        assert_eq!(got.ids("gen_ids"), want.ids("gen_ids"), "{what}");
        for name in ["prefill_logits", "gen_logits"] {
            let d = max_abs_diff(&got.f32(name).1, &want.f32(name).1);
            assert!(
                d < bound,
                "{what}: {name} differs by {d}, more than {bound}"
            );
        }
    };
    let f16 = eval_with_cache(fixture.to_str().unwrap(), &ids, ("f16", "f16"), &dir);
    check(&f16, &r, "f16 on the fixture", 2e-3);
    let exact = eval_with_cache("tiny256", &ids, ("f32", "f32"), &dir);
    for (k, v, bound) in [
        ("q8_0", "q8_0", 0.04),
        ("q8_0", "f16", 0.02),
        ("q4_0", "q4_0", 0.7),
    ] {
        let got = eval_with_cache("tiny256", &ids, (k, v), &dir);
        check(&got, &exact, &format!("{k}/{v} on tiny256"), bound);
    }
}

#[test]
fn bad_arguments_fail_with_a_message() {
    // `tether run` with `args` fails; its stderr.
    let refused = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_tether"))
            .arg("run")
            .args(args)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?}");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let err = refused(&["--model", "no-such-model", "--prompt", "x"]);
    assert!(
        err.contains("not a directory, nor a GGUF file, nor a preset"),
        "{err}"
    );
    // Metal itself is an Apple build's backend; elsewhere the error says what to use.
    let tiny = |extra: &[&str]| refused(&[&["--model", "tiny", "--prompt", "x"], extra].concat());
    let err = tiny(&["--backend", "metal"]);
    assert!(
        err.contains("--backend metal") && err.contains("--backend gpu"),
        "{err}"
    );
    // Compact KV pages: a type llama.cpp has but tether does not and heads that are not whole
    // blocks are refused, saying why (rows the GPU cannot read: tests/tests/gpu_model.rs).
    let err = tiny(&["--cache-type-k", "q5_1"]);
    assert!(
        err.contains("expected one of f32, f16, q8_0, q4_0"),
        "{err}"
    );
    let err = tiny(&["--cache-type-k", "q8_0"]);
    assert!(
        err.contains("head of 16 values is not whole 32-value blocks"),
        "{err}"
    );
}

/// A Q8_0 GGUF runs from the command line on both backends. Their tokens may differ: the
/// CPU's decode kernels round activations to 8 bits, the GPU's keep f32 (on these random
/// weights the first token's top two logits are closer than that rounding); each is checked
/// against the dequantised weights in tests/tests/gguf.rs.
#[test]
fn a_q8_0_gguf_runs_on_the_cpu_and_the_gpu() {
    let q8 = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/fixtures/gguf/tiny_fp32.q8_0.gguf"
    );
    let text = |backend: &str| {
        let out = tether(&[
            "run",
            "--model",
            q8,
            "--prompt",
            "hello there",
            "--max-tokens",
            "12",
            "--raw",
            "--backend",
            backend,
        ]);
        out.stdout
    };
    for backend in ["cpu", "gpu"] {
        assert!(!text(backend).is_empty(), "{backend}");
    }
}

#[test]
fn demo_splits_offloads_and_checks_against_the_host_alone() {
    let out = tether(&[
        "demo",
        "--model",
        "tiny",
        "--layers",
        "12",
        "--dtype",
        "f32",
        "--prompt-tokens",
        "700",
        "--gen",
        "4",
        "--page-size",
        "32",
        "--host-kv-tokens",
        "128",
        "--link",
        "unlimited",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("check: tokens identical (4 generated), logits bit-identical"),
        "{text}"
    );
    assert!(
        text.contains("had layers 8..12 run on the helper"),
        "{text}"
    );
    assert!(
        text.contains("PrefillChunk") && text.contains("AttnPartials"),
        "{text}"
    );
}

/// Asserts that GGUF `ours` holds every tensor of `theirs` with the same name, type, shape and
/// bytes, and the same metadata values but for the name, the size label, the rope sections and
/// the vocabulary (`what` names the case in messages).
fn assert_same_gguf(ours: &std::path::Path, theirs: &std::path::Path, what: &str) {
    use engine_core::gguf::Gguf;
    let (ours, theirs) = (std::fs::read(ours).unwrap(), std::fs::read(theirs).unwrap());
    let (a, b) = (Gguf::parse(&ours).unwrap(), Gguf::parse(&theirs).unwrap());
    assert_eq!(a.tensors.len(), b.tensors.len(), "{what}");
    for tb in &b.tensors {
        let ta = a
            .tensors
            .iter()
            .find(|x| x.name == tb.name)
            .unwrap_or_else(|| panic!("{what}: no {}", tb.name));
        assert_eq!(
            (ta.dtype, &ta.shape),
            (tb.dtype, &tb.shape),
            "{what}: {}",
            tb.name
        );
        assert!(
            ours[ta.range.clone()] == theirs[tb.range.clone()],
            "{what}: {} ({}) differs",
            tb.name,
            tb.dtype.name()
        );
    }
    // The converter's name is title-cased; its rope sections come from the checkpoint's
    // mrope_section, which tether's config does not keep (they change nothing for text); the
    // vocabulary is the fixture script's, as the checkpoint has none.
    let skip = [
        "general.name",
        "general.size_label",
        "qwen35.rope.dimension_sections",
    ];
    for (k, v) in &b.metadata {
        if skip.contains(&k.as_str()) || k.starts_with("tokenizer.") {
            continue;
        }
        assert_eq!(a.get(k), Some(v), "{what}: metadata {k}");
    }
}

/// `tether quantize` writes the file llama.cpp's converter writes from the same checkpoint
/// (tests/fixtures/gguf, made by `scripts/gguf-from-fixture.py`) in f32, f16 and q8_0, and the
/// file `llama-quantize` writes from the same f32 GGUF in q4_0, q5_1, q4_k_m, and from the
/// tiny256 preset in q2_k, q3_k_m, q4_k_m and iq4_xs (`scripts/llama-quantize-fixtures.sh`):
/// every tensor's type by llama.cpp's per-tensor rules, and its bytes by ggml's reference
/// quantisers.
#[test]
fn quantize_writes_llama_cpps_files() {
    let dir = scratch("quantize");
    let fixtures = PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/fixtures/gguf"
    ));
    let checkpoint = fixtures_dir().join("tiny_fp32");
    let quantize = |input: &str, out: &PathBuf, t: &str, extra: &[&str]| {
        let _ = std::fs::remove_file(out);
        let mut args = vec!["quantize", input, out.to_str().unwrap(), "--type", t];
        args.extend_from_slice(extra);
        tether(&args);
    };
    for t in ["f32", "f16", "q8_0"] {
        let out = dir.join(format!("tiny.{t}.gguf"));
        quantize(checkpoint.to_str().unwrap(), &out, t, &[]);
        assert_same_gguf(&out, &fixtures.join(format!("tiny_fp32.{t}.gguf")), t);
    }
    // A GGUF re-typed: the converter's f32 file as llama-quantize would type it.
    let f32_file = fixtures.join("tiny_fp32.f32.gguf");
    for t in ["q8_0", "q4_0", "q5_1", "q4_k_m"] {
        let out = dir.join(format!("re.{t}.gguf"));
        quantize(f32_file.to_str().unwrap(), &out, t, &[]);
        assert_same_gguf(&out, &fixtures.join(format!("tiny_fp32.{t}.gguf")), t);
    }
    // Rows of 256: the k-quants and IQ4_XS, with each mix's higher types for the output and
    // the value, down and attention output projections.
    let synth = ["--dtype", "f32", "--weight-seed", "3"];
    for t in ["q2_k", "q3_k_m", "q4_k_m", "iq4_xs"] {
        let out = dir.join(format!("tiny256.{t}.gguf"));
        quantize("tiny256", &out, t, &synth);
        let theirs = fixtures.join(format!("tiny256.{t}.gguf"));
        assert_same_gguf(&out, &theirs, &format!("tiny256 {t}"));
    }
    // It refuses to overwrite a file, and types it does not write.
    let out = dir.join("tiny.q8_0.gguf");
    let again = Command::new(env!("CARGO_BIN_EXE_tether"))
        .args([
            "quantize",
            checkpoint.to_str().unwrap(),
            out.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(!again.status.success());
    let q3 = Command::new(env!("CARGO_BIN_EXE_tether"))
        .args([
            "quantize",
            "tiny",
            dir.join("x.gguf").to_str().unwrap(),
            "--type",
            "iq2_xs",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&q3.stderr);
    assert!(
        err.contains("--type iq2_xs: expected one of f32, f16, bf16, q8_0"),
        "{err}"
    );
}

/// `tether quantize` refuses a checkpoint that `tether eval` refuses, with eval's message
/// (one check of the tensors against the config), and writes nothing.
#[test]
fn quantize_refuses_what_eval_refuses_and_writes_nothing() {
    let dir = scratch("broken");
    let out = dir.join("out.gguf");
    std::fs::write(dir.join("ids.txt"), "1 2 3").unwrap();
    let path = |name: &str| dir.join(name).to_str().unwrap().to_string();
    let (ids, gguf, evaluated) = (path("ids.txt"), path("out.gguf"), path("out.safetensors"));
    for (model, problem) in broken::checkpoints(&dir) {
        let model = model.to_str().unwrap();
        let quantize = ["quantize", model, &gguf, "--type", "q8_0"];
        let eval = [
            "eval",
            "--model",
            model,
            "--ids-file",
            &ids,
            "--out",
            &evaluated,
        ];
        for args in [&quantize[..], &eval[..]] {
            let run = Command::new(env!("CARGO_BIN_EXE_tether"))
                .args(args)
                .output()
                .unwrap();
            let err = String::from_utf8_lossy(&run.stderr);
            assert!(!run.status.success(), "tether {args:?} succeeded: {err}");
            assert!(err.contains(problem), "tether {args:?}: {err}");
        }
        assert!(!out.exists(), "quantize left {} behind", out.display());
    }
}

/// A file that skips runs of zeros instead of writing them, so a GGUF of gigabytes of zero
/// weights takes no disk: the file system reads the holes back as zeros.
struct Sparse(std::fs::File);

impl std::io::Write for Sparse {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        use std::io::Seek;
        if buf.iter().all(|&b| b == 0) {
            self.0.seek(std::io::SeekFrom::Current(buf.len() as i64))?;
            Ok(buf.len())
        } else {
            self.0.write(buf)
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        use std::io::Seek;
        let end = self.0.stream_position()?;
        self.0.set_len(end)
    }
}

/// `tether plan` on a GGUF of Qwen3.5-27B's shape (MODEL.md) with 16 of its 64 layers, in
/// llama.cpp's Q4_K_M mix, its weights zeros: what it chooses for a 131072-token context on
/// a host with 8 GiB, alone and with a helper, against figures worked out here from the shape.
#[test]
fn plan_decides_for_a_27b_shaped_gguf() {
    use engine_core::config::ModelConfig;
    use engine_core::gguf::quantize::{self, FileType};
    use std::io::Write;
    let c = ModelConfig {
        hidden_size: 5120,
        intermediate_size: 17408,
        num_hidden_layers: 16,
        num_attention_heads: 24,
        num_key_value_heads: 4,
        head_dim: 256,
        linear_num_key_heads: 16,
        linear_num_value_heads: 48,
        tie_word_embeddings: false,
        layer_types: ModelConfig::interval_layer_types(16, 4),
        ..engine_core::synth::preset("qwen35-0.8b").unwrap()
    };
    let f = FileType::parse("q4_k_m").unwrap();
    let mut w = engine_core::gguf::Writer::new();
    quantize::metadata(&mut w, &c, "qwen35-27b-shaped", f);
    let layout = quantize::layout(&c, f).unwrap();
    let mut sizes = Vec::new();
    for (name, shape, dtype) in &layout {
        w.describe(name, shape, *dtype);
        sizes.push(dtype.bytes_for(shape.iter().product()).unwrap());
    }
    let dir = scratch("plan27b");
    let path = dir.join("27b-16.q4_k_m.gguf");
    let mut out = Sparse(std::fs::File::create(&path).unwrap());
    w.write(&mut out, |i| Ok(vec![0; sizes[i]])).unwrap();
    out.flush().unwrap();
    // The weights the plan counts: the matrices, which are the quantised tensors of a Q4_K_M
    // file (norms, `ssm_a`, `ssm_dt` and the conv kernels stay F32).
    let weights: usize = layout
        .iter()
        .zip(&sizes)
        .filter(|((_, _, dtype), _)| dtype.is_quantised())
        .map(|(_, size)| size)
        .sum();
    assert!(weights > 4 << 30, "{weights}");
    let model = path.to_str().unwrap();
    let plan = |extra: &[&str]| {
        let mut args = vec![
            "plan",
            "--model",
            model,
            "--context",
            "131072",
            "--host-memory",
            "8G",
        ];
        // The figures below are worked out for exact pages unless a type is given (the
        // default is f16).
        if !extra.contains(&"--cache-type-k") {
            args.extend_from_slice(&["--cache-type-k", "f32", "--cache-type-v", "f32"]);
        }
        args.extend_from_slice(extra);
        String::from_utf8(tether(&args).stdout).unwrap()
    };
    // 4 full-attention layers x K and V x 4 heads x 256 x 4 bytes = 32 KiB a position: 4 GiB
    // at 131072, which does not fit beside the weights in 8 GiB.
    let alone = plan(&[]);
    assert!(
        alone.contains("16 layers (4 full attention, 12 Gated DeltaNet); KV 32.0 KiB per token"),
        "{alone}"
    );
    let gib = |b: usize| format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64);
    assert!(
        alone.contains(&format!("weights {}", gib(weights))),
        "{alone}"
    );
    assert!(alone.contains("KV 4.00 GiB"), "{alone}");
    assert!(alone.contains("host KV tokens all: WARNING"), "{alone}");
    assert!(alone.contains("MORE than the 8.00 GiB free"), "{alone}");
    // At q8_0 keys and values a position is 4 x 2 x 1024 / 32 blocks x 34 bytes = 8.5 KiB,
    // so the same context fits (1.06 GiB of KV).
    let compact = plan(&["--cache-type-k", "q8_0", "--cache-type-v", "q8_0"]);
    assert!(
        compact.contains("KV 8.5 KiB per token (K q8_0 / V q8_0)"),
        "{compact}"
    );
    assert!(compact.contains("all 131072 fit"), "{compact}");
    // A helper offering 2 GiB: the host keeps what fits in whole pages, the helper runs
    // layers 12..16 (DESIGN.md's share of 16), whose one full-attention layer mirrors 1 GiB.
    // Without measuring its speed (a prefill of 27B-sized layers, slow in a debug build).
    let helper = HelperProcess::start(model, &["--mem-budget", "2G"]);
    let url = helper.url.clone();
    let with = plan(&["--helper", &url, "--insecure", "--no-calibrate"]);
    let room = (8u64 << 30) - (1 << 30) - weights as u64;
    let budget_line = with
        .lines()
        .find(|l| l.contains("host KV tokens "))
        .unwrap();
    let budget: u64 = budget_line
        .split_whitespace()
        .nth(3)
        .and_then(|t| t.trim_end_matches(':').parse().ok())
        .unwrap_or_else(|| panic!("{with}"));
    // Room less the DeltaNet state and the activations (tens of MiB), in pages of 4096.
    assert!(
        budget.is_multiple_of(4096) && budget * 32768 <= room,
        "{with}"
    );
    assert!((room - budget * 32768) < (256 << 20), "{with}");
    assert!(with.contains("split layer 12: DESIGN.md's share"), "{with}");
    // Offering 512 MiB, it cannot mirror even the last cycle's 1 GiB: no split.
    drop(helper);
    let small = HelperProcess::start(model, &["--mem-budget", "512M"]);
    let url = small.url.clone();
    let with_small = plan(&["--helper", &url, "--insecure", "--no-calibrate"]);
    assert!(
        with_small.contains("split layer 16: the helper's 512.0 MiB offer cannot hold"),
        "{with_small}"
    );
    // The same shape as a preset planned as a Q4_K_M file would hold it, with no file and
    // a helper's offer given instead of a helper: the same choices (the preset's weights
    // also count the norms and conv kernels, a few MiB, so the budget may lose a page).
    let shape = tether(&[
        "plan",
        "--model",
        "qwen35-27b",
        "--layers",
        "16",
        "--weights-type",
        "q4_k_m",
        "--context",
        "131072",
        "--host-memory",
        "8G",
        "--cache-type-k",
        "f32",
        "--cache-type-v",
        "f32",
        "--helper-memory",
        "2G",
    ]);
    let shape = String::from_utf8(shape.stdout).unwrap();
    assert!(
        shape.contains("split layer 12: DESIGN.md's share"),
        "{shape}"
    );
    let budget_of = |text: &str| -> u64 {
        let line = text
            .lines()
            .find(|l| l.contains("host KV tokens "))
            .unwrap();
        line.split_whitespace()
            .nth(3)
            .unwrap()
            .trim_end_matches(':')
            .parse()
            .unwrap()
    };
    assert!(
        budget.abs_diff(budget_of(&shape)) <= 4096,
        "{with}\n{shape}"
    );
    assert!(
        shape.contains("context that fits at K f32 / V f32: ")
            && shape.contains("tokens with the helpers' 2.00 GiB offered"),
        "{shape}"
    );
    // A model's own file is planned as it is; helpers are offers or connections, not both.
    let refused = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_tether"))
            .args(args)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?}");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let err = refused(&["plan", "--model", model, "--weights-type", "q8_0"]);
    assert!(
        err.contains("its weights already have their types"),
        "{err}"
    );
    let err = refused(&[
        "plan",
        "--model",
        "tiny",
        "--helper-memory",
        "1G",
        "--helper",
        "ws://127.0.0.1:9",
    ]);
    assert!(
        err.contains("--helper-memory plans for helpers without connecting"),
        "{err}"
    );
}

/// `tether plan` with a helper measures its speed when it connects and gives it the layers
/// that balance the two pipeline stages by the times it prints; --no-calibrate keeps
/// DESIGN.md's share.
#[test]
fn plan_measures_the_helper_and_balances_the_split() {
    let model = ["--model", "tiny", "--layers", "16"];
    let helper = HelperProcess::start("tiny", &model[2..]);
    let plan = |extra: &[&str]| {
        let mut args = vec!["plan", "--context", "4096", "--insecure"];
        args.extend_from_slice(&model);
        args.extend_from_slice(&["--helper", &helper.url]);
        args.extend_from_slice(extra);
        String::from_utf8(tether(&args).stdout).unwrap()
    };
    let text = plan(&[]);
    let line = text
        .lines()
        .find(|l| l.contains("split layer "))
        .unwrap_or_else(|| panic!("{text}"));
    let number_after = |what: &str| -> f64 {
        let rest = &line[line.find(what).unwrap_or_else(|| panic!("{line}")) + what.len()..];
        let end = rest
            .find(|c: char| c != '.' && !c.is_ascii_digit())
            .unwrap();
        rest[..end].parse().unwrap()
    };
    assert!(line.contains("measured at connect on 32 rows"), "{line}");
    let (host, helper_ms) = (
        number_after("takes the host "),
        number_after("and the helper "),
    );
    let split = number_after("split layer ") as usize;
    // The printed times (to 0.1 ms) give the same choice: the slower stage is as fast as
    // any other split on the 4-layer grid makes it.
    let stage = |s: usize| ((s / 4) as f64 * host).max(((16 - s) / 4) as f64 * helper_ms);
    let best = [4, 8, 12]
        .map(stage)
        .into_iter()
        .fold(f64::INFINITY, f64::min);
    assert!(stage(split) <= best + 0.2, "{line}");
    assert!(
        line.contains(&format!(
            "layers {split}..16 on the helper balance the two stages"
        )),
        "{line}"
    );
    let fixed = plan(&["--no-calibrate"]);
    assert!(fixed.contains("DESIGN.md's share"), "{fixed}");
    assert!(!fixed.contains("measured at connect"), "{fixed}");
}

/// A `tether-helper --insecure` on loopback for `model`.
struct HelperProcess {
    child: std::process::Child,
    url: String,
    /// Its config folder, removed after the helper is killed (fields drop in order).
    _keys: Scratch,
}

impl HelperProcess {
    fn start(model: &str, extra: &[&str]) -> HelperProcess {
        let keys = scratch("helper-keys");
        let (child, lines) = tests::spawn_announcing_lines(
            Command::new(env!("CARGO_BIN_EXE_tether-helper"))
                .args(["--listen", "127.0.0.1:0", "--insecure", "--model", model])
                .args(extra)
                .env("TETHER_CONFIG_DIR", &*keys),
            1,
        );
        let url = lines[0].split_whitespace().last().unwrap().to_string();
        HelperProcess {
            child,
            url,
            _keys: keys,
        }
    }
}

impl Drop for HelperProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
