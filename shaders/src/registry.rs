//! Every kernel, its entry points, their binding layouts and the specialisations it takes:
//! the one description the wgpu op layer (engine-core `backend::gpu`) and the MSL export share.

use crate::preprocess::{preprocess, Spec};

/// How an entry point uses a binding (all bindings are buffers in group 0).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    Uniform,
    Read,
    ReadWrite,
}

impl Access {
    pub fn name(self) -> &'static str {
        match self {
            Access::Uniform => "uniform",
            Access::Read => "read",
            Access::ReadWrite => "read_write",
        }
    }
}

#[derive(Clone, Copy, Debug)]
pub struct Binding {
    pub index: u32,
    pub name: &'static str,
    pub access: Access,
}

/// One `@compute` entry point and exactly the bindings it uses (checked against naga's
/// analysis of the module by `translate::check_layout`).
#[derive(Debug)]
pub struct Entry {
    pub name: &'static str,
    pub bindings: &'static [Binding],
}

/// A define a kernel takes. `values` is the canonical set validated and exported; the first
/// is the default when a spec leaves it out. The op layer may pick any value.
#[derive(Debug)]
pub struct Param {
    pub name: &'static str,
    pub doc: &'static str,
    pub values: &'static [u32],
}

#[derive(Debug)]
pub struct Kernel {
    pub name: &'static str,
    /// WGSL files, concatenated in order (the first may hold `enable` directives).
    sources: &'static [&'static str],
    pub entries: &'static [Entry],
    pub params: &'static [Param],
}

/// Weight storage of the kernels that read a matrix (`embed`, `matmul`): the `W` define.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightFormat {
    F32,
    /// f16 pairs in `u32`, unpacked with `unpack2x16float`: every adapter.
    F16Packed,
    /// `array<f16>`: adapters with `shader-f16`.
    F16,
    /// llama.cpp's Q8_0 blocks, each 32 signed bytes and an f32 scale in 9 words.
    Q8_0,
    /// llama.cpp's Q4_0 blocks of 32: an f32 scale and 4 words of nibbles (5 words).
    Q4_0,
    /// llama.cpp's Q5_0 blocks of 32: as Q4_0 plus a word of fifth bits (6 words).
    Q5_0,
    /// llama.cpp's Q4_K super-blocks of 256: `d`, `dmin`, the 8 sub-blocks' 6-bit scales and
    /// mins unpacked to bytes, 32 words of nibbles (38 words).
    Q4K,
    /// llama.cpp's Q5_K super-blocks of 256: as Q4_K plus 8 words of fifth bits (46 words).
    Q5K,
    /// llama.cpp's Q6_K super-blocks of 256: `d`, the 16 signed 8-bit scales, 32 words of low
    /// nibbles and 16 of high bit pairs (53 words).
    Q6K,
}

impl WeightFormat {
    pub fn define(self) -> u32 {
        match self {
            WeightFormat::F32 => 0,
            WeightFormat::F16Packed => 1,
            WeightFormat::F16 => 2,
            WeightFormat::Q8_0 => 3,
            WeightFormat::Q4_0 => 4,
            WeightFormat::Q5_0 => 5,
            WeightFormat::Q4K => 6,
            WeightFormat::Q5K => 7,
            WeightFormat::Q6K => 8,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            WeightFormat::F32 => "f32",
            WeightFormat::F16Packed => "f16-packed",
            WeightFormat::F16 => "f16",
            WeightFormat::Q8_0 => "q8_0",
            WeightFormat::Q4_0 => "q4_0",
            WeightFormat::Q5_0 => "q5_0",
            WeightFormat::Q4K => "q4_k",
            WeightFormat::Q5K => "q5_k",
            WeightFormat::Q6K => "q6_k",
        }
    }

    /// For a quantised format, the weights per block and the 4-byte words a block takes on the
    /// device (weights.wgsl's layouts); `None` for the float formats.
    pub fn block(self) -> Option<(usize, usize)> {
        match self {
            WeightFormat::F32 | WeightFormat::F16Packed | WeightFormat::F16 => None,
            WeightFormat::Q8_0 => Some((32, 9)),
            WeightFormat::Q4_0 => Some((32, 5)),
            WeightFormat::Q5_0 => Some((32, 6)),
            WeightFormat::Q4K => Some((256, 38)),
            WeightFormat::Q5K => Some((256, 46)),
            WeightFormat::Q6K => Some((256, 53)),
        }
    }

    /// Bytes a row of `cols` values takes on the device, padding included.
    pub fn row_bytes(self, cols: usize) -> usize {
        let stride = self.row_stride(cols);
        match (self, self.block()) {
            (_, Some((weights, words))) => stride / weights * words * 4,
            (WeightFormat::F32, None) => stride * 4,
            (_, None) => stride * 2,
        }
    }

    /// Stored elements per row of `cols` values: rows are padded to a multiple of 8, so that
    /// every row starts on 16 bytes and `matvec` reads 8 elements in one or two vector loads
    /// (quantised rows to whole blocks: 32 or 256, multiples of 8).
    pub fn row_stride(self, cols: usize) -> usize {
        match self.block() {
            Some((weights, _)) => cols.next_multiple_of(weights),
            None => cols.next_multiple_of(8),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpecError(pub String);

impl std::fmt::Display for SpecError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for SpecError {}

impl Kernel {
    /// `spec` with every define the kernel takes: defaults filled in; unknown names rejected.
    pub fn complete(&self, spec: &Spec) -> Result<Spec, SpecError> {
        if let Some(name) = spec
            .0
            .keys()
            .find(|n| !self.params.iter().any(|p| p.name == n.as_str()))
        {
            return Err(SpecError(format!(
                "kernel {} takes no define {name}",
                self.name
            )));
        }
        let mut full = spec.clone();
        for p in self.params {
            if full.get(p.name).is_none() {
                full = full.with(p.name, p.values[0]);
            }
        }
        Ok(full)
    }

    /// The WGSL of one specialisation.
    pub fn source(&self, spec: &Spec) -> Result<String, SpecError> {
        let spec = self.complete(spec)?;
        preprocess(&self.sources.concat(), &spec)
            .map_err(|e| SpecError(format!("{}.wgsl ({}): {e}", self.name, spec.key())))
    }

    /// Native f16 weights (`enable f16;`): the device needs `shader-f16`.
    pub fn needs_f16(&self, spec: &Spec) -> bool {
        spec.get("W") == Some(WeightFormat::F16.define())
    }

    /// The canonical specialisations: every combination of the params' listed values.
    pub fn variants(&self) -> Vec<Spec> {
        let mut out = vec![Spec::new()];
        for p in self.params {
            out = out
                .iter()
                .flat_map(|s| p.values.iter().map(move |&v| s.clone().with(p.name, v)))
                .collect();
        }
        out
    }

    pub fn entry(&self, name: &str) -> Option<&'static Entry> {
        self.entries.iter().find(|e| e.name == name)
    }
}

/// The kernel named `name`.
pub fn kernel(name: &str) -> Option<&'static Kernel> {
    KERNELS.iter().find(|k| k.name == name)
}

const fn b(index: u32, name: &'static str, access: Access) -> Binding {
    Binding {
        index,
        name,
        access,
    }
}

use Access::{Read as R, ReadWrite as RW, Uniform as U};

const PARAMS: Binding = b(0, "params", U);

const WG: Param = Param {
    name: "WG",
    doc: "threads per workgroup (a power of two)",
    values: &[64],
};

const W: Param = Param {
    name: "W",
    doc: "weight storage: 0 f32, 1 f16 pairs packed in u32, 2 native f16, quantised blocks \
          3 Q8_0, 4 Q4_0, 5 Q5_0, 6 Q4_K, 7 Q5_K, 8 Q6_K",
    values: &[0, 1, 2, 3, 4, 5, 6, 7, 8],
};

const WEIGHTS: &str = include_str!("wgsl/weights.wgsl");

pub static KERNELS: &[Kernel] = &[
    Kernel {
        name: "embed",
        sources: &[WEIGHTS, include_str!("wgsl/embed.wgsl")],
        entries: &[Entry {
            name: "embed",
            bindings: &[PARAMS, b(1, "table", R), b(2, "ids", R), b(3, "out", RW)],
        }],
        params: &[W, WG],
    },
    Kernel {
        name: "matmul",
        sources: &[WEIGHTS, include_str!("wgsl/matmul.wgsl")],
        entries: &[
            Entry {
                name: "matvec",
                bindings: &[PARAMS, b(1, "w", R), b(2, "x", R), b(3, "out", RW)],
            },
            Entry {
                name: "matmul",
                bindings: &[PARAMS, b(1, "w", R), b(2, "x", R), b(3, "out", RW)],
            },
        ],
        params: &[
            W,
            Param {
                name: "WG",
                doc: "threads per matvec workgroup (a power of two)",
                values: &[64, 256],
            },
        ],
    },
    Kernel {
        name: "norm",
        sources: &[include_str!("wgsl/norm.wgsl")],
        entries: &[
            Entry {
                name: "rms_norm",
                bindings: &[PARAMS, b(1, "w", R), b(2, "x", RW)],
            },
            Entry {
                name: "gated_rms_norm",
                bindings: &[PARAMS, b(1, "w", R), b(2, "x", RW), b(3, "z", R)],
            },
            Entry {
                name: "l2_norm",
                bindings: &[PARAMS, b(2, "x", RW)],
            },
        ],
        params: &[Param {
            name: "WG",
            doc: "threads per row (a power of two)",
            values: &[64, 256],
        }],
    },
    Kernel {
        name: "rope",
        sources: &[include_str!("wgsl/rope.wgsl")],
        entries: &[Entry {
            name: "rope",
            bindings: &[PARAMS, b(1, "cos_sin", R), b(2, "x", RW)],
        }],
        params: &[WG],
    },
    Kernel {
        name: "elementwise",
        sources: &[include_str!("wgsl/elementwise.wgsl")],
        entries: &[
            Entry {
                name: "silu_mul",
                bindings: &[PARAMS, b(1, "a", RW), b(2, "b", RW)],
            },
            Entry {
                name: "sigmoid_mul",
                bindings: &[PARAMS, b(1, "a", RW), b(2, "b", RW)],
            },
            Entry {
                name: "add",
                bindings: &[PARAMS, b(1, "a", RW), b(2, "b", RW)],
            },
            Entry {
                name: "scale",
                bindings: &[PARAMS, b(1, "a", RW)],
            },
            Entry {
                name: "copy_cols",
                bindings: &[PARAMS, b(1, "a", RW), b(3, "dst", RW)],
            },
            Entry {
                name: "delta_gates",
                bindings: &[PARAMS, b(1, "a", RW), b(2, "b", RW), b(4, "gate_params", R)],
            },
            Entry {
                name: "pack_f16",
                bindings: &[PARAMS, b(1, "a", RW), b(5, "packed", RW)],
            },
            Entry {
                name: "pack_q8_0",
                bindings: &[PARAMS, b(1, "a", RW), b(5, "packed", RW)],
            },
            Entry {
                name: "pack_q4_0",
                bindings: &[PARAMS, b(1, "a", RW), b(5, "packed", RW)],
            },
        ],
        params: &[WG],
    },
    Kernel {
        name: "conv",
        sources: &[include_str!("wgsl/conv.wgsl")],
        entries: &[
            Entry {
                name: "conv_silu",
                bindings: &[
                    PARAMS,
                    b(1, "weight", R),
                    b(2, "u", R),
                    b(3, "history", RW),
                    b(4, "out", RW),
                ],
            },
            Entry {
                name: "conv_history",
                bindings: &[PARAMS, b(2, "u", R), b(3, "history", RW)],
            },
        ],
        params: &[WG],
    },
    Kernel {
        name: "delta",
        sources: &[include_str!("wgsl/delta.wgsl")],
        entries: &[
            Entry {
                name: "delta_recurrent",
                bindings: DELTA_BINDINGS,
            },
            Entry {
                name: "delta_chunked",
                bindings: DELTA_BINDINGS,
            },
        ],
        params: &[
            WG,
            Param {
                name: "CHUNK",
                doc: "tokens per chunk of delta_chunked (workgroup memory: 3 CHUNK^2 floats)",
                values: &[32, 16],
            },
        ],
    },
    Kernel {
        name: "attention",
        sources: &[include_str!("wgsl/attention.wgsl")],
        entries: &[
            Entry {
                name: "attn_prefill",
                bindings: ATTN_BINDINGS,
            },
            Entry {
                name: "attn_decode",
                bindings: ATTN_BINDINGS,
            },
        ],
        params: &[
            Param {
                name: "HEAD_DIM",
                doc: "head dimension (sizes the per-thread accumulators and the query tile)",
                values: &[256, 128, 64, 32, 16],
            },
            Param {
                name: "KT",
                doc: "how the page stores keys: 0 f32, else ggml's rows in u32 words: 1 f16, 2 q8_0, 3 q4_0",
                values: &[0, 1, 2, 3],
            },
            Param {
                name: "VT",
                doc: "how the page stores values (as KT)",
                values: &[0, 1, 2, 3],
            },
        ],
    },
    Kernel {
        name: "merge",
        sources: &[include_str!("wgsl/merge.wgsl")],
        entries: &[Entry {
            name: "attn_merge",
            bindings: &[
                PARAMS,
                b(1, "o_parts", R),
                b(2, "m_parts", R),
                b(3, "l_parts", R),
                b(4, "o", RW),
                b(5, "m", RW),
                b(6, "l", RW),
            ],
        }],
        params: &[WG],
    },
    Kernel {
        name: "argmax",
        sources: &[include_str!("wgsl/argmax.wgsl")],
        entries: &[Entry {
            name: "argmax",
            bindings: &[PARAMS, b(1, "x", R), b(2, "out", RW)],
        }],
        params: &[Param {
            name: "WG",
            doc: "threads per row (a power of two)",
            values: &[256],
        }],
    },
];

const DELTA_BINDINGS: &[Binding] = &[
    PARAMS,
    b(1, "q", R),
    b(2, "k", R),
    b(3, "v", R),
    b(4, "g", R),
    b(5, "beta", R),
    b(6, "state", RW),
    b(7, "out", RW),
];

const ATTN_BINDINGS: &[Binding] = &[
    PARAMS,
    b(1, "q", R),
    b(2, "pos", R),
    b(3, "k", R),
    b(4, "v", R),
    b(5, "o", RW),
    b(6, "m", RW),
    b(7, "l", RW),
];
