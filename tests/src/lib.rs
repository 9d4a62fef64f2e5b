//! Shared helpers of the cross-crate tests: where the fixtures are and how to read them.

use std::collections::HashMap;
use std::path::PathBuf;

/// `../shared/fixtures` relative to the workspace root, or `$TETHER_FIXTURES`.
pub fn fixtures_dir() -> PathBuf {
    if let Ok(d) = std::env::var("TETHER_FIXTURES") {
        return PathBuf::from(d);
    }
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/fixtures")
}

/// A reference tensor as f32 (or i64 ids as f32-free `Vec<i64>` via [`ids`]).
pub struct Reference {
    pub tensors: HashMap<String, (Vec<usize>, Vec<u8>, safetensors::Dtype)>,
}

impl Reference {
    pub fn load(fixture: &str) -> Reference {
        let path = fixtures_dir().join(fixture).join("reference.safetensors");
        let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let st =
            safetensors::SafeTensors::deserialize(&bytes).expect("reference.safetensors parses");
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
