//! tether's quantisers (`engine_core::quant::Quantise`, through `Data::from_f32`) against
//! llama.cpp's own: the tensors `llama-quantize` wrote into `tests/fixtures/gguf`
//! (`scripts/llama-quantize-fixtures.sh`; without an importance matrix it runs ggml's reference
//! quantisers), quantised again here from the same f32 tensors, must be the same bytes.

use std::collections::BTreeMap;
use std::path::PathBuf;

use engine_core::gguf::{quantize, Gguf};
use engine_core::source::{load_tensors, LoadOptions};
use engine_core::tensor::{DType, Data};

fn fixture(name: &str) -> Vec<u8> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/gguf")
        .join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The f32 GGUF the tiny256 fixtures were quantised from (not committed): what
/// `tether quantize tiny256 X --type f32 --dtype f32 --weight-seed 3` writes, in memory.
fn tiny256_f32() -> Vec<u8> {
    let synth = LoadOptions {
        weight_dtype: "f32".into(),
        weight_seed: 3,
        ..LoadOptions::default()
    };
    let (config, tensors) = load_tensors("tiny256", &synth).unwrap();
    let mut out = Vec::new();
    let no_tokenizer = |_: &mut engine_core::gguf::Writer| Ok(());
    quantize::write(
        &config,
        &tensors,
        "tiny256",
        quantize::FileType::parse("f32").expect("f32 is a file type"),
        no_tokenizer,
        &mut out,
        &mut |_, _| {},
    )
    .unwrap();
    out
}

/// Quantises each quantised tensor of fixture `file` from the f32 tensor of the same name in
/// the GGUF `source`, asserts that the bytes are the file's, and returns how many tensors of
/// each type it compared.
fn requantise(file: &str, source: &[u8]) -> BTreeMap<&'static str, usize> {
    let bytes = fixture(file);
    let (src, quantised) = (Gguf::parse(source).unwrap(), Gguf::parse(&bytes).unwrap());
    let mut checked = BTreeMap::new();
    for t in quantised.tensors.iter().filter(|t| t.dtype.is_quantised()) {
        let s = (src.tensors.iter().find(|s| s.name == t.name))
            .unwrap_or_else(|| panic!("{file}: {} is not in the f32 source", t.name));
        assert_eq!(
            (s.dtype, &s.shape),
            (DType::F32, &t.shape),
            "{file}: {}",
            t.name
        );
        let values: Vec<f32> = bytemuck::pod_collect_to_vec(&source[s.range.clone()]);
        let ours = Data::from_f32(&values, t.dtype);
        let theirs = &bytes[t.range.clone()];
        let (elems, size) = t.dtype.block();
        let ours = ours.as_bytes();
        let blocks = ours.chunks(size).zip(theirs.chunks(size));
        let differ: Vec<usize> = (blocks.enumerate())
            .filter(|(_, (a, b))| a != b)
            .map(|(i, _)| i)
            .collect();
        if let Some(&i) = differ.first() {
            let row_len = t.shape.last().unwrap();
            panic!(
                "{file}: {} ({}, {:?}): {} of {} blocks differ from llama.cpp's, the first block \
                 {i} (row {}):\n tether    {:02x?}\n llama.cpp {:02x?}\n weights {:?}",
                t.name,
                t.dtype.name(),
                t.shape,
                differ.len(),
                theirs.len() / size,
                i * elems / row_len,
                &ours[i * size..][..size],
                &theirs[i * size..][..size],
                &values[i * elems..][..elems],
            );
        }
        *checked.entry(t.dtype.name()).or_default() += 1;
    }
    checked
}

/// Asserts that the files compared at least one tensor of each of `types` between them.
fn assert_compared(checked: &[BTreeMap<&str, usize>], types: &[&str]) {
    eprintln!("tensors compared byte for byte, per file: {checked:?}");
    for t in types {
        assert!(
            checked.iter().any(|c| c.contains_key(t)),
            "no {t} tensor was compared: {checked:?}"
        );
    }
}

/// The 64- and 128-wide tiny fixture, which `llama-quantize` writes as Q4_0, Q5_0, Q5_1 and
/// Q8_0 (rows that are not whole k-quant super-blocks fall back to these).
#[test]
fn the_32_weight_types_quantise_as_llama_quantize_does() {
    let source = fixture("tiny_fp32.f32.gguf");
    let files = [
        "tiny_fp32.q4_0.gguf",
        "tiny_fp32.q5_1.gguf",
        "tiny_fp32.q4_k_m.gguf",
    ];
    let checked = files.map(|f| requantise(f, &source));
    assert_compared(&checked, &["q4_0", "q5_0", "q5_1", "q8_0"]);
}

/// The tiny256 preset's 256-wide rows, which `llama-quantize` writes with Q2_K, Q3_K, Q4_K,
/// Q5_K, Q6_K and IQ4_XS tensors. (No fixture has IQ4_NL, the iq4_nl preset's type and the
/// IQ4_XS files' for rows that are not whole super-blocks: `engine_core::quant` tests it.)
#[test]
fn the_k_quants_and_iq4_xs_quantise_as_llama_quantize_does() {
    let source = tiny256_f32();
    let files = [
        "tiny256.q2_k.gguf",
        "tiny256.q3_k_m.gguf",
        "tiny256.q4_k_m.gguf",
        "tiny256.iq4_xs.gguf",
    ];
    let checked = files.map(|f| requantise(f, &source));
    assert_compared(
        &checked,
        &["q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_xs"],
    );
}

/// A partial block is refused, not dropped.
#[test]
#[should_panic(expected = "q4_k takes whole blocks of 256 weights, not 300")]
fn partial_blocks_are_refused() {
    Data::from_f32(&[0.0; 300], DType::Q4K);
}
