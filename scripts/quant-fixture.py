#!/usr/bin/env python3
"""Write tests/fixtures/gguf/quants.gguf: random blocks of every quantised type tether reads
(3 rows of 512 weights each; finite f16 scales) beside their values as llama.cpp's gguf-py
dequantises them (`gguf.quants.dequantize`), so tether's dequantisation is tested against that
reference. Not run in CI (needs numpy and llama.cpp's gguf-py).

usage: PYTHONPATH=path/to/llama.cpp/gguf-py python scripts/quant-fixture.py
"""
import numpy as np
from gguf import GGUFWriter, GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

# Each type and the byte offsets of its f16 scales within a block.
TYPES = [
    ("q4_0", T.Q4_0, [0]),
    ("q4_1", T.Q4_1, [0, 2]),
    ("q5_0", T.Q5_0, [0]),
    ("q5_1", T.Q5_1, [0, 2]),
    ("q8_0", T.Q8_0, [0]),
    ("iq4_nl", T.IQ4_NL, [0]),
    ("q2_k", T.Q2_K, [80, 82]),
    ("q3_k", T.Q3_K, [108]),
    ("q4_k", T.Q4_K, [0, 2]),
    ("q5_k", T.Q5_K, [0, 2]),
    ("q6_k", T.Q6_K, [208]),
    ("iq4_xs", T.IQ4_XS, [0]),
]

rng = np.random.default_rng(7)
w = GGUFWriter("tests/fixtures/gguf/quants.gguf", "qwen35")
rows, cols = 3, 512
for name, qt, scales in TYPES:
    block, size = GGML_QUANT_SIZES[qt]
    n = rows * cols // block
    raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    for off in scales:
        v = rng.uniform(-0.05, 0.05, size=n).astype(np.float16).view(np.uint8).reshape(n, 2)
        raw[:, off:off + 2] = v
    expected = dequantize(raw.reshape(-1), qt).astype(np.float32).reshape(rows, cols)
    w.add_tensor(name, raw.reshape(rows, cols // block * size), raw_dtype=qt)
    w.add_tensor(name + ".f32", expected)
w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
