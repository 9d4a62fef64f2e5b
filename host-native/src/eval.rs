//! `tether eval`: the fixtures' tensors (prefill logits, greedy ids and their logits) for any
//! list of token ids, so tether can be compared with another engine or a new reference.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use engine_core::backend::KvType;
use engine_core::generate::argmax;
use engine_core::weights::{save_raw, RawTensor};
use engine_core::Logits;
use safetensors::Dtype;

use crate::load::EngineArgs;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    engine: EngineArgs,
    /// Token ids separated by whitespace or commas (brackets are ignored, so a JSON array works).
    #[arg(long)]
    ids_file: PathBuf,
    /// Greedy tokens to generate after the prompt.
    #[arg(long, default_value_t = 0)]
    gen: usize,
    #[arg(long)]
    out: PathBuf,
}

fn parse_ids(text: &str) -> Result<Vec<u32>> {
    text.split(|c: char| c.is_whitespace() || c == ',' || c == '[' || c == ']')
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.parse::<u32>()
                .with_context(|| format!("`{s}` is not a token id"))
        })
        .collect()
}

pub fn run(a: Args) -> Result<()> {
    a.engine.start(false)?;
    let text = std::fs::read_to_string(&a.ids_file)
        .with_context(|| format!("reading {}", a.ids_file.display()))?;
    let ids = parse_ids(&text).with_context(|| format!("{}", a.ids_file.display()))?;
    if ids.is_empty() {
        bail!("{}: no token ids", a.ids_file.display());
    }
    let model = a.engine.load(None)?.model;
    let (be, what) = a.engine.backend_for(&model)?;
    let be = &*be;
    eprintln!("backend: {what}; weights: {}", crate::load::residence());
    let v = model.config.vocab_size;
    let context = ids.len() + a.gen;
    // The fixtures are checked against exact pages unless compact ones are asked for.
    let types = a.engine.cache.types_or(KvType::F32);
    let (_, mut seq, _) = a
        .engine
        .session(&model, be, (context, ids.len()), None, types)?;
    let prefill = seq.forward(&model, be, &ids, Logits::All, None)?;
    let mut gen_ids: Vec<i64> = Vec::with_capacity(a.gen);
    let mut gen_logits: Vec<f32> = Vec::with_capacity(a.gen * v);
    let mut logits = prefill[prefill.len() - v..].to_vec();
    for i in 0..a.gen {
        let next = argmax(&logits);
        gen_ids.push(next as i64);
        gen_logits.extend_from_slice(&logits);
        if i + 1 < a.gen {
            logits = seq.forward(&model, be, &[next], Logits::Last, None)?;
        }
    }
    let tensors = vec![
        (
            "gen_ids".to_string(),
            RawTensor {
                dtype: Dtype::I64,
                shape: vec![a.gen],
                bytes: bytemuck::cast_slice(&gen_ids),
            },
        ),
        (
            "gen_logits".to_string(),
            RawTensor {
                dtype: Dtype::F32,
                shape: vec![a.gen, v],
                bytes: bytemuck::cast_slice(&gen_logits),
            },
        ),
        (
            "prefill_logits".to_string(),
            RawTensor {
                dtype: Dtype::F32,
                shape: vec![ids.len(), v],
                bytes: bytemuck::cast_slice(&prefill),
            },
        ),
    ];
    save_raw(&tensors, &a.out)?;
    eprintln!(
        "wrote {} ({} prompt tokens, {} generated)",
        a.out.display(),
        ids.len(),
        a.gen
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn ids_parse_from_whitespace_commas_and_json() {
        assert_eq!(
            super::parse_ids("1 2,3\n[4, 5]").unwrap(),
            vec![1, 2, 3, 4, 5]
        );
        assert!(super::parse_ids("1 x").is_err());
    }
}
