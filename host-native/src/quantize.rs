//! `tether quantize IN OUT --type q8_0`: a checkpoint directory, a GGUF or a preset written as a
//! `qwen35` GGUF in the converter's layout (`engine_core::gguf::quantize`), with the tokenizer
//! of the directory (`tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja`) or the
//! GGUF it came from.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use engine_core::gguf::{self, quantize};
use engine_core::source::{load_tensors, LoadOptions};
use indicatif::{ProgressBar, ProgressStyle};

#[derive(clap::Args)]
pub struct Args {
    /// A Qwen3.5 checkpoint directory, a GGUF file, or a preset.
    input: String,
    /// The GGUF to write.
    output: PathBuf,
    /// The file type, as llama.cpp names it: f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1,
    /// q2_k, q3_k_s, q3_k_m (or q3_k), q3_k_l, q4_k_s, q4_k_m (or q4_k), q5_k_s, q5_k_m (or
    /// q5_k), q6_k, iq4_nl, iq4_xs. The matrices take the types `llama-quantize` gives them
    /// (the output in Q6_K, some value, down and output projections higher in the mixes);
    /// norms, `ssm_a`, `ssm_dt` and the conv kernel stay f32.
    #[arg(long = "type", default_value = "q8_0")]
    dtype: String,
    #[command(flatten)]
    synth: LoadOptions,
}

/// The llama.cpp file type `s` names, given as `flag`; an error lists the names.
pub fn file_type(flag: &str, s: &str) -> Result<quantize::FileType> {
    quantize::FileType::parse(s).with_context(|| {
        format!(
            "{flag} {s}: expected one of {}",
            quantize::FileType::names()
        )
    })
}

pub fn run(a: Args) -> Result<()> {
    let target = file_type("--type", &a.dtype)?;
    if a.output.exists() {
        bail!(
            "{} exists; tether does not overwrite it",
            a.output.display()
        );
    }
    let (config, tensors) =
        load_tensors(&a.input, &a.synth).with_context(|| format!("loading {}", a.input))?;
    let input = Path::new(&a.input);
    let name = input
        .file_stem()
        .map_or_else(|| a.input.clone(), |n| n.to_string_lossy().into_owned());
    let model = &config;
    let add_tokenizer = |w: &mut gguf::Writer| -> engine_core::Result<()> {
        if input.is_dir() && input.join("tokenizer.json").exists() {
            let json = std::fs::read(input.join("tokenizer.json"))
                .map_err(|e| engine_core::Error::io(input.join("tokenizer.json"), e))?;
            let mut config = std::fs::read_to_string(input.join("tokenizer_config.json")).ok();
            if let Ok(t) = std::fs::read_to_string(input.join("chat_template.jinja")) {
                let mut c: serde_json::Value = config
                    .as_deref()
                    .and_then(|c| serde_json::from_str(c).ok())
                    .unwrap_or_else(|| serde_json::json!({}));
                c["chat_template"] = t.into();
                config = Some(c.to_string());
            }
            quantize::tokenizer_metadata(w, &json, config.as_deref(), model)?;
        } else if input.is_file() {
            // A GGUF's own tokenizer, as it is.
            let (g, _) = gguf::open(input)?;
            for (k, v) in g
                .metadata
                .iter()
                .filter(|(k, _)| k.starts_with("tokenizer."))
            {
                w.meta(k, v.clone());
            }
        }
        Ok(())
    };
    let file = std::fs::File::create(&a.output)
        .with_context(|| format!("creating {}", a.output.display()))?;
    let mut out = std::io::BufWriter::new(file);
    let bar = ProgressBar::new(0).with_style(
        ProgressStyle::with_template("{msg} [{bar:40}] {pos}/{len} tensors")
            .expect("a valid template")
            .progress_chars("=> "),
    );
    bar.set_message(format!("writing {} ({})", a.output.display(), target.name));
    let written = quantize::write(
        &config,
        &tensors,
        &name,
        target,
        add_tokenizer,
        &mut out,
        &mut |done, total| {
            bar.set_length(total as u64);
            bar.set_position(done as u64);
        },
    );
    bar.finish_and_clear();
    if let Err(e) = written.map_err(anyhow::Error::from).and_then(|()| {
        use std::io::Write;
        out.flush().context("writing the GGUF")
    }) {
        drop(out);
        let _ = std::fs::remove_file(&a.output);
        return Err(e);
    }
    let bytes = std::fs::metadata(&a.output).map(|m| m.len()).unwrap_or(0);
    eprintln!(
        "wrote {} ({} layers, {}, {:.1} MiB)",
        a.output.display(),
        config.num_hidden_layers,
        target.name,
        bytes as f64 / (1u64 << 20) as f64
    );
    Ok(())
}
