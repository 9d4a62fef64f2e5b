//! Every kernel, in every canonical specialisation, passes naga validation, uses exactly the
//! bindings its registry entry lists, and translates to MSL and SPIR-V; `export-msl` writes a
//! file per specialisation and a binding map.

use shaders::translate::{compile, to_msl, to_spirv};
use shaders::{kernel, Spec, KERNELS};

#[test]
fn every_specialisation_validates_and_translates() {
    let mut n = 0;
    for k in KERNELS {
        for spec in k.variants() {
            let c = compile(k, &spec).unwrap_or_else(|e| panic!("{e}"));
            let msl = to_msl(&c).unwrap_or_else(|e| panic!("{e}"));
            for e in k.entries {
                assert!(
                    msl.entries.iter().any(|m| m.name == e.name),
                    "{} {}: no MSL for {}",
                    k.name,
                    spec.key(),
                    e.name
                );
            }
            let spv = to_spirv(&c).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(spv[0], 0x0723_0203, "SPIR-V magic");
            n += 1;
        }
    }
    assert!(n >= 20, "only {n} specialisations");
}

#[test]
fn unknown_defines_are_rejected() {
    let k = kernel("norm").unwrap();
    assert!(compile(k, &Spec::new().with("HEAD_DIM", 64)).is_err());
}

#[test]
fn export_msl_writes_files_and_binding_map() {
    let dir = std::env::temp_dir().join(format!("tether-msl-{}", std::process::id()));
    let status = std::process::Command::new(env!("CARGO_BIN_EXE_export-msl"))
        .arg(&dir)
        .status()
        .unwrap();
    assert!(status.success());
    let map: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("bindings.json")).unwrap()).unwrap();
    let files = map["files"].as_array().unwrap();
    let expected: usize = KERNELS.iter().map(|k| k.variants().len()).sum();
    assert_eq!(files.len(), expected);
    for f in files {
        let path = dir.join(f["file"].as_str().unwrap());
        let src = std::fs::read_to_string(&path).unwrap();
        for e in f["entries"].as_array().unwrap() {
            let name = e["metal_function"].as_str().unwrap();
            assert!(src.contains(name), "{} lacks {name}", path.display());
            assert_eq!(e["bindings"][0]["access"], "uniform");
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
