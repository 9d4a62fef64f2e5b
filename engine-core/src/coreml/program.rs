//! The ML Program of a frozen page: attention of a few query rows over the page's keys, with
//! K and V as fp16 constants, written op by op as Core ML's MIL protobuf.
//!
//! The form is the one the Neural Engine runs well, channels first: a query row is a column
//! of `[1, head_dim, 1, rows]`, and each KV head's keys are the weights of a 1x1 convolution
//! (`[keys, head_dim, 1, 1]`) whose output is the scores `[1, keys, 1, rows]`; the softmax is
//! spelled out (reduce_max, sub, exp, reduce_sum) so that `m` and `l` come out beside `o`, and
//! the values are a second convolution's weights (`[head_dim, keys, 1, 1]`). One convolution
//! per KV head, its query rows the group of query heads that share it. Every parameter of an
//! op is a `const` op of its own, as Core ML's own converter writes them.

use std::collections::BTreeMap;

use half::f16;

use super::blob::{BlobType, WeightFile};
use super::proto::mil_spec as mil;
use super::PageShape;

/// The iOS 18 opset (specification version 9).
pub const OPSET: &str = "CoreML8";
/// Where a package's weight file is, as its program names it.
pub const WEIGHT_PATH: &str = "@model_path/weights/weight.bin";

/// The program and its weight file.
pub struct Built {
    pub program: mil::Program,
    pub weights: Vec<u8>,
}

/// The page program for `shape`; `k` and `v` are the page's rows, `[keys][kv_heads][head_dim]`.
pub fn page_attention(shape: &PageShape, k: &[f16], v: &[f16]) -> Built {
    let PageShape {
        keys,
        kv_heads,
        head_dim,
        rows,
        scale,
    } = *shape;
    let mut b = Builder::default();
    let q_shape = [1, kv_heads * head_dim, 1, rows];
    let head_q = [1, head_dim, 1, rows];
    let scale = b.scalar_f16("scale", f16::from_f32(scale));
    let scaled = b.op(
        "mul",
        "q_scaled",
        &[("x", &["q"]), ("y", &[&scale])],
        F16,
        &q_shape,
    );
    let heads: Vec<String> = (0..kv_heads).map(|h| format!("q_{h}")).collect();
    let splits = b.scalar_i32("split_count", kv_heads as i32);
    let axis = b.scalar_i32("split_axis", 1);
    b.op_outputs(
        "split",
        "q_split",
        &[
            ("x", &[&scaled]),
            ("num_splits", &[&splits]),
            ("axis", &[&axis]),
        ],
        heads
            .iter()
            .map(|n| (n.clone(), tensor(F16, &head_q)))
            .collect(),
    );
    let (mut o, mut m, mut l) = (Vec::new(), Vec::new(), Vec::new());
    for (h, q) in heads.iter().enumerate() {
        let (kh, vh) = head_weights(k, v, shape, h);
        let kw = b.blob_f16(&format!("k_{h}"), &[keys, head_dim, 1, 1], &kh);
        let vw = b.blob_f16(&format!("v_{h}"), &[head_dim, keys, 1, 1], &vh);
        let s = b.conv(&format!("scores_{h}"), q, &kw, &[1, keys, 1, rows]);
        let row = [1, 1, 1, rows];
        let mh = b.reduce("reduce_max", &format!("m_{h}"), &s, &row);
        let d = b.op(
            "sub",
            &format!("shifted_{h}"),
            &[("x", &[&s]), ("y", &[&mh])],
            F16,
            &[1, keys, 1, rows],
        );
        let p = b.op(
            "exp",
            &format!("p_{h}"),
            &[("x", &[&d])],
            F16,
            &[1, keys, 1, rows],
        );
        let lh = b.reduce("reduce_sum", &format!("l_{h}"), &p, &row);
        let u = b.conv(&format!("unnormed_{h}"), &p, &vw, &head_q);
        o.push(b.op(
            "real_div",
            &format!("o_{h}"),
            &[("x", &[&u]), ("y", &[&lh])],
            F16,
            &head_q,
        ));
        m.push(mh);
        l.push(lh);
    }
    let per_head = [1, kv_heads, 1, rows];
    for (name, parts, shape) in [("o", &o, q_shape), ("m", &m, per_head), ("l", &l, per_head)] {
        let joined = b.concat(&format!("{name}_f16"), parts, &shape);
        let dtype = b.scalar_str(&format!("{name}_dtype"), "fp32");
        b.op(
            "cast",
            name,
            &[("x", &[&joined]), ("dtype", &[&dtype])],
            F32,
            &shape,
        );
    }
    let block = mil::Block {
        inputs: Vec::new(),
        outputs: vec!["o".into(), "m".into(), "l".into()],
        operations: b.ops,
        attributes: BTreeMap::new(),
    };
    let main = mil::Function {
        inputs: vec![named("q", tensor(F16, &q_shape))],
        opset: OPSET.into(),
        block_specializations: BTreeMap::from([(OPSET.to_string(), block)]),
        attributes: BTreeMap::new(),
    };
    Built {
        program: mil::Program {
            version: 1,
            functions: BTreeMap::from([("main".to_string(), main)]),
            doc_string: String::new(),
            attributes: BTreeMap::new(),
        },
        weights: b.weights.into_bytes(),
    }
}

/// KV head `h`'s keys as `[keys][head_dim]` and its values transposed, `[head_dim][keys]`:
/// the two convolutions' weights.
fn head_weights(k: &[f16], v: &[f16], shape: &PageShape, h: usize) -> (Vec<f16>, Vec<f16>) {
    let (d, width) = (shape.head_dim, shape.kv_heads * shape.head_dim);
    let row = |t: usize| t * width + h * d;
    let kh = (0..shape.keys)
        .flat_map(|t| k[row(t)..row(t) + d].iter().copied())
        .collect();
    let vh = (0..d)
        .flat_map(|i| (0..shape.keys).map(move |t| v[row(t) + i]))
        .collect();
    (kh, vh)
}

const F16: mil::DataType = mil::DataType::Float16;
const F32: mil::DataType = mil::DataType::Float32;

fn tensor(dtype: mil::DataType, shape: &[usize]) -> mil::ValueType {
    use mil::dimension::{ConstantDimension, Dimension};
    mil::ValueType {
        r#type: Some(mil::value_type::Type::TensorType(mil::TensorType {
            data_type: dtype as i32,
            rank: shape.len() as i64,
            dimensions: shape
                .iter()
                .map(|&n| mil::Dimension {
                    dimension: Some(Dimension::Constant(ConstantDimension { size: n as u64 })),
                })
                .collect(),
            attributes: BTreeMap::new(),
        })),
    }
}

fn named(name: &str, ty: mil::ValueType) -> mil::NamedValueType {
    mil::NamedValueType {
        name: name.into(),
        r#type: Some(ty),
    }
}

fn immediate(dtype: mil::DataType, shape: &[usize], v: mil::tensor_value::Value) -> mil::Value {
    use mil::value::{immediate_value, ImmediateValue, Value};
    mil::Value {
        doc_string: String::new(),
        r#type: Some(tensor(dtype, shape)),
        value: Some(Value::ImmediateValue(ImmediateValue {
            value: Some(immediate_value::Value::Tensor(mil::TensorValue {
                value: Some(v),
            })),
        })),
    }
}

fn string_value(s: &str) -> mil::Value {
    use mil::tensor_value::{RepeatedStrings, Value};
    let values = vec![s.to_string()];
    immediate(
        mil::DataType::String,
        &[],
        Value::Strings(RepeatedStrings { values }),
    )
}

/// The program's operations as they are added, and the weight file their blobs go to.
#[derive(Default)]
struct Builder {
    ops: Vec<mil::Operation>,
    weights: WeightFile,
}

impl Builder {
    /// A `const` op named `name` holding `val`; returns the name.
    fn constant(&mut self, name: &str, val: mil::Value) -> String {
        let ty = val.r#type.clone().expect("a constant has a type");
        self.ops.push(mil::Operation {
            r#type: "const".into(),
            inputs: BTreeMap::new(),
            outputs: vec![named(name, ty)],
            blocks: Vec::new(),
            attributes: BTreeMap::from([
                ("name".to_string(), string_value(name)),
                ("val".to_string(), val),
            ]),
        });
        name.to_string()
    }

    fn scalar_i32(&mut self, name: &str, v: i32) -> String {
        self.ints(name, &[], vec![v])
    }

    fn ints(&mut self, name: &str, shape: &[usize], values: Vec<i32>) -> String {
        use mil::tensor_value::{RepeatedInts, Value};
        let val = immediate(
            mil::DataType::Int32,
            shape,
            Value::Ints(RepeatedInts { values }),
        );
        self.constant(name, val)
    }

    fn scalar_bool(&mut self, name: &str, v: bool) -> String {
        use mil::tensor_value::{RepeatedBools, Value};
        let values = vec![v];
        let val = immediate(
            mil::DataType::Bool,
            &[],
            Value::Bools(RepeatedBools { values }),
        );
        self.constant(name, val)
    }

    fn scalar_str(&mut self, name: &str, s: &str) -> String {
        self.constant(name, string_value(s))
    }

    /// An fp16 immediate: Core ML keeps those as the value's little-endian bytes.
    fn scalar_f16(&mut self, name: &str, v: f16) -> String {
        use mil::tensor_value::{RepeatedBytes, Value};
        let values = v.to_le_bytes().to_vec();
        let val = immediate(F16, &[], Value::Bytes(RepeatedBytes { values }));
        self.constant(name, val)
    }

    /// An fp16 tensor kept in the weight file.
    fn blob_f16(&mut self, name: &str, shape: &[usize], data: &[f16]) -> String {
        use mil::value::{BlobFileValue, Value};
        let offset = self.weights.push(BlobType::F16, bytemuck::cast_slice(data));
        let val = mil::Value {
            doc_string: String::new(),
            r#type: Some(tensor(F16, shape)),
            value: Some(Value::BlobFileValue(BlobFileValue {
                file_name: WEIGHT_PATH.into(),
                offset,
            })),
        };
        self.constant(name, val)
    }

    /// An op with one output, `name`, of `dtype` and `shape`.
    fn op(
        &mut self,
        ty: &str,
        name: &str,
        inputs: &[(&str, &[&str])],
        dtype: mil::DataType,
        shape: &[usize],
    ) -> String {
        self.op_outputs(
            ty,
            name,
            inputs,
            vec![(name.to_string(), tensor(dtype, shape))],
        );
        name.to_string()
    }

    /// An op named `name` with its inputs bound to earlier values by name.
    fn op_outputs(
        &mut self,
        ty: &str,
        name: &str,
        inputs: &[(&str, &[&str])],
        outputs: Vec<(String, mil::ValueType)>,
    ) {
        use mil::argument::{binding, Binding};
        let bind = |names: &[&str]| mil::Argument {
            arguments: names
                .iter()
                .map(|n| Binding {
                    binding: Some(binding::Binding::Name(n.to_string())),
                })
                .collect(),
        };
        self.ops.push(mil::Operation {
            r#type: ty.into(),
            inputs: inputs
                .iter()
                .map(|(param, names)| (param.to_string(), bind(names)))
                .collect(),
            outputs: outputs.into_iter().map(|(n, t)| named(&n, t)).collect(),
            blocks: Vec::new(),
            attributes: BTreeMap::from([("name".to_string(), string_value(name))]),
        });
    }

    /// A 1x1 convolution of `x` by `weight`, stride 1, no padding: one output channel per
    /// weight row.
    fn conv(&mut self, name: &str, x: &str, weight: &str, out: &[usize]) -> String {
        let strides = self.ints(&format!("{name}_strides"), &[2], vec![1, 1]);
        let pad_type = self.scalar_str(&format!("{name}_pad_type"), "valid");
        let pad = self.ints(&format!("{name}_pad"), &[4], vec![0; 4]);
        let dilations = self.ints(&format!("{name}_dilations"), &[2], vec![1, 1]);
        let groups = self.scalar_i32(&format!("{name}_groups"), 1);
        let inputs: [(&str, &[&str]); 7] = [
            ("x", &[x]),
            ("weight", &[weight]),
            ("strides", &[&strides]),
            ("pad_type", &[&pad_type]),
            ("pad", &[&pad]),
            ("dilations", &[&dilations]),
            ("groups", &[&groups]),
        ];
        self.op("conv", name, &inputs, F16, out)
    }

    /// `ty` (reduce_max, reduce_sum) over the channels (axis 1), kept as a dimension of 1.
    fn reduce(&mut self, ty: &str, name: &str, x: &str, out: &[usize]) -> String {
        let axes = self.ints(&format!("{name}_axes"), &[1], vec![1]);
        let keep = self.scalar_bool(&format!("{name}_keep_dims"), true);
        let inputs: [(&str, &[&str]); 3] =
            [("x", &[x]), ("axes", &[&axes]), ("keep_dims", &[&keep])];
        self.op(ty, name, &inputs, F16, out)
    }

    /// `parts` side by side along the channels.
    fn concat(&mut self, name: &str, parts: &[String], out: &[usize]) -> String {
        let axis = self.scalar_i32(&format!("{name}_axis"), 1);
        let interleave = self.scalar_bool(&format!("{name}_interleave"), false);
        let values: Vec<&str> = parts.iter().map(String::as_str).collect();
        let inputs: [(&str, &[&str]); 3] = [
            ("values", &values),
            ("axis", &[&axis]),
            ("interleave", &[&interleave]),
        ];
        self.op("concat", name, &inputs, F16, out)
    }
}
