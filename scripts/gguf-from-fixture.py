#!/usr/bin/env python3
"""Convert a fixture checkpoint (../shared/fixtures/tiny_*) to GGUF with llama.cpp's own
converter, so tether's GGUF loader is tested against the converter's layout rather than
against tether's reading of it. Not run in CI (the converter needs torch).

The fixtures have a 256-token vocabulary and no tokenizer, which the converter cannot take
(it hashes a real tokenizer's pre-tokenizer), so its vocabulary step alone is replaced with 256
byte tokens; every tensor and every other metadata key is the converter's own.

usage: LLAMA_CPP=path/to/llama.cpp python scripts/gguf-from-fixture.py FIXTURE_DIR OUT.gguf
       [--outtype f32|f16|bf16|q8_0]
"""
import os
import sys
from pathlib import Path

llama = Path(os.environ["LLAMA_CPP"])
sys.path.insert(0, str(llama))
sys.path.insert(1, str(llama / "gguf-py"))

import gguf  # noqa: E402
from conversion import base  # noqa: E402


def byte_vocab(self) -> None:
    n = self.hparams["vocab_size"]
    self.gguf_writer.add_tokenizer_model("gpt2")
    self.gguf_writer.add_tokenizer_pre("default")
    self.gguf_writer.add_token_list([f"<{i}>" for i in range(n)])
    self.gguf_writer.add_token_types([gguf.TokenType.NORMAL] * n)
    self.gguf_writer.add_token_merges([])


base.TextModel._set_vocab_gpt2 = byte_vocab
base.TextModel._set_vocab_sentencepiece = lambda self, *a, **k: byte_vocab(self)
base.TextModel._set_vocab_qwen = byte_vocab

import convert_hf_to_gguf  # noqa: E402

fixture, out, *rest = sys.argv[1:]
sys.argv = ["convert_hf_to_gguf.py", fixture, "--outfile", out, *rest]
convert_hf_to_gguf.main()
