//! Frozen pages' Core ML packages, read back: the structure Core ML needs (every op's inputs
//! bound to values defined before it, blob records where the constants point, a description
//! that matches the program), byte-for-byte determinism, and refusals. Running the program
//! against exact attention is `scripts/check-coreml.sh`'s part (coremltools, in CI).

use std::collections::{BTreeMap, HashSet};

use engine_core::coreml::proto::{self, mil_spec as mil};
use engine_core::coreml::{blob, page_package, program, PageShape, SPEC_VERSION};
use half::f16;
use prost::Message;

fn shape() -> PageShape {
    PageShape {
        keys: 19,
        kv_heads: 2,
        head_dim: 8,
        rows: 3,
        scale: 0.35,
    }
}

fn page(s: &PageShape, seed: u32) -> (Vec<f16>, Vec<f16>) {
    let value = |i: usize, salt: u32| {
        let x = (i as u32)
            .wrapping_mul(2_654_435_761)
            .wrapping_add(seed ^ salt);
        f16::from_f32((x % 2001) as f32 / 1000.0 - 1.0)
    };
    let k = (0..s.elements()).map(|i| value(i, 1)).collect();
    let v = (0..s.elements()).map(|i| value(i, 2)).collect();
    (k, v)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

fn dims(t: &mil::ValueType) -> (i32, Vec<u64>) {
    let Some(mil::value_type::Type::TensorType(t)) = &t.r#type else {
        panic!("not a tensor type: {t:?}")
    };
    let sizes = t.dimensions.iter().map(|d| match d.dimension {
        Some(mil::dimension::Dimension::Constant(c)) => c.size,
        _ => panic!("a dimension that is not constant"),
    });
    (t.data_type, sizes.collect())
}

#[test]
fn the_program_binds_every_value_before_use_and_its_blobs_are_where_it_says() {
    let s = shape();
    let (k, v) = page(&s, 7);
    let pkg = page_package(&s, &k, &v).unwrap();
    let spec = proto::Model::decode(&pkg.model[..]).unwrap();
    assert_eq!(spec.specification_version, SPEC_VERSION);
    let Some(proto::model::Type::MlProgram(prog)) = &spec.r#type else {
        panic!("not an ML program")
    };
    let main = &prog.functions["main"];
    let block = &main.block_specializations[program::OPSET];
    let mut defined: HashSet<String> = main.inputs.iter().map(|i| i.name.clone()).collect();
    let mut types = BTreeMap::new();
    for i in &main.inputs {
        types.insert(i.name.clone(), dims(i.r#type.as_ref().unwrap()));
    }
    let mut blobs = 0;
    for op in &block.operations {
        for (param, arg) in &op.inputs {
            for b in &arg.arguments {
                let Some(mil::argument::binding::Binding::Name(n)) = &b.binding else {
                    panic!("{param} of {} is not bound by name", op.r#type)
                };
                assert!(
                    defined.contains(n),
                    "{} uses {n} before it is defined",
                    op.r#type
                );
            }
        }
        for out in &op.outputs {
            assert!(
                defined.insert(out.name.clone()),
                "{} is defined twice",
                out.name
            );
            types.insert(out.name.clone(), dims(out.r#type.as_ref().unwrap()));
        }
        let Some(mil::value::Value::BlobFileValue(f)) =
            op.attributes.get("val").and_then(|v| v.value.as_ref())
        else {
            continue;
        };
        // A constant in the weight file: its record, then its data, of its declared size.
        assert_eq!(f.file_name, program::WEIGHT_PATH);
        let at = f.offset as usize;
        assert_eq!(at % blob::ALIGN, 0);
        let w = &pkg.weights;
        assert_eq!(
            u32::from_le_bytes(w[at..at + 4].try_into().unwrap()),
            blob::SENTINEL
        );
        assert_eq!(u32::from_le_bytes(w[at + 4..at + 8].try_into().unwrap()), 1);
        let (dtype, d) = &types[&op.outputs[0].name];
        assert_eq!(*dtype, mil::DataType::Float16 as i32);
        let bytes = 2 * d.iter().product::<u64>();
        assert_eq!(u64_at(w, at + 8), bytes);
        let data = u64_at(w, at + 16) as usize;
        assert_eq!(data, at + blob::ALIGN);
        assert!(data + bytes as usize <= w.len());
        blobs += 1;
    }
    // K and V of each KV head; the first head's keys are the page's first rows' first half.
    assert_eq!(blobs, 2 * s.kv_heads);
    let first = u64_at(&pkg.weights, blob::ALIGN + 16) as usize;
    let k0: &[f16] = bytemuck::cast_slice(&pkg.weights[first..first + 2 * s.head_dim]);
    assert_eq!(k0, &k[..s.head_dim]);
    assert_eq!(block.outputs, ["o", "m", "l"]);
    // The description is the program's signature.
    let desc = spec.description.unwrap();
    let features = desc.input.iter().chain(&desc.output).map(|f| {
        let Some(proto::feature_type::Type::MultiArrayType(a)) = &f.r#type.as_ref().unwrap().r#type
        else {
            panic!("{} is not a multi-array", f.name)
        };
        let shape: Vec<u64> = a.shape.iter().map(|&n| n as u64).collect();
        (f.name.clone(), shape)
    });
    for (name, shape) in features {
        assert_eq!(types[&name].1, shape, "{name}");
    }
    assert_eq!(types["q"].1, [1, 16, 1, 3]);
    assert_eq!(types["m"].1, [1, 2, 1, 3]);
}

#[test]
fn a_package_is_a_function_of_its_page() {
    let s = shape();
    let (k, v) = page(&s, 7);
    let a = page_package(&s, &k, &v).unwrap();
    let b = page_package(&s, &k, &v).unwrap();
    assert_eq!((&a.model, &a.weights), (&b.model, &b.weights));
    let (k2, _) = page(&s, 8);
    let c = page_package(&s, &k2, &v).unwrap();
    assert_eq!(a.model, c.model);
    assert_ne!(a.weights, c.weights);
    let dir = std::env::temp_dir().join(format!("tether-coreml-{}", std::process::id()));
    let pkg = dir.join("page.mlpackage");
    a.write(&pkg).unwrap();
    c.write(&pkg).unwrap();
    let weights = std::fs::read(pkg.join("Data/com.apple.CoreML/weights/weight.bin")).unwrap();
    assert_eq!(
        weights, c.weights,
        "a package written again replaces the old one"
    );
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(pkg.join("Manifest.json")).unwrap()).unwrap();
    let root = manifest["rootModelIdentifier"].as_str().unwrap();
    assert_eq!(
        manifest["itemInfoEntries"][root]["path"],
        "com.apple.CoreML/model.mlmodel"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_page_that_cannot_be_a_program_is_refused() {
    let s = shape();
    let (k, v) = page(&s, 1);
    let empty = PageShape { keys: 0, ..s };
    assert!(page_package(&empty, &[], &[]).is_err());
    let short = page_package(&s, &k[1..], &v);
    assert!(short.unwrap_err().to_string().contains("K and V values"));
    let huge = PageShape { keys: 1 << 40, ..s };
    assert!(page_package(&huge, &k, &v)
        .unwrap_err()
        .to_string()
        .contains("MiB"));
    let unscaled = PageShape {
        scale: f32::NAN,
        ..s
    };
    assert!(page_package(&unscaled, &k, &v).is_err());
}
