#!/usr/bin/env python3
"""Write tests/fixtures/gguf/kquants.gguf: random Q4_K, Q5_K and Q6_K blocks (3 rows of 512
weights each; finite f16 scales) beside their values as llama.cpp's gguf-py dequantises them
(`gguf.quants.dequantize`), so tether's dequantisation is tested against that reference.
Not run in CI (needs numpy and llama.cpp's gguf-py).

usage: PYTHONPATH=path/to/llama.cpp/gguf-py python scripts/kquant-fixture.py
"""
import numpy as np
from gguf import GGUFWriter, GGMLQuantizationType as T
from gguf.quants import dequantize

rng = np.random.default_rng(7)
w = GGUFWriter("tests/fixtures/gguf/kquants.gguf", "qwen35")
for name, qt, size in [("q4_k", T.Q4_K, 144), ("q5_k", T.Q5_K, 176), ("q6_k", T.Q6_K, 210)]:
    n = 6
    raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)

    def put_f16(off):
        v = rng.uniform(-0.05, 0.05, size=n).astype(np.float16).view(np.uint8).reshape(n, 2)
        raw[:, off:off + 2] = v

    if qt in (T.Q4_K, T.Q5_K):
        put_f16(0)
        put_f16(2)
    else:
        put_f16(208)
    expected = dequantize(raw.reshape(-1), qt).astype(np.float32).reshape(3, 512)
    w.add_tensor(name, raw.reshape(3, 2 * size), raw_dtype=qt)
    w.add_tensor(name + ".f32", expected)
w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
