//! Writes frozen-page Core ML packages for `scripts/check-coreml.sh` to check: for each case
//! `<case>.mlpackage`, the page's K and V rows and the query (`<case>.{k,v,q}.f16`, raw
//! little-endian fp16) and `<case>.json` (the shape). The checker computes exact attention
//! from the raw files, independently of the package, and runs the package's program.
//!
//! Usage: `cargo run -p engine-core --features coreml --example coreml_pages -- <out dir>`

use std::path::PathBuf;

use engine_core::coreml::{page_package, PageShape, DEFAULT_KEYS};
use half::f16;
use rand::{rngs::SmallRng, Rng, SeedableRng};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out = PathBuf::from(
        std::env::args()
            .nth(1)
            .ok_or("usage: coreml_pages <out dir>")?,
    );
    std::fs::create_dir_all(&out)?;
    let shape = |keys, kv_heads, head_dim, rows| PageShape {
        keys,
        kv_heads,
        head_dim,
        rows,
        scale: 1.0 / (head_dim as f32).sqrt(),
    };
    let cases = [
        // The default page with small heads: 16384 keys.
        ("default_keys", shape(DEFAULT_KEYS, 2, 64, 4)),
        // A 0.8B-shaped layer (2 KV heads of 256, 8 query heads: groups of 4), one token.
        ("qwen35_08b", shape(4096, 2, 256, 4)),
        // The 27B's layer (4 KV heads of 256, 24 query heads: groups of 6), two tokens.
        ("qwen35_27b", shape(1024, 4, 256, 12)),
        // Odd sizes everywhere.
        ("odd", shape(37, 3, 24, 5)),
    ];
    for (i, (name, s)) in cases.into_iter().enumerate() {
        let mut rng = SmallRng::seed_from_u64(0x7e7e_0000 + i as u64);
        let q = normal(&mut rng, s.kv_heads * s.head_dim * s.rows, 1.0);
        let mut k = normal(&mut rng, s.elements(), 1.0);
        let v = normal(&mut rng, s.elements(), 1.0);
        // A few keys close to the first query row of each head, so the softmax has peaks as a
        // real page's has, beside the mass of unrelated keys.
        for t in (0..s.keys).step_by(s.keys.div_ceil(5)) {
            for h in 0..s.kv_heads {
                for d in 0..s.head_dim {
                    let qv = q[(h * s.head_dim + d) * s.rows];
                    k[(t * s.kv_heads + h) * s.head_dim + d] = f16::from_f32(2.0 * qv.to_f32());
                }
            }
        }
        page_package(&s, &k, &v)?.write(&out.join(format!("{name}.mlpackage")))?;
        for (ext, data) in [("k", &k), ("v", &v), ("q", &q)] {
            std::fs::write(
                out.join(format!("{name}.{ext}.f16")),
                bytemuck::cast_slice::<f16, u8>(data),
            )?;
        }
        let meta = serde_json::json!({
            "keys": s.keys, "kv_heads": s.kv_heads, "head_dim": s.head_dim,
            "rows": s.rows, "scale": s.scale,
        });
        std::fs::write(out.join(format!("{name}.json")), meta.to_string())?;
        println!("{name}: {s:?}");
    }
    Ok(())
}

/// `n` values of a normal distribution of deviation `sd`, rounded to fp16.
fn normal(rng: &mut SmallRng, n: usize, sd: f32) -> Vec<f16> {
    (0..n)
        .map(|_| {
            let (u, v): (f32, f32) = (rng.random::<f32>().max(1e-7), rng.random());
            let z = (-2.0 * u.ln()).sqrt() * (std::f32::consts::TAU * v).cos();
            f16::from_f32(sd * z)
        })
        .collect()
}
