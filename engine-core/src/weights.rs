//! Reading and writing safetensors checkpoints: one file, or shards listed in
//! `model.safetensors.index.json`. Tensor names are normalised to the text-only layout
//! (`model.layers.N.*`); multimodal checkpoints' `model.language_model.*` prefix is stripped and
//! their vision tower skipped; the multi-token-prediction head is `mtp.*` whatever its prefix.

use safetensors::{Dtype as StDtype, SafeTensors};
use std::collections::HashMap;

use crate::error::{Error, Result};
use crate::tensor::{Data, Elems, SharedBytes, Tensor};

pub type TensorMap = HashMap<String, Tensor>;

/// The layer a tensor belongs to, from its normalised name (`model.layers.N.`).
pub fn layer_of(name: &str) -> Option<usize> {
    name.strip_prefix("model.layers.")?
        .split('.')
        .next()?
        .parse()
        .ok()
}

/// The text-only name of a checkpoint tensor, or `None` for tensors text inference ignores.
/// Qwen3.5 checkpoints hold the MTP head as `mtp.*`; llama.cpp's converter also takes
/// `model.mtp.*` (and `model.language_model.mtp.*`), so tether does too.
fn normalise_name(name: &str) -> Option<String> {
    if name.starts_with("model.visual.") {
        return None;
    }
    let text = name
        .strip_prefix("model.language_model.")
        .map(|r| format!("model.{r}"));
    let text = text.as_deref().unwrap_or(name);
    Some(match text.strip_prefix("model.mtp.") {
        Some(rest) => format!("mtp.{rest}"),
        None => text.to_string(),
    })
}

/// The safetensors crate's own limit on a header's length.
const MAX_HEADER: u64 = 100_000_000;

/// Refuses a header whose tensors end past the file's data section. safetensors 0.6.2 adds the
/// last tensor's end offset to the header length unchecked once its tensors are contiguous (a
/// panic in debug builds on a header that announces data near 2^64 bytes; its open PR #808
/// checks that sum), so this runs first. Anything else wrong with the header is left to the
/// crate to name.
fn check_data_offsets(buf: &[u8]) -> std::result::Result<(), String> {
    let Some(n) = buf
        .get(..8)
        .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
    else {
        return Ok(());
    };
    let header = usize::try_from(n)
        .ok()
        .filter(|_| n <= MAX_HEADER)
        .and_then(|n| buf.get(8..8 + n));
    let Some(header) = header else {
        return Ok(());
    };
    let Ok(entries) = serde_json::from_slice::<HashMap<String, serde_json::Value>>(header) else {
        return Ok(());
    };
    let data_len = (buf.len() - 8 - header.len()) as u64;
    for (name, info) in &entries {
        let end = info.get("data_offsets").and_then(|o| o.get(1)?.as_u64());
        if let Some(end) = end.filter(|&end| end > data_len) {
            return Err(format!(
                "tensor `{name}` ends at byte {end} of a {data_len}-byte data section"
            ));
        }
    }
    Ok(())
}

/// Parse one safetensors buffer and add its tensors to `out` (sharing `bytes`, no copy when
/// aligned). `what` names the file in errors.
pub fn add_safetensors(bytes: SharedBytes, what: &str, out: &mut TensorMap) -> Result<()> {
    let buf: &[u8] = (*bytes).as_ref();
    check_data_offsets(buf)
        .map_err(|e| Error::Weights(format!("{what}: not a valid safetensors file: {e}")))?;
    let st = SafeTensors::deserialize(buf)
        .map_err(|e| Error::Weights(format!("{what}: not a valid safetensors file: {e}")))?;
    let base = buf.as_ptr() as usize;
    for (name, view) in st.tensors() {
        let Some(norm) = normalise_name(&name) else {
            continue;
        };
        let start = view.data().as_ptr() as usize - base;
        let range = start..start + view.data().len();
        let data = match view.dtype() {
            StDtype::F32 => Data::F32(Elems::from_bytes(&bytes, range)),
            StDtype::BF16 => Data::BF16(Elems::from_bytes(&bytes, range)),
            StDtype::F16 => Data::F16(Elems::from_bytes(&bytes, range)),
            other => {
                return Err(Error::Weights(format!(
                    "{what}: tensor `{name}` has dtype {other:?}; tether reads f32, bf16 and f16"
                )))
            }
        };
        out.insert(
            norm,
            Tensor {
                shape: view.shape().to_vec(),
                data,
            },
        );
    }
    Ok(())
}

/// The weight files of a checkpoint directory, in name order: the shards
/// `model.safetensors.index.json` lists, or `model.safetensors`. A shard must be a path inside
/// the directory: an index (downloaded with the rest) must not make tether map other files.
#[cfg(not(target_arch = "wasm32"))]
pub fn checkpoint_files(dir: &std::path::Path) -> Result<Vec<std::path::PathBuf>> {
    let index = dir.join("model.safetensors.index.json");
    let files: Vec<String> = if index.exists() {
        let text = std::fs::read_to_string(&index).map_err(|e| Error::io(&index, e))?;
        let v: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| Error::Weights(format!("{}: invalid JSON: {e}", index.display())))?;
        let map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| {
                Error::Weights(format!("{}: no `weight_map` object", index.display()))
            })?;
        let mut files: Vec<String> = map
            .values()
            .filter_map(|f| f.as_str().map(str::to_string))
            .collect();
        files.sort();
        files.dedup();
        if let Some(bad) = files.iter().find(|f| !inside(f)) {
            return Err(Error::Weights(format!(
                "{}: shard `{bad}` is not a file name inside the checkpoint directory",
                index.display()
            )));
        }
        files
    } else if dir.join("model.safetensors").exists() {
        vec!["model.safetensors".to_string()]
    } else {
        return Err(Error::Weights(format!(
            "{}: no model.safetensors or model.safetensors.index.json",
            dir.display()
        )));
    };
    Ok(files.iter().map(|f| dir.join(f)).collect())
}

/// Whether `name` is a relative path of plain names (no root, no `..`, not empty).
#[cfg(not(target_arch = "wasm32"))]
fn inside(name: &str) -> bool {
    let path = std::path::Path::new(name);
    path.components().next().is_some()
        && path
            .components()
            .all(|c| matches!(c, std::path::Component::Normal(_)))
}

/// Load every weight file of a checkpoint directory (memory-mapped).
#[cfg(not(target_arch = "wasm32"))]
pub fn load_dir(dir: &std::path::Path) -> Result<TensorMap> {
    let mut out = TensorMap::new();
    for path in checkpoint_files(dir)? {
        let file = std::fs::File::open(&path).map_err(|e| Error::io(&path, e))?;
        // SAFETY: the mapping is read-only; tether never writes checkpoint files while a model
        // that maps them is loaded (a file changed underneath by another process is the
        // documented hazard of every mmap-based loader).
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(&path, e))?;
        add_safetensors(
            std::sync::Arc::new(map),
            &path.display().to_string(),
            &mut out,
        )?;
    }
    Ok(out)
}

/// A tensor to write: any safetensors dtype (eval writes i64 ids beside f32 logits).
pub struct RawTensor<'a> {
    pub dtype: StDtype,
    pub shape: Vec<usize>,
    pub bytes: &'a [u8],
}

impl safetensors::View for &RawTensor<'_> {
    fn dtype(&self) -> StDtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(self.bytes)
    }
    fn data_len(&self) -> usize {
        self.bytes.len()
    }
}

/// Write named tensors as one safetensors file.
#[cfg(not(target_arch = "wasm32"))]
pub fn save_raw(tensors: &[(String, RawTensor)], path: &std::path::Path) -> Result<()> {
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    let views = tensors.iter().map(|(n, t)| (n.as_str(), t));
    safetensors::serialize_to_file(views, Some(meta), path)
        .map_err(|e| Error::Weights(format!("{}: {e}", path.display())))
}

/// Write model tensors as one safetensors file, sorted by name as HF does.
#[cfg(not(target_arch = "wasm32"))]
pub fn save_safetensors(tensors: &TensorMap, path: &std::path::Path) -> Result<()> {
    let mut raw: Vec<(String, RawTensor)> = tensors
        .iter()
        .map(|(n, t)| {
            let (dtype, bytes): (_, &[u8]) = match &t.data {
                Data::F32(e) => (StDtype::F32, bytemuck::cast_slice(e)),
                Data::BF16(e) => (StDtype::BF16, bytemuck::cast_slice(e)),
                Data::F16(e) => (StDtype::F16, bytemuck::cast_slice(e)),
                _ => {
                    return Err(Error::Weights(format!(
                        "{n} is {}, which a safetensors file cannot hold",
                        t.dtype().name()
                    )))
                }
            };
            Ok((
                n.clone(),
                RawTensor {
                    dtype,
                    shape: t.shape.clone(),
                    bytes,
                },
            ))
        })
        .collect::<Result<_>>()?;
    raw.sort_by(|a, b| a.0.cmp(&b.0));
    save_raw(&raw, path)
}
