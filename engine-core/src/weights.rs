//! Reading and writing safetensors checkpoints: one file, or shards listed in
//! `model.safetensors.index.json`. Tensor names are normalised to the text-only layout
//! (`model.layers.N.*`); multimodal checkpoints' `model.language_model.*` prefix is stripped and
//! their vision tower and MTP head are skipped.

use safetensors::{Dtype as StDtype, SafeTensors};
use std::collections::HashMap;

use crate::error::{Error, Result};
use crate::tensor::{DType, Data, Elems, SharedBytes, Tensor};

pub type TensorMap = HashMap<String, Tensor>;

/// The text-only name of a checkpoint tensor, or `None` for tensors text inference ignores.
fn normalise_name(name: &str) -> Option<String> {
    if name.starts_with("model.visual.")
        || name.starts_with("mtp.")
        || name.starts_with("model.mtp.")
    {
        return None;
    }
    Some(match name.strip_prefix("model.language_model.") {
        Some(rest) => format!("model.{rest}"),
        None => name.to_string(),
    })
}

/// Parse one safetensors buffer and add its tensors to `out` (sharing `bytes`, no copy when
/// aligned). `what` names the file in errors.
pub fn add_safetensors(bytes: SharedBytes, what: &str, out: &mut TensorMap) -> Result<()> {
    let buf: &[u8] = (*bytes).as_ref();
    let st = SafeTensors::deserialize(buf)
        .map_err(|e| Error::Weights(format!("{what}: not a valid safetensors file: {e}")))?;
    let base = buf.as_ptr() as usize;
    for (name, view) in st.tensors() {
        let Some(norm) = normalise_name(&name) else {
            continue;
        };
        let dtype = match view.dtype() {
            StDtype::F32 => DType::F32,
            StDtype::BF16 => DType::BF16,
            StDtype::F16 => DType::F16,
            other => {
                return Err(Error::Weights(format!(
                    "{what}: tensor `{name}` has dtype {other:?}; tether reads f32, bf16 and f16"
                )))
            }
        };
        let start = view.data().as_ptr() as usize - base;
        let range = start..start + view.data().len();
        let data = match dtype {
            DType::F32 => Data::F32(Elems::from_bytes(&bytes, range)),
            DType::BF16 => Data::BF16(Elems::from_bytes(&bytes, range)),
            DType::F16 => Data::F16(Elems::from_bytes(&bytes, range)),
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
/// `model.safetensors.index.json` lists, or `model.safetensors`.
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
            let dtype = match t.dtype() {
                DType::F32 => StDtype::F32,
                DType::BF16 => StDtype::BF16,
                DType::F16 => StDtype::F16,
            };
            (
                n.clone(),
                RawTensor {
                    dtype,
                    shape: t.shape.clone(),
                    bytes: t.data.as_bytes(),
                },
            )
        })
        .collect();
    raw.sort_by(|a, b| a.0.cmp(&b.0));
    save_raw(&raw, path)
}
