#!/usr/bin/env python3
"""Independent numpy reference for the Qwen3.5 dense hybrid and its multi-token-prediction head.

This script is numpy only. It does not use torch, transformers or tether, and it computes
everything in float64 from the stored weights. It is written from `MODEL.md` (the main model)
and from the vLLM Qwen3.5 MTP code (`Qwen3_5MultiTokenPredictor`, `EagleProposer` with
method "mtp"). Its outputs are fixtures for tether's MTP drafter.

Usage:
    mtp-reference.py DIR --tokens 3,17,... --chain K --out FILE

DIR holds `config.json` (HF layout; the text fields may sit under `text_config`) and
`model.safetensors` (or shards listed in `model.safetensors.index.json`). The tensor names
are the HF ones: `model.layers.N.*` (or `model.language_model.layers.N.*`),
`model.embed_tokens.weight`, `model.norm.weight`, and `lm_head.weight` unless
`tie_word_embeddings`. The MTP tensors are `mtp.*`; `model.mtp.*` and
`model.language_model.mtp.*` are accepted too. Weights may be stored as F32, F16, BF16 or F64.

What it computes, for the tokens x_0..x_{T-1}:

1. The main model, token by token. Linear layers use the recurrent DeltaNet (conv window plus
   delta-rule state); full-attention layers use a KV cache. Token x_i sits at RoPE position i.
   Outputs: `logits` [T, V], and `hidden` [T, H] = the rows after the main final norm
   (`model.norm`), i.e. the vectors that lm_head multiplies.

2. The MTP head over the pairs (h_i, x_{i+1}) for i = 0..T-2. Row i runs at RoPE position i
   (vLLM's convention: the position of the hidden state). The rows go through the MTP
   layer's own KV cache in that order. Output: `mtp_logits` [T-1, V]; row i drafts x_{i+2}.

3. Chained drafts. `next` = argmax of logits[T-1]. Step 0 is the pair (h_{T-1}, next) at
   position T-1; its K/V are appended to the same MTP cache after the T-1 rows of part 2.
   Step j >= 1 is the pair (g_{j-1}, d_j) at position T-1+j. Here g_{j-1} is step j-1's MTP
   output after `mtp.norm` (the lm_head input), and d_j = argmax of step j-1's logits.
   Outputs: `chain_tokens` [K] = d_1..d_K and `chain_logits` [K, V] (row j is step j's logits;
   d_{j+1} is its argmax).

One MTP row (hidden h, token x, position p):
    e  = rmsnorm1p(embed[x], mtp.pre_fc_norm_embedding)       # the main model's embedding
    h' = rmsnorm1p(h,        mtp.pre_fc_norm_hidden)
    u  = mtp.fc @ concat([e, h'])                              # embedding FIRST, then hidden
    a  = u + gated_attention(rmsnorm1p(u, input_layernorm), p) # against the MTP's own KV cache
    o  = a + down(silu(gate(m)) * up(m)),  m = rmsnorm1p(a, post_attention_layernorm)
    g  = rmsnorm1p(o, mtp.norm)
    logits = lm_head @ g                                       # the main lm_head (= embed if tied)
The layer is `mtp.layers.0.*`. It has the same form as the main model's full-attention layers:
q_proj rows per head are [query hd | gate hd]; q_norm and k_norm are applied per head; then
partial NeoX RoPE on the first hd*partial_rotary_factor dims; GQA causal softmax with scale
hd^-0.5; the output is multiplied by sigmoid(gate); then o_proj.

Conventions:
  * rmsnorm1p(x, w) = x / sqrt(mean(x^2) + eps) * (1 + w) with eps = rms_norm_eps. All model
    norms use it: the main norms, q_norm/k_norm, and all MTP norms. The exception is the
    DeltaNet gated norm, which uses the plain weight w.
  * Computation is in float64 throughout. Floats are written as float32.
  * argmax is numpy's (the first index wins a tie), taken on the float64 logits. For each
    argmax the script prints the margin between the top two logits, so that near-ties, where
    an f32/bf16 engine could legitimately pick the other token, can be seen.

Output FILE (safetensors): `tokens` i64 [T], `logits` f32 [T,V], `hidden` f32 [T,H],
`mtp_logits` f32 [T-1,V], `next` i64 [1], `chain_tokens` i64 [K], `chain_logits` f32 [K,V].

Needs: numpy and safetensors (e.g. `python3 -m venv venv && venv/bin/pip install numpy safetensors`).
"""
import argparse
import json
import os
import struct
import sys

import numpy as np

# ---------------------------------------------------------------------------------------------
# Loading

_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4"}


def _read_safetensors(path):
    """All tensors of one safetensors file as float64 numpy arrays. This is a small reader of its
    own because numpy has no bfloat16. A BF16 value is the high half of an f32."""
    out = {}
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        blob = f.read()
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        a, b = meta["data_offsets"]
        raw = blob[a:b]
        dt, shape = meta["dtype"], meta["shape"]
        if dt == "BF16":
            bits = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
            arr = bits.view(np.float32)
        elif dt in _DTYPES:
            arr = np.frombuffer(raw, dtype=_DTYPES[dt])
        else:
            sys.exit(f"{path}: tensor {name} has dtype {dt}; this script reads F64/F32/F16/BF16")
        out[name] = arr.astype(np.float64).reshape(shape)
    return out


def load_weights(d):
    index = os.path.join(d, "model.safetensors.index.json")
    if os.path.exists(index):
        files = sorted(set(json.load(open(index))["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    W = {}
    for fn in files:
        for k, v in _read_safetensors(os.path.join(d, fn)).items():
            # One naming: `model.*` for the main model, `mtp.*` for the head.
            for pre, new in (("model.language_model.mtp.", "mtp."), ("model.mtp.", "mtp."),
                             ("model.language_model.", "model.")):
                if k.startswith(pre):
                    k = new + k[len(pre):]
                    break
            W[k] = v
    return W


class Config:
    def __init__(self, d):
        root = json.load(open(os.path.join(d, "config.json")))
        c = root.get("text_config", root)
        self.H = c["hidden_size"]
        self.V = c["vocab_size"]
        self.L = c["num_hidden_layers"]
        self.eps = float(c["rms_norm_eps"])
        self.nh, self.nkv, self.hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        self.Hk, self.Hv = c["linear_num_key_heads"], c["linear_num_value_heads"]
        self.dk, self.dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
        self.conv_k = c["linear_conv_kernel_dim"]
        rp = c.get("rope_parameters") or c.get("rope_scaling") or {}

        def rope_field(name, default=None):
            v = rp.get(name, c.get(name, default))
            if v is None:
                sys.exit(f"config.json: missing {name}")
            return float(v)

        self.theta = rope_field("rope_theta")
        self.rot = int(self.hd * rope_field("partial_rotary_factor", 1.0))
        self.tied = bool(c.get("tie_word_embeddings", root.get("tie_word_embeddings", False)))
        types = c.get("layer_types")
        if types is None:
            iv = c.get("full_attention_interval", 4)
            types = ["full_attention" if (i + 1) % iv == 0 else "linear_attention" for i in range(self.L)]
        self.types = types
        self.mtp_layers = c.get("mtp_num_hidden_layers", c.get("num_nextn_predict_layers", 0))


# ---------------------------------------------------------------------------------------------
# Building blocks (float64)


def silu(x):
    return x / (1.0 + np.exp(-x))


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def softplus(x):
    return np.logaddexp(0.0, x)


class Model:
    def __init__(self, cfg, W):
        self.c, self.W = cfg, W
        self.embed = W["model.embed_tokens.weight"]
        self.lm_head = self.embed if cfg.tied else W["lm_head.weight"]
        half = cfg.rot // 2
        self.inv_freq = cfg.theta ** (-(np.arange(half, dtype=np.float64) * 2.0) / cfg.rot)

    # -- shared pieces ------------------------------------------------------------------------

    def rmsnorm1p(self, x, w):
        """Zero-centred RMSNorm over the last axis: x / rms(x) * (1 + w)."""
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.c.eps) * (1.0 + w)

    def rope(self, x, pos):
        """x [heads, hd]. Rotate-half (NeoX) on dims [0, rot); dims [rot, hd) pass through."""
        half = self.c.rot // 2
        ang = pos * self.inv_freq
        cos, sin = np.cos(ang), np.sin(ang)
        y = x.copy()
        a, b = x[:, :half], x[:, half:2 * half]
        y[:, :half] = a * cos - b * sin
        y[:, half:2 * half] = b * cos + a * sin
        return y

    def attention_step(self, p, x_normed, pos, cache):
        """One token of a gated full-attention layer with prefix `p` (ending in `self_attn.`).
        `cache` is a dict with lists "k", "v" of [nkv, hd] rows; this token's K/V are appended."""
        c, W = self.c, self.W
        qg = (W[p + "q_proj.weight"] @ x_normed).reshape(c.nh, 2 * c.hd)
        q, gate = qg[:, :c.hd], qg[:, c.hd:]
        k = (W[p + "k_proj.weight"] @ x_normed).reshape(c.nkv, c.hd)
        v = (W[p + "v_proj.weight"] @ x_normed).reshape(c.nkv, c.hd)
        q = self.rope(self.rmsnorm1p(q, W[p + "q_norm.weight"]), pos)
        k = self.rope(self.rmsnorm1p(k, W[p + "k_norm.weight"]), pos)
        cache["k"].append(k)
        cache["v"].append(v)
        Ks = np.stack(cache["k"])  # [t, nkv, hd]
        Vs = np.stack(cache["v"])
        group = c.nh // c.nkv
        out = np.empty((c.nh, c.hd))
        for j in range(c.nh):
            kv = j // group
            s = Ks[:, kv, :] @ q[j] / np.sqrt(c.hd)
            s = np.exp(s - s.max())
            out[j] = (s / s.sum()) @ Vs[:, kv, :]
        o = out.reshape(-1) * sigmoid(gate.reshape(-1))
        return W[p + "o_proj.weight"] @ o

    def mlp(self, p, x):
        W = self.W
        return W[p + "down_proj.weight"] @ (silu(W[p + "gate_proj.weight"] @ x) * (W[p + "up_proj.weight"] @ x))

    # -- main model ---------------------------------------------------------------------------

    def new_main_state(self):
        c = self.c
        st = []
        for t in c.types:
            if t == "full_attention":
                st.append({"k": [], "v": []})
            else:
                conv_dim = 2 * c.Hk * c.dk + c.Hv * c.dv
                st.append({"conv": np.zeros((conv_dim, c.conv_k - 1)), "S": np.zeros((c.Hv, c.dk, c.dv))})
        return st

    def deltanet_step(self, p, x_normed, st):
        c, W = self.c, self.W
        kd = c.Hk * c.dk
        qkv = W[p + "in_proj_qkv.weight"] @ x_normed
        z = (W[p + "in_proj_z.weight"] @ x_normed).reshape(c.Hv, c.dv)
        b = W[p + "in_proj_b.weight"] @ x_normed
        a = W[p + "in_proj_a.weight"] @ x_normed
        window = np.concatenate([st["conv"], qkv[:, None]], axis=1)  # [conv_dim, K], newest last
        st["conv"] = window[:, 1:]
        taps = W[p + "conv1d.weight"][:, 0, :]
        cv = silu(np.sum(window * taps, axis=1))
        q = cv[:kd].reshape(c.Hk, c.dk)
        k = cv[kd:2 * kd].reshape(c.Hk, c.dk)
        v = cv[2 * kd:].reshape(c.Hv, c.dv)
        q = q / np.sqrt(np.sum(q * q, axis=-1, keepdims=True) + 1e-6) / np.sqrt(c.dk)
        k = k / np.sqrt(np.sum(k * k, axis=-1, keepdims=True) + 1e-6)
        beta = sigmoid(b)
        g = -np.exp(W[p + "A_log"]) * softplus(a + W[p + "dt_bias"])
        group = c.Hv // c.Hk
        S = st["S"]
        o = np.empty((c.Hv, c.dv))
        for j in range(c.Hv):
            kj, qj = k[j // group], q[j // group]
            Sj = S[j] * np.exp(g[j])                       # [dk, dv]
            delta = beta[j] * (v[j] - Sj.T @ kj)
            Sj = Sj + np.outer(kj, delta)
            S[j] = Sj
            o[j] = Sj.T @ qj
        o = o / np.sqrt(np.mean(o * o, axis=-1, keepdims=True) + c.eps) * W[p + "norm.weight"]  # plain w
        o = o * silu(z)
        return W[p + "out_proj.weight"] @ o.reshape(-1)

    def main_step(self, tok, pos, state):
        """Returns (logits [V], hidden [H]) with hidden = the final-norm output."""
        W = self.W
        x = self.embed[tok].copy()
        for i, t in enumerate(self.c.types):
            p = f"model.layers.{i}."
            h = self.rmsnorm1p(x, W[p + "input_layernorm.weight"])
            if t == "full_attention":
                x = x + self.attention_step(p + "self_attn.", h, pos, state[i])
            else:
                x = x + self.deltanet_step(p + "linear_attn.", h, state[i])
            x = x + self.mlp(p + "mlp.", self.rmsnorm1p(x, W[p + "post_attention_layernorm.weight"]))
        hid = self.rmsnorm1p(x, W["model.norm.weight"])
        return self.lm_head @ hid, hid

    # -- MTP head -----------------------------------------------------------------------------

    def mtp_step(self, hidden, tok, pos, cache):
        """One MTP row: (hidden, token) at RoPE position `pos`, appended to `cache`.
        Returns (logits [V], g [H]) with g = the mtp.norm output (the lm_head input)."""
        W = self.W
        e = self.rmsnorm1p(self.embed[tok], W["mtp.pre_fc_norm_embedding.weight"])
        hn = self.rmsnorm1p(hidden, W["mtp.pre_fc_norm_hidden.weight"])
        u = W["mtp.fc.weight"] @ np.concatenate([e, hn])
        p = "mtp.layers.0."
        u = u + self.attention_step(p + "self_attn.", self.rmsnorm1p(u, W[p + "input_layernorm.weight"]), pos, cache)
        u = u + self.mlp(p + "mlp.", self.rmsnorm1p(u, W[p + "post_attention_layernorm.weight"]))
        g = self.rmsnorm1p(u, W["mtp.norm.weight"])
        return self.lm_head @ g, g


def argmax_with_margin(logits):
    order = np.argsort(-logits, kind="stable")
    top = int(order[0])
    margin = float(logits[order[0]] - logits[order[1]]) if logits.size > 1 else float("inf")
    return top, margin


def run(d, tokens, chain):
    cfg = Config(d)
    W = load_weights(d)
    if not any(k.startswith("mtp.") for k in W):
        sys.exit(f"{d}: no mtp.* tensors (config mtp_num_hidden_layers = {cfg.mtp_layers})")
    m = Model(cfg, W)
    T = len(tokens)
    for t in tokens:
        if not 0 <= t < cfg.V:
            sys.exit(f"token {t} is outside the vocabulary (0..{cfg.V - 1})")

    state = m.new_main_state()
    logits = np.zeros((T, cfg.V))
    hidden = np.zeros((T, cfg.H))
    for i, t in enumerate(tokens):
        logits[i], hidden[i] = m.main_step(t, i, state)

    cache = {"k": [], "v": []}
    mtp_logits = np.zeros((T - 1, cfg.V))
    for i in range(T - 1):
        mtp_logits[i], _ = m.mtp_step(hidden[i], tokens[i + 1], i, cache)

    nxt, margin = argmax_with_margin(logits[T - 1])
    margins = [("next", nxt, margin)]
    chain_tokens = np.zeros(chain, dtype=np.int64)
    chain_logits = np.zeros((chain, cfg.V))
    h, tok = hidden[T - 1], nxt
    for j in range(chain):
        chain_logits[j], h = m.mtp_step(h, tok, T - 1 + j, cache)
        tok, margin = argmax_with_margin(chain_logits[j])
        chain_tokens[j] = tok
        margins.append((f"d_{j + 1}", tok, margin))

    out = {
        "tokens": np.asarray(tokens, dtype=np.int64),
        "logits": logits.astype(np.float32),
        "hidden": hidden.astype(np.float32),
        "mtp_logits": mtp_logits.astype(np.float32),
        "next": np.asarray([nxt], dtype=np.int64),
        "chain_tokens": chain_tokens,
        "chain_logits": chain_logits.astype(np.float32),
    }
    return out, margins


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", help="model directory: config.json + model.safetensors (with mtp.* tensors)")
    ap.add_argument("--tokens", required=True, help="comma-separated prompt token ids (at least 1)")
    ap.add_argument("--chain", type=int, required=True, help="number of chained MTP drafts K (>= 0)")
    ap.add_argument("--out", required=True, help="output .safetensors file")
    args = ap.parse_args()
    tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
    if not tokens:
        sys.exit("--tokens: give at least one token id")
    if args.chain < 0:
        sys.exit("--chain must be >= 0")
    out, margins = run(args.dir, tokens, args.chain)

    from safetensors.numpy import save_file

    save_file({k: np.ascontiguousarray(v) for k, v in out.items()}, args.out)
    print(f"wrote {args.out}: T={len(tokens)} K={args.chain}")
    for name, tok, margin in margins:
        flag = "   <-- near-tie" if margin < 1e-3 else ""
        print(f"  {name:>6} = {tok:6d}  top1-top2 margin {margin:.3e}{flag}")


if __name__ == "__main__":
    main()
