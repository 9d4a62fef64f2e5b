//! `export-msl OUT_DIR`: every kernel in every canonical specialisation as MSL, for hosts that
//! run Metal without wgpu (the phone). Writes `KERNEL.DEFINES.metal` files and
//! `bindings.json`: per file, its defines and, per entry point, the Metal function name, the
//! workgroup size and each binding's buffer slot, name and access. Every binding is in WGSL
//! group 0 and binding `i` is `[[buffer(i)]]`; binding 0 is always the uniform `params`.
//! `sizes_buffer` gives the slot and field order (WGSL bindings) of the struct of buffer byte
//! sizes naga's MSL declares for runtime-sized arrays.

use std::path::PathBuf;

use serde_json::json;
use shaders::translate::{compile, msl_slot, to_msl, MSL_VERSION, SIZES_SLOT};
use shaders::KERNELS;

fn main() {
    let Some(out) = std::env::args().nth(1).map(PathBuf::from) else {
        eprintln!("usage: export-msl OUT_DIR");
        std::process::exit(2);
    };
    if let Err(e) = run(&out) {
        eprintln!("export-msl: {e}");
        std::process::exit(1);
    }
}

fn run(out: &std::path::Path) -> Result<(), Box<dyn std::error::Error>> {
    std::fs::create_dir_all(out)?;
    let mut files = Vec::new();
    for kernel in KERNELS {
        for spec in kernel.variants() {
            let compiled = compile(kernel, &spec)?;
            let msl = to_msl(&compiled)?;
            let defines: Vec<String> = compiled
                .spec
                .0
                .iter()
                .map(|(k, v)| format!("{k}{v}"))
                .collect();
            let file = format!("{}.{}.metal", kernel.name, defines.join("-"));
            std::fs::write(out.join(&file), &msl.source)?;
            let entries: Vec<_> = msl
                .entries
                .iter()
                .map(|e| {
                    let entry = kernel.entry(e.name).expect("a registry entry");
                    let bindings: Vec<_> = entry
                        .bindings
                        .iter()
                        .map(|b| {
                            json!({
                                "binding": b.index,
                                "buffer": msl_slot(b.index),
                                "name": b.name,
                                "access": b.access.name(),
                            })
                        })
                        .collect();
                    json!({
                        "entry": e.name,
                        "metal_function": e.metal_name,
                        "workgroup_size": e.workgroup_size,
                        "bindings": bindings,
                    })
                })
                .collect();
            files.push(json!({
                "kernel": kernel.name,
                "defines": compiled.spec.0,
                "file": file,
                "entries": entries,
                "sizes_buffer": { "buffer": SIZES_SLOT, "fields": msl.sizes_fields },
            }));
        }
    }
    let map = json!({
        "msl_version": format!("{}.{}", MSL_VERSION.0, MSL_VERSION.1),
        "files": files,
    });
    std::fs::write(
        out.join("bindings.json"),
        serde_json::to_string_pretty(&map)? + "\n",
    )?;
    println!(
        "wrote {} MSL files and bindings.json to {}",
        files.len(),
        out.display()
    );
    Ok(())
}
