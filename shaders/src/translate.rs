//! naga: parse and validate a specialised kernel, check its entry points use exactly the
//! bindings the registry lists, and translate it to MSL (with an explicit binding map) and
//! SPIR-V.

use std::fmt;

use naga::back::msl;
use naga::valid::{Capabilities, ValidationFlags, Validator};
use naga::{AddressSpace, StorageAccess};

use crate::preprocess::Spec;
use crate::registry::{Access, Kernel};

/// A kernel specialisation that failed to specialise, parse, validate or translate.
#[derive(Debug)]
pub struct Error {
    pub kernel: &'static str,
    pub spec: String,
    pub message: String,
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} [{}]: {}", self.kernel, self.spec, self.message)
    }
}

impl std::error::Error for Error {}

/// A validated module of one specialisation.
pub struct Compiled {
    pub kernel: &'static Kernel,
    /// The complete spec (defaults filled in).
    pub spec: Spec,
    pub source: String,
    pub module: naga::Module,
    pub info: naga::valid::ModuleInfo,
}

impl Compiled {
    fn error(&self, message: impl fmt::Display) -> Error {
        Error {
            kernel: self.kernel.name,
            spec: self.spec.key(),
            message: message.to_string(),
        }
    }
}

/// Specialise, parse and validate, then check the binding layout.
pub fn compile(kernel: &'static Kernel, spec: &Spec) -> Result<Compiled, Error> {
    let err = |message: String| Error {
        kernel: kernel.name,
        spec: spec.key(),
        message,
    };
    let spec = kernel.complete(spec).map_err(|e| err(e.0))?;
    let source = kernel.source(&spec).map_err(|e| err(e.0))?;
    let module = naga::front::wgsl::parse_str(&source)
        .map_err(|e| err(e.emit_to_string_with_path(&source, kernel.name)))?;
    // unpack2x16float (packed f16 weights) needs SHADER_FLOAT16_IN_FLOAT32, which wgpu grants
    // on Vulkan, Metal and DX12 (WebGPU core); native f16 needs `shader-f16`.
    let mut caps = Capabilities::SHADER_FLOAT16_IN_FLOAT32;
    if kernel.needs_f16(&spec) {
        caps |= Capabilities::SHADER_FLOAT16;
    }
    let info = Validator::new(ValidationFlags::all(), caps)
        .validate(&module)
        .map_err(|e| err(e.emit_to_string_with_path(&source, kernel.name)))?;
    let c = Compiled {
        kernel,
        spec,
        source,
        module,
        info,
    };
    check_layout(&c)?;
    Ok(c)
}

/// Every entry point of the module is in the registry and uses exactly its listed bindings,
/// each declared with the listed access: the backend's bind group layouts and the MSL binding
/// map are built from the registry, so a drift would fail only on some device.
pub fn check_layout(c: &Compiled) -> Result<(), Error> {
    let m = &c.module;
    if m.entry_points.len() != c.kernel.entries.len() {
        return Err(c.error(format!(
            "module has {} entry points, the registry lists {}",
            m.entry_points.len(),
            c.kernel.entries.len()
        )));
    }
    for (i, ep) in m.entry_points.iter().enumerate() {
        let entry = c
            .kernel
            .entry(&ep.name)
            .ok_or_else(|| c.error(format!("entry point {} is not in the registry", ep.name)))?;
        let uses = c.info.get_entry_point(i);
        let mut used = Vec::new();
        for (h, var) in m.global_variables.iter() {
            let Some(rb) = var.binding else { continue };
            if uses[h].is_empty() {
                continue;
            }
            let access = match var.space {
                AddressSpace::Uniform => Access::Uniform,
                AddressSpace::Storage { access } if access.contains(StorageAccess::STORE) => {
                    Access::ReadWrite
                }
                AddressSpace::Storage { .. } => Access::Read,
                _ => return Err(c.error(format!("binding {} is not a buffer", rb.binding))),
            };
            if rb.group != 0 {
                return Err(c.error(format!("binding {} is not in group 0", rb.binding)));
            }
            used.push((rb.binding, access));
        }
        used.sort_by_key(|u| u.0);
        let listed: Vec<(u32, Access)> =
            entry.bindings.iter().map(|b| (b.index, b.access)).collect();
        if used != listed {
            return Err(c.error(format!(
                "entry {} uses bindings {used:?}, the registry lists {listed:?}",
                ep.name
            )));
        }
    }
    Ok(())
}

/// MSL version written: 2.1 (iOS 12 / macOS 10.14) has everything the kernels use.
pub const MSL_VERSION: (u8, u8) = (2, 1);

/// Metal buffer slot of WGSL binding `index` (group 0): the same number.
pub fn msl_slot(index: u32) -> u8 {
    u8::try_from(index).expect("binding index fits a Metal buffer slot")
}

/// One entry point as written to MSL.
pub struct MslEntry {
    pub name: &'static str,
    /// The Metal function name naga chose.
    pub metal_name: String,
    pub workgroup_size: [u32; 3],
}

pub struct Msl {
    pub source: String,
    pub entries: Vec<MslEntry>,
    /// The fields of the buffer-sizes struct at `[[buffer(SIZES_SLOT)]]`: the WGSL binding
    /// whose byte size each `uint` holds, in order.
    pub sizes_fields: Vec<u32>,
}

/// Metal buffer slot of the struct of buffer byte sizes naga's MSL takes for runtime-sized
/// arrays (the host fills it; with unchecked indexing the kernels never read it).
pub const SIZES_SLOT: u8 = 30;

/// MSL of every entry point, binding `@binding(i)` to `[[buffer(i)]]` (see `msl_slot`).
/// Indexing is unchecked (naga's default policy): every kernel guards its own indices.
pub fn to_msl(c: &Compiled) -> Result<Msl, Error> {
    let mut options = msl::Options {
        lang_version: MSL_VERSION,
        fake_missing_bindings: false,
        ..Default::default()
    };
    for entry in c.kernel.entries {
        let resources = entry
            .bindings
            .iter()
            .map(|b| {
                let target = msl::BindTarget {
                    buffer: Some(msl_slot(b.index)),
                    mutable: b.access == Access::ReadWrite,
                    ..Default::default()
                };
                (
                    naga::ResourceBinding {
                        group: 0,
                        binding: b.index,
                    },
                    target,
                )
            })
            .collect();
        options.per_entry_point_map.insert(
            entry.name.to_string(),
            msl::EntryPointResources {
                resources,
                sizes_buffer: Some(SIZES_SLOT),
                ..Default::default()
            },
        );
    }
    let (source, info) = msl::write_string(
        &c.module,
        &c.info,
        &options,
        &msl::PipelineOptions::default(),
    )
    .map_err(|e| c.error(format!("MSL: {e}")))?;
    let mut entries = Vec::new();
    for (ep, name) in c.module.entry_points.iter().zip(info.entry_point_names) {
        entries.push(MslEntry {
            name: c
                .kernel
                .entry(&ep.name)
                .expect("check_layout matched every entry point")
                .name,
            metal_name: name.map_err(|e| c.error(format!("MSL entry {}: {e}", ep.name)))?,
            workgroup_size: ep.workgroup_size,
        });
    }
    let sizes_fields = c
        .module
        .global_variables
        .iter()
        .filter(|(_, var)| {
            matches!(
                c.module.types[var.ty].inner,
                naga::TypeInner::Array {
                    size: naga::ArraySize::Dynamic,
                    ..
                }
            )
        })
        .filter_map(|(_, var)| var.binding.as_ref().map(|b| b.binding))
        .collect();
    Ok(Msl {
        source,
        entries,
        sizes_fields,
    })
}

/// SPIR-V words of the module (every entry point).
pub fn to_spirv(c: &Compiled) -> Result<Vec<u32>, Error> {
    naga::back::spv::write_vec(
        &c.module,
        &c.info,
        &naga::back::spv::Options::default(),
        None,
    )
    .map_err(|e| c.error(format!("SPIR-V: {e}")))
}
