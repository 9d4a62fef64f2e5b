//! GGUF files written by llama.cpp's own converter (`convert_hf_to_gguf.py` at upstream
//! 0c1e57098, through `scripts/gguf-from-fixture.py`) from the fixture checkpoints, in
//! `tests/fixtures/gguf/`: tether must read the converter's layout (names, +1 norms, `ssm_a`,
//! the squeezed conv, value heads tiled since the fixtures have 2 key heads and 4 value heads)
//! and give the fixtures' logits.

use std::path::PathBuf;

use engine_core::backend::gpu::{GpuBackend, GpuOptions};
use engine_core::tensor::DType;
use engine_core::{Backend, CpuBackend, Logits, Model};
use tests::{fixtures_dir, max_abs_diff, Reference};

fn gguf(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("fixtures/gguf/{name}"))
}

fn load(name: &str) -> Model {
    let (config, tensors) = engine_core::gguf::qwen35::load(&gguf(name)).expect("GGUF loads");
    Model::from_tensors(config, &tensors).expect("GGUF builds")
}

/// Prefill logits of every position, then `n` greedy steps: the ids and all logits.
fn run(model: &Model, prompt: &[u32], n: usize) -> (Vec<f32>, Vec<u32>, Vec<f32>) {
    run_on(&CpuBackend, model, prompt, n)
}

fn run_on(
    be: &dyn Backend,
    model: &Model,
    prompt: &[u32],
    n: usize,
) -> (Vec<f32>, Vec<u32>, Vec<f32>) {
    decode(be, model, prompt, n, |_, logits| argmax(logits))
}

/// Prefill logits of every position, then the logits of each step fed `ids` in turn (as
/// another run chose them), so that two runs are compared on the same tokens.
fn run_forced(model: &Model, prompt: &[u32], ids: &[u32]) -> (Vec<f32>, Vec<f32>) {
    let (prefill, _, gen) = decode(&CpuBackend, model, prompt, ids.len(), |i, _| ids[i]);
    (prefill, gen)
}

/// Prefill, then `n` decode steps, each feeding `next(step, logits)`: the prefill logits, the
/// ids fed and the logits each step chose from.
fn decode(
    be: &dyn Backend,
    model: &Model,
    prompt: &[u32],
    n: usize,
    next: impl Fn(usize, &[f32]) -> u32,
) -> (Vec<f32>, Vec<u32>, Vec<f32>) {
    let mut st = model.new_state(16);
    let prefill = model
        .forward(be, &mut st, prompt, Logits::All, None)
        .unwrap();
    let vocab = model.config.vocab_size;
    let mut logits = prefill[prefill.len() - vocab..].to_vec();
    let (mut ids, mut all) = (Vec::new(), Vec::new());
    for step in 0..n {
        all.extend_from_slice(&logits);
        let id = next(step, &logits);
        ids.push(id);
        logits = model
            .forward(be, &mut st, &[id], Logits::Last, None)
            .unwrap();
    }
    (prefill, ids, all)
}

fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

#[test]
fn the_converters_f32_gguf_gives_the_fixtures_logits() {
    for fixture in ["tiny_fp32", "tiny_fp32_T150"] {
        let model = load(&format!("{fixture}.f32.gguf"));
        let r = Reference::load(fixture);
        let want = r.ids("gen_ids");
        let (prefill, ids, gen) = run(&model, &r.ids("prompt_ids"), want.len());
        let d = max_abs_diff(&prefill, &r.f32("prefill_logits").1);
        assert!(d < 1e-4, "{fixture}: prefill logits differ by {d}");
        assert_eq!(ids, want, "{fixture}: greedy ids");
        let d = max_abs_diff(&gen, &r.f32("gen_logits").1);
        assert!(d < 1e-4, "{fixture}: generation logits differ by {d}");
    }
}

/// The same file on the GPU backend (lavapipe in CI): the WGSL delta rule's tiled value heads.
#[test]
fn the_converters_gguf_runs_on_the_gpu() {
    let gpu = GpuBackend::new(&GpuOptions::default()).expect("a GPU adapter (lavapipe)");
    let model = load("tiny_fp32.f32.gguf");
    let r = Reference::load("tiny_fp32");
    let want = r.ids("gen_ids");
    let (prefill, ids, gen) = run_on(&gpu, &model, &r.ids("prompt_ids"), want.len());
    let d = max_abs_diff(&prefill, &r.f32("prefill_logits").1);
    assert!(d < 1e-4, "prefill logits differ by {d}");
    assert_eq!(ids, want);
    let d = max_abs_diff(&gen, &r.f32("gen_logits").1);
    assert!(d < 1e-4, "generation logits differ by {d}");
    // The Q8_0 file on the device (weights.wgsl's Q8_0 blocks, f32 activations) against the
    // CPU's run of its weights dequantised to f32.
    let q8 = load("tiny_fp32.q8_0.gguf");
    let (cpu_prefill, cpu_ids, cpu_gen) = run(
        &dequantised("tiny_fp32.q8_0.gguf").1,
        &r.ids("prompt_ids"),
        8,
    );
    let (prefill, ids, gen) = run_on(&gpu, &q8, &r.ids("prompt_ids"), 8);
    let d = max_abs_diff(&prefill, &cpu_prefill).max(max_abs_diff(&gen, &cpu_gen));
    assert!(d < 1e-4, "Q8_0 on the GPU differs from the CPU by {d}");
    assert_eq!(ids, cpu_ids);
}

/// A GGUF with every quantised tensor dequantised to f32 (the reference its quantised run is
/// held to), and the quantised types it held.
fn dequantised(name: &str) -> (std::collections::BTreeSet<&'static str>, Model) {
    use engine_core::tensor::{Data, Elems};
    let (config, mut tensors) = engine_core::gguf::qwen35::load(&gguf(name)).unwrap();
    let mut types = std::collections::BTreeSet::new();
    for t in tensors.values_mut() {
        if t.dtype().is_quantised() {
            types.insert(t.dtype().name());
            t.data = Data::F32(Elems::Owned(t.data.to_f32_vec().into()));
        }
    }
    (types, Model::from_tensors(config, &tensors).unwrap())
}

/// How far a quantised model's logits may be from its dequantised weights': decode's integer
/// kernels round the activations to 8 bits per block of the weight type
/// (`matmul::activation_rounding`), as llama.cpp does, which moves each product by up to ~1% of
/// its magnitude; through the layers of these random weights, whose recurrent state carries
/// the noise from step to step, the logits moved by up to 5.6e-2 of the largest in the tests
/// below (Q8_0, 20 steps; prefill, on gemm's f32 path, stays within f32 rounding).
const ACTIVATION_ROUNDING_REL: f32 = 0.1;

/// Largest difference of `a` from `b`, relative to the largest magnitude in `b`.
fn rel_diff(a: &[f32], b: &[f32]) -> f32 {
    max_abs_diff(a, b) / b.iter().fold(1e-6f32, |m, v| m.max(v.abs()))
}

/// Runs GGUF `file`'s weights dequantised on `prompt` for `n` greedy steps, and the file itself
/// on the same tokens, and checks decode: logits within [`ACTIVATION_ROUNDING_REL`], and the
/// same greedy choice at every step but where the dequantised run's top two logits are closer
/// than twice the two runs' difference there. Returns the quantised types and both runs'
/// prefill logits (quantised first; each caller holds them to its own tolerance).
fn decode_matches_dequantised(
    file: &str,
    prompt: &[u32],
    n: usize,
) -> (std::collections::BTreeSet<&'static str>, [Vec<f32>; 2]) {
    let (types, dequantised) = dequantised(file);
    let (b, ids, gen_b) = run(&dequantised, prompt, n);
    let (a, gen_a) = run_forced(&load(file), prompt, &ids);
    let d = rel_diff(&gen_a, &gen_b);
    eprintln!("{file} decode against its dequantised weights: {d:e} of the largest logit");
    assert!(
        d < ACTIVATION_ROUNDING_REL,
        "{file} ({types:?}) decode against its dequantised weights: {d}"
    );
    let vocab = gen_a.len() / n;
    for (step, (qa, qb)) in gen_a.chunks(vocab).zip(gen_b.chunks(vocab)).enumerate() {
        if argmax(qa) != ids[step] {
            let noise = max_abs_diff(qa, qb);
            let m = margin(qb);
            assert!(
                m < 2.0 * noise,
                "{file} step {step}: the choice moved, though the margin {m} is over twice the difference {noise}"
            );
        }
    }
    (types, [a, b])
}

/// Whether this CPU's prefill multiplies one of `types` in integers (Q4_K on AVX2 without
/// AVX-512; Q8_0, Q4_0 and Q4_K with AVX-512 VNNI: `matmul::integer_prefill`), rounding its
/// activations to 8 bits as decode does.
fn integer_prefill(types: &std::collections::BTreeSet<&str>) -> bool {
    types.iter().any(|t| {
        engine_core::backend::cpu::matmul::integer_prefill(DType::parse(t).expect("a type name"))
    })
}

/// The gap between the largest two logits of a row.
fn margin(row: &[f32]) -> f32 {
    let mut row = row.to_vec();
    row.sort_by(|a, b| b.total_cmp(a));
    row[0] - row[1]
}

/// The converter's config is the checkpoint's, read back from its metadata.
#[test]
fn the_config_is_read_from_the_metadata() {
    let (config, _) = engine_core::gguf::qwen35::load(&gguf("tiny_fp32.f32.gguf")).unwrap();
    let text = std::fs::read_to_string(fixtures_dir().join("tiny_fp32/config.json")).unwrap();
    let hf = engine_core::ModelConfig::from_json_str(&text).unwrap();
    assert_eq!(config.layout, engine_core::config::WeightLayout::Gguf);
    let as_hf = engine_core::ModelConfig {
        layout: hf.layout,
        eos_token_ids: hf.eos_token_ids.clone(),
        ..config
    };
    assert_eq!(as_hf, hf);
}

/// f16 and bf16 files hold the same weights rounded (the matrices; norms and gates stay f32):
/// tether reading them gives what tether gives on the same rounding from safetensors.
#[test]
fn half_precision_ggufs_match_the_same_weights_from_safetensors() {
    for (file, fixture, dtype) in [
        (
            "tiny_fp32.f16.gguf",
            "tiny_fp32",
            engine_core::tensor::DType::F16,
        ),
        (
            "tiny_bf16.bf16.gguf",
            "tiny_bf16",
            engine_core::tensor::DType::BF16,
        ),
    ] {
        let ours = load(file);
        let dir = fixtures_dir().join(fixture);
        let config = Model::read_config(&dir).unwrap();
        let mut tensors = engine_core::weights::load_dir(&dir).unwrap();
        for t in tensors.values_mut() {
            if t.shape.len() == 2 {
                t.data = engine_core::tensor::Data::from_f32(&t.data.to_f32_vec(), dtype);
            }
        }
        let reference = Model::from_tensors(config, &tensors).unwrap();
        let prompt = Reference::load(fixture).ids("prompt_ids");
        let (a, ids_a, gen_a) = run(&ours, &prompt, 8);
        let (b, ids_b, gen_b) = run(&reference, &prompt, 8);
        let d = max_abs_diff(&a, &b).max(max_abs_diff(&gen_a, &gen_b));
        eprintln!("{file}: logits within {d}");
        assert!(d < 1e-4, "{file}: logits differ by {d}");
        assert_eq!(ids_a, ids_b, "{file}");
    }
}

/// A GGUF holding the fixture tokenizer as the converter writes it: every id's token in id
/// order (`[PADn]` where the tokenizer has none), its type (1 normal, 3 the added special
/// tokens, 5 unused), the merges as `"a b"`, the pre-tokenizer's name. These rules were checked
/// once against `convert_hf_to_gguf.py --vocab-only` on the same tokenizer.json (the three
/// arrays were equal); the converter's file is 16 MB, so the test builds its own.
fn vocab_gguf(chat_template: &str) -> Vec<u8> {
    use engine_core::gguf::{Value, Writer};
    let path = fixtures_dir().join("tokenizer/tokenizer.json");
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    let n = 248_320;
    let mut tokens: Vec<Option<String>> = vec![None; n];
    let mut types = vec![5i32; n];
    for (text, id) in json["model"]["vocab"].as_object().unwrap() {
        let id = id.as_u64().unwrap() as usize;
        tokens[id] = Some(text.clone());
        types[id] = 1;
    }
    for a in json["added_tokens"].as_array().unwrap() {
        let id = a["id"].as_u64().unwrap() as usize;
        tokens[id] = Some(a["content"].as_str().unwrap().to_string());
        types[id] = if a["special"].as_bool().unwrap() {
            3
        } else {
            4
        };
    }
    let merges = json["model"]["merges"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            Value::Str(format!(
                "{} {}",
                p[0].as_str().unwrap(),
                p[1].as_str().unwrap()
            ))
        })
        .collect();
    let mut w = Writer::new();
    w.meta("general.architecture", Value::Str("qwen35".into()))
        .meta("tokenizer.ggml.model", Value::Str("gpt2".into()))
        .meta("tokenizer.ggml.pre", Value::Str("qwen35".into()))
        .meta(
            "tokenizer.ggml.tokens",
            Value::Array(
                tokens
                    .into_iter()
                    .enumerate()
                    .map(|(i, t)| Value::Str(t.unwrap_or_else(|| format!("[PAD{i}]"))))
                    .collect(),
            ),
        )
        .meta(
            "tokenizer.ggml.token_type",
            Value::Array(types.into_iter().map(Value::I32).collect()),
        )
        .meta("tokenizer.ggml.merges", Value::Array(merges))
        .meta("tokenizer.ggml.eos_token_id", Value::U32(248_046))
        .meta("tokenizer.chat_template", Value::Str(chat_template.into()));
    w.to_bytes()
}

#[test]
fn the_tokenizer_in_a_gguf_encodes_as_its_tokenizer_json() {
    use engine_core::gguf::{vocab, Gguf};
    use engine_core::tokenizer::{ChatMessage, Tokenizer};
    // ChatML with a system turn of its own, so the test sees that this template is used.
    let template = "<|im_start|>system\nbe brief<|im_end|>\n{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
    let bytes = vocab_gguf(template);
    let ours = vocab::tokenizer(&Gguf::parse(&bytes).unwrap())
        .unwrap()
        .expect("a real vocabulary");
    let reference = Tokenizer::from_dir(fixtures_dir().join("tokenizer")).unwrap();
    let text = std::fs::read_to_string(fixtures_dir().join("tokenizer/samples.json")).unwrap();
    let samples: serde_json::Value = serde_json::from_str(&text).unwrap();
    for s in samples["samples"].as_array().unwrap() {
        let text = s["text"].as_str().unwrap();
        let want: Vec<u32> = s["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(ours.encode(text).unwrap(), want, "{text:?}");
        assert_eq!(
            ours.decode(&want).unwrap(),
            reference.decode(&want).unwrap()
        );
    }
    // The template, and user text kept from spelling special tokens: the reference (no
    // template in its directory) renders ChatML, given the same system turn.
    let user = ChatMessage::new("user", "hi <|im_end|> there");
    let system = ChatMessage::new("system", "be brief");
    assert_eq!(
        ours.encode_chat(std::slice::from_ref(&user), true).unwrap(),
        reference.encode_chat(&[system, user], true).unwrap()
    );
    assert_eq!(ours.vocab_size(), reference.vocab_size());
}

/// The converter's own Q8_0 file (`--outtype q8_0`: every matrix Q8_0, norms and gates f32).
/// Its logits are those of the same weights dequantised to f32 (by ggml's definition, computed
/// here) within f32 rounding; against the f32 fixture they differ by the quantisation, and the
/// greedy tokens stay the fixture's for as many steps as the margin below allows.
#[test]
fn the_converters_q8_0_gguf_computes_its_dequantised_weights() {
    use engine_core::tensor::Data;
    let r = Reference::load("tiny_fp32");
    let prompt = r.ids("prompt_ids");
    let want = r.ids("gen_ids");
    let file = "tiny_fp32.q8_0.gguf";
    let (types, [a, b]) = decode_matches_dequantised(file, &prompt, want.len());
    let (_, ids_a, _) = run(&load(file), &prompt, want.len());
    assert_eq!(types.iter().copied().collect::<Vec<_>>(), ["q8_0"]);
    // Prefill in f32 (gemm) is the dequantised weights' within f32 rounding; where it
    // multiplies in integers, its activations are rounded as decode's are.
    if integer_prefill(&types) {
        let d = rel_diff(&a, &b);
        assert!(
            d < ACTIVATION_ROUNDING_REL,
            "Q8_0 integer prefill against its dequantised weights: {d}"
        );
    } else {
        let d = max_abs_diff(&a, &b);
        assert!(
            d < 1e-4,
            "Q8_0 prefill against its dequantised weights: {d}"
        );
    }
    // tether's Q8_0 quantiser gives the converter's blocks, byte for byte (a matrix the
    // converter does not permute).
    let hf = engine_core::weights::load_dir(&fixtures_dir().join("tiny_fp32")).unwrap();
    let name = "model.layers.0.mlp.gate_proj.weight";
    let ours = Data::from_f32(
        &hf[name].data.to_f32_vec(),
        engine_core::tensor::DType::Q8_0,
    );
    let (_, file) = engine_core::gguf::qwen35::load(&gguf("tiny_fp32.q8_0.gguf")).unwrap();
    assert_eq!(ours.as_bytes(), file[name].data.as_bytes());
    // Against the f32 fixture: quantisation noise. The greedy ids may part only where the
    // f32 run's top two logits were closer than twice the noise seen in the prefill.
    let vs_f32 = max_abs_diff(&a, &r.f32("prefill_logits").1);
    let same = ids_a.iter().zip(&want).take_while(|(a, b)| a == b).count();
    let f32_gen = r.f32("gen_logits").1;
    let margin = |step: usize| margin(&f32_gen[step * 256..(step + 1) * 256]);
    eprintln!(
        "Q8_0 vs the f32 fixture: prefill logits within {vs_f32}; greedy ids equal for {same} of \
         {} steps",
        want.len()
    );
    assert!(
        vs_f32 < 1.0,
        "Q8_0 prefill logits differ from f32 by {vs_f32}"
    );
    if same < want.len() {
        let m = margin(same);
        eprintln!("first difference at step {same}, where the f32 margin is {m}");
        assert!(
            m < 2.0 * vs_f32,
            "Q8_0 left the f32 ids at step {same}, whose margin {m} the noise cannot explain"
        );
    }
}

/// Blocks of every quantised type tether reads (random, with finite scales) against their
/// values as llama.cpp's gguf-py dequantises them (`scripts/quant-fixture.py` wrote both into
/// quants.gguf): equal bit for bit; and tether's products with them, on the dot-product path
/// and gemm's, against an f64 product of those values.
#[test]
fn quantised_types_dequantise_as_llama_cpp_does_and_multiply() {
    use engine_core::backend::cpu::matmul;
    use engine_core::gguf::Gguf;
    use engine_core::tensor::{DType, Data, Matrix, SharedBytes};
    let bytes = std::fs::read(gguf("quants.gguf")).unwrap();
    let g = Gguf::parse(&bytes).unwrap();
    let shared: SharedBytes = std::sync::Arc::new(bytes.clone());
    let find = |name: &str| g.tensors.iter().find(|t| t.name == name).unwrap().clone();
    let names = [
        "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "iq4_nl", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k",
        "iq4_xs",
    ];
    for name in names {
        let (q, f) = (find(name), find(&format!("{name}.f32")));
        assert_eq!(Some(q.dtype), DType::parse(name));
        let data = Data::from_bytes(q.dtype, &shared, q.range.clone());
        let want: Vec<f32> = bytes[f.range.clone()]
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let got = data.to_f32_vec();
        assert!(
            got.iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{name}: dequantised values differ from gguf-py's"
        );
        let [rows, cols] = q.shape[..] else { panic!() };
        let w = Matrix { rows, cols, data };
        for t in [1, 2, 3, 4, 6, 20] {
            let x: Vec<f32> = (0..t * cols)
                .map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 500.0)
                .collect();
            let mut out = vec![0.0; t * rows];
            matmul::matmul(&x, &w, &mut out);
            for r in 0..t {
                for o in 0..rows {
                    let terms =
                        (0..cols).map(|i| x[r * cols + i] as f64 * want[o * cols + i] as f64);
                    let (sum, mag) = terms.fold((0.0, 0.0), |(s, m), p| (s + p, m + p.abs()));
                    let tol = 4.0 * f32::EPSILON as f64 * (cols as f64).sqrt() * mag
                        + matmul::activation_rounding(
                            &x[r * cols..][..cols],
                            &want[o * cols..][..cols],
                            q.dtype,
                        )
                        + 1e-30;
                    let got = out[r * rows + o] as f64;
                    assert!(
                        (got - sum).abs() <= tol,
                        "{name} t={t} [{r},{o}]: {got} vs {sum}"
                    );
                }
            }
        }
    }
}

/// A model with a Q3_K matrix runs on the CPU, and the GPU backend, which has no Q3_K kernel
/// (its k-quants are Q4_K, Q5_K and Q6_K), refuses it before anything runs (what
/// `tether run --backend gpu` and a GPU helper report).
#[test]
fn the_gpu_backend_refuses_k_quant_weights_up_front() {
    use engine_core::tensor::{BlockQ3K, DType, Data, Elems};
    let mut config = engine_core::synth::preset("tiny").unwrap();
    config.hidden_size = 256;
    let mut tensors = engine_core::synth::random_weights(&config, DType::F32, 1).unwrap();
    let name = "model.layers.0.mlp.gate_proj.weight";
    let shape = tensors[name].shape.clone();
    let mut rng = tests::Rng(5);
    let mut byte = || (rng.uniform() * 255.0) as u8;
    let blocks: Vec<BlockQ3K> = (0..shape[0] * shape[1] / 256)
        .map(|_| BlockQ3K {
            hmask: std::array::from_fn(|_| byte()),
            qs: std::array::from_fn(|_| byte()),
            scales: std::array::from_fn(|_| byte()),
            d: half::f16::from_f32(f32::from(byte()) / 255.0 * 0.01),
        })
        .collect();
    tensors.get_mut(name).unwrap().data = Data::Q3K(Elems::Owned(blocks.into()));
    let model = Model::from_tensors(config, &tensors).unwrap();
    model.check_backend(&CpuBackend).unwrap();
    let (prefill, _, _) = run(&model, &[1, 2, 3], 2);
    assert!(prefill.iter().all(|v| v.is_finite()));
    let gpu = GpuBackend::new(&GpuOptions::default()).expect("a GPU adapter (lavapipe)");
    let e = model.check_backend(&gpu).unwrap_err().to_string();
    assert!(e.contains("cannot compute with q3_k weights"), "{e}");
}

/// `llama-quantize`'s Q4_0 and Q4_K_M files on the GPU backend (weights.wgsl's Q4_0, Q5_0,
/// Q8_0, Q4_K and Q6_K blocks, dequantised as read, f32 activations), and Q5_K (which no
/// fixture holds: tiny256.q4_k_m's Q4_K matrices requantised), give the CPU's logits of the
/// same weights dequantised to f32 within 1e-4, and the CPU's own prefill of the quantised
/// weights (gemm's f32 path); files with a type that has no GPU kernel (Q2_K, Q3_K, IQ4_XS) are
/// refused with a message before anything runs.
#[test]
fn llama_quantize_outputs_run_on_the_gpu() {
    use engine_core::tensor::{DType, Data, Elems};
    let gpu = GpuBackend::new(&GpuOptions::default()).expect("a GPU adapter (lavapipe)");
    let prompt = Reference::load("tiny_fp32").ids("prompt_ids");
    let cases = [
        ("tiny_fp32.q4_0.gguf", None, &["q4_0", "q8_0"][..]),
        ("tiny_fp32.q4_k_m.gguf", None, &["q5_0", "q8_0"][..]),
        ("tiny256.q4_k_m.gguf", None, &["q4_k", "q6_k"][..]),
        (
            "tiny256.q4_k_m.gguf",
            Some(DType::Q5K),
            &["q5_k", "q6_k"][..],
        ),
    ];
    for (file, q4k_as, want_types) in cases {
        let (config, mut tensors) = engine_core::gguf::qwen35::load(&gguf(file)).unwrap();
        let mut plain = tensors.clone();
        let mut types = std::collections::BTreeSet::new();
        for (name, t) in &mut tensors {
            if let Some(to) = q4k_as.filter(|_| t.dtype() == DType::Q4K) {
                t.data = Data::from_f32(&t.data.to_f32_vec(), to);
            }
            if t.dtype().is_quantised() {
                types.insert(t.dtype().name());
                plain.get_mut(name).unwrap().data =
                    Data::F32(Elems::Owned(t.data.to_f32_vec().into()));
            }
        }
        assert_eq!(types.iter().copied().collect::<Vec<_>>(), want_types);
        let model = Model::from_tensors(config.clone(), &tensors).unwrap();
        let dequantised = Model::from_tensors(config, &plain).unwrap();
        model.check_backend(&gpu).unwrap();
        let (cpu_prefill, cpu_ids, cpu_gen) = run(&dequantised, &prompt, 4);
        let (quant_prefill, _, _) = run(&model, &prompt, 0);
        let (prefill, ids, gen) = run_on(&gpu, &model, &prompt, 4);
        let d = max_abs_diff(&prefill, &cpu_prefill).max(max_abs_diff(&gen, &cpu_gen));
        let dq = max_abs_diff(&prefill, &quant_prefill);
        eprintln!("{file} {types:?} on the GPU: {d:.2e} from the CPU's, prefill {dq:.2e}");
        assert!(
            d < 1e-4,
            "{file} {types:?} on the GPU differs from the CPU by {d}"
        );
        // Where the CPU's prefill multiplies a type in integers (Q4_K on AVX2 without
        // AVX-512), its activations are rounded to 8 bits and the GPU's are not: `d` above
        // holds the GPU to the dequantised weights instead.
        if !integer_prefill(&types) {
            assert!(dq < 1e-4, "{file} {types:?}: GPU prefill differs by {dq}");
        }
        assert_eq!(ids, cpu_ids, "{file} {types:?}: greedy ids");
    }
    for (file, refused) in [
        ("tiny256.q2_k.gguf", "q2_k"),
        ("tiny256.q3_k_m.gguf", "q3_k"),
        ("tiny256.iq4_xs.gguf", "iq4_xs"),
    ] {
        let e = load(file).check_backend(&gpu).unwrap_err().to_string();
        assert!(
            e.contains(&format!("cannot compute with {refused} weights")),
            "{file}: {e}"
        );
    }
}

/// The end token comes from tokenizer_config.json, else from the model's config (as the
/// converter falls back to config.json): without one llama.cpp takes id 11, `,` in Qwen's
/// vocabulary, and stops at every comma.
#[test]
fn quantize_names_the_end_token_from_the_config_when_the_tokenizer_does_not() {
    use engine_core::gguf::{quantize, Gguf, Value, Writer};
    let json = std::fs::read(fixtures_dir().join("tokenizer/tokenizer.json")).unwrap();
    let mut config = engine_core::synth::preset("qwen35-0.8b").unwrap();
    for (tokenizer_config, want) in [
        (None, 248_046),
        (Some(r#"{"eos_token": "<|endoftext|>"}"#), 248_044),
    ] {
        let mut w = Writer::new();
        quantize::tokenizer_metadata(&mut w, &json, tokenizer_config, &config).unwrap();
        let bytes = w.to_bytes();
        let g = Gguf::parse(&bytes).unwrap();
        assert_eq!(
            g.get("tokenizer.ggml.eos_token_id"),
            Some(&Value::U32(want))
        );
    }
    config.eos_token_ids.clear();
    let mut w = Writer::new();
    quantize::tokenizer_metadata(&mut w, &json, None, &config).unwrap();
    assert!(Gguf::parse(&w.to_bytes())
        .unwrap()
        .get("tokenizer.ggml.eos_token_id")
        .is_none());
}

/// Files as llama.cpp's `llama-quantize` writes them (`scripts/llama-quantize-fixtures.sh`),
/// between them holding every type tether reads but IQ4_NL (whose blocks `quants.gguf` tests):
/// each runs, and its logits are those of the same weights dequantised to f32 within f32
/// rounding, so every matrix is read in its layout and type (the dequantised values themselves
/// are checked against gguf-py above).
#[test]
fn llama_quantize_outputs_compute_their_dequantised_weights() {
    let files = [
        "tiny_fp32.q4_0.gguf",
        "tiny_fp32.q5_1.gguf",
        "tiny_fp32.q4_k_m.gguf",
        "tiny256.q2_k.gguf",
        "tiny256.q3_k_m.gguf",
        "tiny256.q4_k_m.gguf",
        "tiny256.iq4_xs.gguf",
    ];
    let prompt = Reference::load("tiny_fp32").ids("prompt_ids");
    for file in files {
        let (types, [a, b]) = decode_matches_dequantised(file, &prompt, 4);
        assert!(types.len() >= 2, "{file}: {types:?}");
        let tol = if integer_prefill(&types) {
            ACTIVATION_ROUNDING_REL
        } else {
            1e-5
        };
        let d = rel_diff(&a, &b);
        assert!(
            d < tol,
            "{file} ({types:?}) prefill against its dequantised weights: {d}"
        );
    }
}
