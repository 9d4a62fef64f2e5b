"""Checks tether's frozen-page Core ML packages without Apple's Core ML (which only runs on
Apple devices): coremltools loads each package (`load_spec`, `MLModel(skip_model_load=True)`),
its milproto loader rebuilds the MIL program (rerunning type inference, which rejects shapes
and types that do not fit), the model description is compared with the program's inputs and
outputs, and a small interpreter of the ops tether emits runs the program in fp16 (fp32
accumulation inside a convolution or a reduction, as the Neural Engine does) against exact
attention in float64 computed from the page's raw K, V and query files, not from the package.
Malformed copies of a package (bad blob sentinel, wrong blob size, wrong weight shape, a
description that disagrees with the program) must be rejected by the same check.

Usage: check_coreml.py <dir written by the coreml_pages example>
"""

import json
import logging
import os
import shutil
import sys
import tempfile

import numpy as np

logging.disable(logging.WARNING)  # coremltools' notes about the missing Core ML runtime
import coremltools as ct  # noqa: E402
from coremltools.converters.mil.frontend.milproto.load import load as load_milproto  # noqa: E402
from coremltools.converters.mil.mil import types  # noqa: E402

# Within fp16's error for pages of up to 16384 keys. The program's scores are fp16 values, so
# a score s carries up to |s| * 2^-11 of rounding: the log-sum-exp's bound is relative,
# 1e-3 * max(1, |lse|) (a page whose attention peaks at a score of 16 may be off by 0.016
# there, and is off by much less; docs/FROZEN_PAGES.md).
O_TOLERANCE = 5e-3
LSE_TOLERANCE = 1e-3
SPEC_DIR = "Data/com.apple.CoreML"


def load(pkg):
    """The package's spec and its MIL program, type-checked by coremltools."""
    spec = ct.utils.load_spec(pkg)
    ct.models.MLModel(pkg, skip_model_load=True)
    weights = os.path.join(pkg, SPEC_DIR, "weights")
    prog = load_milproto(spec, spec.specificationVersion, weights)
    main = prog.functions["main"]
    described = {
        f.name: (tuple(f.type.multiArrayType.shape), f.type.multiArrayType.dataType)
        for f in list(spec.description.input) + list(spec.description.output)
    }
    array_type = {types.fp16: 65552, types.fp32: 65568}
    vars_ = list(main.inputs.values()) + list(main.outputs)
    in_program = {v.name: (tuple(v.shape), array_type.get(v.dtype)) for v in vars_}
    if described != in_program:
        raise ValueError(f"the description {described} is not the program's {in_program}")
    return spec, main


def fp16_of(var):
    return var.dtype == types.fp16


def run(main, q):
    """Interpret `main` on input `q`: each value rounded to its declared type after each op."""
    env = {"q": q.astype(np.float16)}

    def val(v):
        return v.val if v.op is not None and v.op.op_type == "const" else env[v.name]

    for op in main.operations:
        if op.op_type == "const":
            continue
        x = {k: (tuple(val(a) for a in v) if isinstance(v, (list, tuple)) else val(v))
             for k, v in op.inputs.items()}
        outs = apply(op.op_type, x)
        for var, out in zip(op.outputs, outs):
            out = np.asarray(out, dtype=np.float16 if fp16_of(var) else np.float32)
            if out.shape != tuple(var.shape):
                raise ValueError(f"{op.name}: shape {out.shape}, declared {var.shape}")
            env[var.name] = out
    return {v.name: env[v.name] for v in main.outputs}


def apply(kind, x):
    f32 = lambda a: np.asarray(a, dtype=np.float32)  # noqa: E731
    if kind == "mul":
        return [f32(x["x"]) * f32(x["y"])]
    if kind == "sub":
        return [f32(x["x"]) - f32(x["y"])]
    if kind == "real_div":
        return [f32(x["x"]) / f32(x["y"])]
    if kind == "exp":
        return [np.exp(f32(x["x"]))]
    if kind == "split":
        return np.split(x["x"], int(x["num_splits"]), axis=int(x["axis"]))
    if kind == "concat":
        if x.get("interleave", False):
            raise ValueError("interleaved concat is not emitted by tether")
        return [np.concatenate(x["values"], axis=int(x["axis"]))]
    if kind == "cast":
        return [x["x"]]
    if kind in ("reduce_max", "reduce_sum"):
        reduce = np.max if kind == "reduce_max" else np.sum
        axes = tuple(int(a) for a in np.atleast_1d(x["axes"]))
        return [reduce(f32(x["x"]), axis=axes, keepdims=bool(x["keep_dims"]))]
    if kind == "conv":
        trivial = (list(x["strides"]) == [1, 1] and list(x["dilations"]) == [1, 1]
                   and int(x["groups"]) == 1 and not np.any(x["pad"])
                   and tuple(x["weight"].shape[2:]) == (1, 1))
        if not trivial:
            raise ValueError("only 1x1 convolutions without stride, padding or groups")
        w = f32(x["weight"][:, :, 0, 0])
        return [np.einsum("oc,ncr->nor", w, f32(x["x"][:, :, 0, :]))[:, :, None, :]]
    raise ValueError(f"op {kind} is not one tether emits")


def exact(meta, k, v, q):
    """Attention of every query row over the page in float64: (o, m + ln l) per head and row."""
    keys, heads, dim, rows = meta["keys"], meta["kv_heads"], meta["head_dim"], meta["rows"]
    k = k.astype(np.float64).reshape(keys, heads, dim)
    v = v.astype(np.float64).reshape(keys, heads, dim)
    q = q.astype(np.float64).reshape(heads, dim, rows)
    o = np.zeros((heads, dim, rows))
    lse = np.zeros((heads, rows))
    for h in range(heads):
        s = meta["scale"] * (k[:, h, :] @ q[h])  # [keys, rows]
        m = s.max(axis=0)
        p = np.exp(s - m)
        lse[h] = m + np.log(p.sum(axis=0))
        o[h] = (v[:, h, :].T @ p) / p.sum(axis=0)
    return o, lse


def check(pkg, meta, k, v, q):
    """Load, type-check and run `pkg`; raise unless it matches exact attention."""
    _, main = load(pkg)
    out = run(main, q.reshape(1, -1, 1, meta["rows"]))
    o, lse = exact(meta, k, v, q)
    heads, rows = meta["kv_heads"], meta["rows"]
    got_o = out["o"].astype(np.float64).reshape(heads, meta["head_dim"], rows)
    got_lse = (out["m"].astype(np.float64) + np.log(out["l"].astype(np.float64))).reshape(heads, rows)
    o_err = np.abs(got_o - o).max()
    lse_err = (np.abs(got_lse - lse) / np.maximum(1.0, np.abs(lse))).max()
    if not (o_err <= O_TOLERANCE and lse_err <= LSE_TOLERANCE):
        raise ValueError(f"o differs by {o_err:.2e}, lse by {lse_err:.2e} (relative) from exact attention")
    return o_err, lse_err


def malformed(pkg, scratch):
    """Broken copies of `pkg`, each with what was broken."""
    from coremltools.proto import Model_pb2

    def copy(name):
        dst = os.path.join(scratch, name + ".mlpackage")
        shutil.copytree(pkg, dst)
        return dst, os.path.join(dst, SPEC_DIR)

    def patch_weights(name, at, data):
        dst, d = copy(name)
        with open(os.path.join(d, "weights/weight.bin"), "r+b") as f:
            f.seek(at)
            f.write(data)
        return name, dst

    def patch_spec(name, change):
        dst, d = copy(name)
        path = os.path.join(d, "model.mlmodel")
        spec = Model_pb2.Model()
        with open(path, "rb") as f:
            spec.ParseFromString(f.read())
        change(spec)
        with open(path, "wb") as f:
            f.write(spec.SerializeToString())
        return name, dst

    def grow_weight(spec):
        block = spec.mlProgram.functions["main"].block_specializations["CoreML8"]
        const = next(op for op in block.operations if op.outputs[0].name == "k_0")
        for t in (const.outputs[0].type, const.attributes["val"].type):
            t.tensorType.dimensions[0].constant.size += 1

    def describe_other_shape(spec):
        spec.description.output[0].type.multiArrayType.shape[1] += 1

    first_record = 64
    return [
        patch_weights("bad_sentinel", first_record, b"\x00\x00\x00\x00"),
        patch_weights("wrong_blob_size", first_record + 8, (2).to_bytes(8, "little")),
        patch_spec("wrong_weight_shape", grow_weight),
        patch_spec("description_disagrees", describe_other_shape),
    ]


def main():
    root = sys.argv[1]
    cases = sorted(f[:-5] for f in os.listdir(root) if f.endswith(".json"))
    if not cases:
        sys.exit(f"no packages in {root}")
    failed = False
    for case in cases:
        meta = json.load(open(os.path.join(root, case + ".json")))
        raw = {e: np.fromfile(os.path.join(root, f"{case}.{e}.f16"), dtype="<f2")
               for e in ("k", "v", "q")}
        pkg = os.path.join(root, case + ".mlpackage")
        try:
            o_err, lse_err = check(pkg, meta, raw["k"], raw["v"], raw["q"])
            print(f"ok   {case}: o within {o_err:.2e}, lse within {lse_err:.2e} (relative) of exact")
        except Exception as e:  # noqa: BLE001 - every failure is reported, then the exit fails
            print(f"FAIL {case}: {type(e).__name__}: {e}")
            failed = True
            continue
        with tempfile.TemporaryDirectory() as scratch:
            for what, bad in malformed(pkg, scratch):
                try:
                    check(bad, meta, raw["k"], raw["v"], raw["q"])
                    print(f"FAIL {case} {what}: accepted")
                    failed = True
                except Exception as e:  # noqa: BLE001
                    print(f"ok   {case} {what}: rejected ({type(e).__name__}: {str(e)[:100]})")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
