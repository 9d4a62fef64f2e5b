//! The `tether` binary as a user runs it.

use std::path::PathBuf;
use std::process::Command;

use tests::{fixtures_dir, max_abs_diff, Reference};

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

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tether-cli-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn read_eval(path: &PathBuf) -> Reference {
    Reference::from_bytes(&std::fs::read(path).unwrap())
}

#[test]
fn eval_reproduces_the_fixture_on_both_backends() {
    let r = Reference::load("tiny_fp32_T150");
    let dir = scratch("eval");
    let ids: Vec<String> = r.ids("prompt_ids").iter().map(u32::to_string).collect();
    std::fs::write(dir.join("ids.txt"), ids.join(", ")).unwrap();
    let model = fixtures_dir().join("tiny_fp32_T150");
    // On a Mac, Metal itself too (not run here: docs/PHONE.md).
    let backends: &[&str] = if cfg!(target_vendor = "apple") {
        &["cpu", "gpu", "metal"]
    } else {
        &["cpu", "gpu"]
    };
    for &backend in backends {
        let out = dir.join(format!("out-{backend}.safetensors"));
        tether(&[
            "eval",
            "--model",
            model.to_str().unwrap(),
            "--ids-file",
            dir.join("ids.txt").to_str().unwrap(),
            "--gen",
            "20",
            "--out",
            out.to_str().unwrap(),
            "--page-size",
            "64",
            "--backend",
            backend,
        ]);
        let got = read_eval(&out);
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

#[test]
fn bad_arguments_fail_with_a_message() {
    let out = Command::new(env!("CARGO_BIN_EXE_tether"))
        .args(["run", "--model", "no-such-model", "--prompt", "x"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("not a directory, nor a GGUF file, nor a preset"),
        "{err}"
    );
    // Metal itself is an Apple build's backend; elsewhere the error says what to use.
    let out = Command::new(env!("CARGO_BIN_EXE_tether"))
        .args([
            "run",
            "--model",
            "tiny",
            "--prompt",
            "x",
            "--backend",
            "metal",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--backend metal") && err.contains("--backend gpu"),
        "{err}"
    );
}

/// A Q8_0 GGUF runs from the command line on both backends, to the same tokens.
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
    assert_eq!(text("cpu"), text("gpu"));
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

/// `tether quantize` writes the file llama.cpp's converter writes from the same checkpoint
/// (tests/fixtures/gguf, made by `scripts/gguf-from-fixture.py`): every tensor's name, type,
/// shape and bytes, in f32, f16 and q8_0, and the same metadata values.
#[test]
fn quantize_writes_the_converters_file() {
    use engine_core::gguf::Gguf;
    let dir = scratch("quantize");
    let fixtures = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/gguf");
    let checkpoint = fixtures_dir().join("tiny_fp32");
    for t in ["f32", "f16", "q8_0"] {
        let out = dir.join(format!("tiny.{t}.gguf"));
        let _ = std::fs::remove_file(&out);
        tether(&[
            "quantize",
            checkpoint.to_str().unwrap(),
            out.to_str().unwrap(),
            "--type",
            t,
        ]);
        let ours = std::fs::read(&out).unwrap();
        let theirs = std::fs::read(format!("{fixtures}/tiny_fp32.{t}.gguf")).unwrap();
        let (a, b) = (Gguf::parse(&ours).unwrap(), Gguf::parse(&theirs).unwrap());
        assert_eq!(a.tensors.len(), b.tensors.len(), "{t}");
        for tb in &b.tensors {
            let ta = a
                .tensors
                .iter()
                .find(|x| x.name == tb.name)
                .unwrap_or_else(|| {
                    panic!("{t}: no {}", tb.name);
                });
            assert_eq!(
                (ta.dtype, &ta.shape),
                (tb.dtype, &tb.shape),
                "{t}: {}",
                tb.name
            );
            assert!(
                ours[ta.range.clone()] == theirs[tb.range.clone()],
                "{t}: {} differs",
                tb.name
            );
        }
        // The converter's name is title-cased; its rope sections come from the checkpoint's
        // mrope_section, which tether's config does not keep (they change nothing for text);
        // the vocabulary is the fixture script's, as the checkpoint has none.
        let skip = [
            "general.name",
            "general.size_label",
            "qwen35.rope.dimension_sections",
        ];
        for (k, v) in &b.metadata {
            if skip.contains(&k.as_str()) || k.starts_with("tokenizer.") {
                continue;
            }
            assert_eq!(a.get(k), Some(v), "{t}: metadata {k}");
        }
    }
    // A GGUF re-typed: the converter's f32 file as q8_0 is the converter's q8_0 file.
    let out = dir.join("re.q8_0.gguf");
    let _ = std::fs::remove_file(&out);
    let f32_file = format!("{fixtures}/tiny_fp32.f32.gguf");
    tether(&[
        "quantize",
        &f32_file,
        out.to_str().unwrap(),
        "--type",
        "q8_0",
    ]);
    let ours = std::fs::read(&out).unwrap();
    let theirs = std::fs::read(format!("{fixtures}/tiny_fp32.q8_0.gguf")).unwrap();
    let (a, b) = (Gguf::parse(&ours).unwrap(), Gguf::parse(&theirs).unwrap());
    for tb in &b.tensors {
        let ta = a.tensors.iter().find(|x| x.name == tb.name).unwrap();
        assert!(
            ours[ta.range.clone()] == theirs[tb.range.clone()],
            "{}",
            tb.name
        );
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
    let q4 = Command::new(env!("CARGO_BIN_EXE_tether"))
        .args([
            "quantize",
            "tiny",
            dir.join("x.gguf").to_str().unwrap(),
            "--type",
            "q4_k",
        ])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&q4.stderr).contains("expected f32, f16, bf16 or q8_0"));
}
