#!/usr/bin/env python3
"""Build keel's oracle fixtures from tiny random Hugging Face models.

For each tiny model (GPT-2, Llama, BLOOM: keel's gpt2 family with ALiBi and an
embedding LayerNorm, Qwen2: llama with q/k/v biases, and Qwen3: llama with per-head q/k
RMSNorms and a head size other than d_model / n_heads) this script

  1. builds the model with HF transformers and re-initialises every parameter
     (in keel's naming and layout, float32, fixed seed),
  2. runs a fixed batch through it in float64 and records logits, the masked
     mean cross-entropy loss, and d loss / d param for every keel parameter,
  3. runs S AdamW steps (grad-norm clipping, decay by role) in float64 and
     records the per-step losses, the pre-clip global grad norms, and the
     final parameters,
  4. writes test/fixtures/<name>.safetensors (float32 / int32) and
     test/fixtures/<name>.json (model, batch and optimizer settings).

keel's C++ CPU backend is tested against these files, so the C++ test path
never needs Python. Everything is deterministic: running the script twice
produces byte-identical files (use --check to verify committed fixtures).

Precision: HF's Llama code upcasts to float32 in RMSNorm, softmax and the
rotary tables, which would cap a float64 run at float32 accuracy. While the
float64 oracle runs, those three spots are patched to keep the input dtype
(the maths is unchanged). HF's BLOOM upcasts its softmax to float32 too (patched
the same way), and writes GELU's sqrt(2/pi) as 0.79788456 in a hand-written
forward and backward; the float64 run uses the exact constant, keel's (both
round to the same float32), and autograd's backward. The script cross-checks the result three ways:
  * against an independent float64 implementation written here from keel's
    parameter layout (this proves the name/layout mapping, to ~1e-12),
  * against the unpatched HF model in float32 (the patches change nothing but
    precision, to ~1e-5),
  * the AdamW run on HF tensors against one on keel-named tensors.

Usage:
  python3 scripts/make_fixtures.py                 # writes test/fixtures/
  python3 scripts/make_fixtures.py --check         # regenerate in memory, compare bytes
  python3 scripts/make_fixtures.py --out DIR --only llama_tiny
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

import safetensors
import transformers
from safetensors.torch import save_file
from transformers import (BloomConfig, BloomForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM,
                          MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                          Qwen3ForCausalLM)
from transformers.models.bloom import modeling_bloom
from transformers.models.llama import modeling_llama
from transformers.models.mistral import modeling_mistral
from transformers.models.qwen2 import modeling_qwen2
from transformers.models.qwen3 import modeling_qwen3

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(REPO_ROOT, "test", "fixtures")

# ----------------------------------------------------------------------------
# Settings shared by both fixtures
# ----------------------------------------------------------------------------

B, T = 2, 16
VOCAB = 96
IGNORE_INDEX = -1
MASKED_TARGETS = [(0, 3), (1, 10)]  # (b, t) positions whose target is set to -1

INIT_STD = 0.08          # matrices and embeddings: N(0, INIT_STD)
NORM_JITTER = 0.1        # norm weights: 1 + NORM_JITTER * N(0, 1)
BIAS_STD = 0.05          # biases (and GPT-2 norm biases): BIAS_STD * N(0, 1)

ADAMW = {
    "lr": 1e-2,
    "beta1": 0.9,
    "beta2": 0.95,
    "eps": 1e-8,
    "weight_decay": 0.1,
    "grad_clip": 1.0,
    "steps": 5,
}

# Roles, as keel's ParamTable names them. Weight decay follows the role only.
ROLE_DECAY = {"embedding": True, "matrix": True, "norm": False, "bias": False}


# ----------------------------------------------------------------------------
# keel parameter tables
# ----------------------------------------------------------------------------

@dataclass
class KeelParam:
    name: str
    shape: tuple
    role: str  # embedding | matrix | norm | bias

    @property
    def decay(self) -> bool:
        return ROLE_DECAY[self.role]


@dataclass
class ModelSpec:
    name: str
    family: str  # gpt2 | llama
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden: int
    norm_eps: float
    rope_theta: float
    max_seq_len: int
    tied_embeddings: bool
    seed: int
    alibi: bool = False           # ALiBi biases instead of learned positions (BLOOM)
    embedding_norm: bool = False  # LayerNorm after the embedding (BLOOM's word_embeddings_layernorm)
    qkv_bias: bool = False        # llama with biases on q/k/v (Qwen2)
    qk_norm: bool = False         # llama with per-head RMSNorms of q and k before RoPE (Qwen3)
    head_dim_override: int = 0    # head size when not d_model / n_heads (Qwen3)
    sliding_window: int = 0       # keys j > i - sliding_window only (Mistral); 0: none
    hf_arch: str = ""             # the HF model class: gpt2, llama, bloom, qwen2, qwen3 or mistral
    params: list = field(default_factory=list)

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.d_model // self.n_heads


def role_from_name(name: str) -> str:
    """Classify a keel parameter by its name alone (mirrors keel's rule)."""
    leaf = name.split(".")[-1]
    if name in ("tok_embed", "pos_embed"):
        return "embedding"
    if name == "lm_head":  # keel's ParamTable files the untied head as a matrix
        return "matrix"
    if name.endswith("norm.weight"):
        return "norm"
    if name.endswith("norm.bias") or leaf.startswith("b"):
        return "bias"
    if leaf.startswith("w"):
        return "matrix"
    raise ValueError(f"cannot classify keel parameter {name!r}")


def keel_param_table(s: ModelSpec) -> list:
    """keel's logical parameter table for a model spec, in a fixed order."""
    d, hd, V = s.d_model, s.head_dim, s.vocab_size
    q_out, kv_out = s.n_heads * hd, s.n_kv_heads * hd
    gpt2 = s.family == "gpt2"
    rows = [("tok_embed", (V, d))]
    if gpt2 and not s.alibi:
        rows.append(("pos_embed", (s.max_seq_len, d)))
    if s.embedding_norm:
        rows.append(("embed_norm.weight", (d,)))
        if gpt2:
            rows.append(("embed_norm.bias", (d,)))
    for i in range(s.n_layers):
        p = f"layers.{i}."
        rows.append((p + "attn_norm.weight", (d,)))
        if gpt2:
            rows.append((p + "attn_norm.bias", (d,)))
        rows += [(p + "attn.wq", (q_out, d)), (p + "attn.wk", (kv_out, d)), (p + "attn.wv", (kv_out, d))]
        if gpt2 or s.qkv_bias:
            rows += [(p + "attn.bq", (q_out,)), (p + "attn.bk", (kv_out,)), (p + "attn.bv", (kv_out,))]
        if s.qk_norm:
            rows += [(p + "attn.q_norm.weight", (hd,)), (p + "attn.k_norm.weight", (hd,))]
        rows.append((p + "attn.wo", (d, q_out)))
        if gpt2:
            rows.append((p + "attn.bo", (d,)))
        rows.append((p + "mlp_norm.weight", (d,)))
        if gpt2:
            rows.append((p + "mlp_norm.bias", (d,)))
            rows += [(p + "mlp.w_fc", (s.ffn_hidden, d)), (p + "mlp.b_fc", (s.ffn_hidden,)),
                     (p + "mlp.w_proj", (d, s.ffn_hidden)), (p + "mlp.b_proj", (d,))]
        else:
            rows += [(p + "mlp.w_gate", (s.ffn_hidden, d)), (p + "mlp.w_up", (s.ffn_hidden, d)),
                     (p + "mlp.w_down", (d, s.ffn_hidden))]
    rows.append(("final_norm.weight", (d,)))
    if gpt2:
        rows.append(("final_norm.bias", (d,)))
    if not s.tied_embeddings:
        rows.append(("lm_head", (V, d)))
    return [KeelParam(n, tuple(shape), role_from_name(n)) for n, shape in rows]


# ----------------------------------------------------------------------------
# HF <-> keel mapping tables
#
# Each entry: (hf_name, op, [keel names]). Ops:
#   copy   same layout
#   T      HF Conv1D weight [in, out] -> keel Linear [out, in]
#   qkv_T  GPT-2 c_attn.weight [d, 3d] -> wq, wk, wv each [d, d] (split columns, transpose)
#   qkv_b  GPT-2 c_attn.bias [3d]      -> bq, bk, bv
#   qkv_heads:H    BLOOM query_key_value.weight [3d, d], rows per head [q_h; k_h; v_h] for
#                  H heads -> wq, wk, wv each [d, d]
#   qkv_heads_b:H  BLOOM query_key_value.bias [3d], the same interleaving -> bq, bk, bv
# ----------------------------------------------------------------------------

def gpt2_mapping(s: ModelSpec) -> list:
    m = [("transformer.wte.weight", "copy", ["tok_embed"]),
         ("transformer.wpe.weight", "copy", ["pos_embed"])]
    for i in range(s.n_layers):
        h, k = f"transformer.h.{i}.", f"layers.{i}."
        m += [
            (h + "ln_1.weight", "copy", [k + "attn_norm.weight"]),
            (h + "ln_1.bias", "copy", [k + "attn_norm.bias"]),
            (h + "attn.c_attn.weight", "qkv_T", [k + "attn.wq", k + "attn.wk", k + "attn.wv"]),
            (h + "attn.c_attn.bias", "qkv_b", [k + "attn.bq", k + "attn.bk", k + "attn.bv"]),
            (h + "attn.c_proj.weight", "T", [k + "attn.wo"]),
            (h + "attn.c_proj.bias", "copy", [k + "attn.bo"]),
            (h + "ln_2.weight", "copy", [k + "mlp_norm.weight"]),
            (h + "ln_2.bias", "copy", [k + "mlp_norm.bias"]),
            (h + "mlp.c_fc.weight", "T", [k + "mlp.w_fc"]),
            (h + "mlp.c_fc.bias", "copy", [k + "mlp.b_fc"]),
            (h + "mlp.c_proj.weight", "T", [k + "mlp.w_proj"]),
            (h + "mlp.c_proj.bias", "copy", [k + "mlp.b_proj"]),
        ]
    m += [("transformer.ln_f.weight", "copy", ["final_norm.weight"]),
          ("transformer.ln_f.bias", "copy", ["final_norm.bias"])]
    # lm_head.weight is the same Parameter as transformer.wte.weight (tied);
    # named_parameters() lists it once, checked in check_mapping().
    return m


def bloom_mapping(s: ModelSpec) -> list:
    m = [("transformer.word_embeddings.weight", "copy", ["tok_embed"]),
         ("transformer.word_embeddings_layernorm.weight", "copy", ["embed_norm.weight"]),
         ("transformer.word_embeddings_layernorm.bias", "copy", ["embed_norm.bias"])]
    for i in range(s.n_layers):
        h, k = f"transformer.h.{i}.", f"layers.{i}."
        m += [
            (h + "input_layernorm.weight", "copy", [k + "attn_norm.weight"]),
            (h + "input_layernorm.bias", "copy", [k + "attn_norm.bias"]),
            (h + "self_attention.query_key_value.weight", f"qkv_heads:{s.n_heads}", [k + "attn.wq", k + "attn.wk", k + "attn.wv"]),
            (h + "self_attention.query_key_value.bias", f"qkv_heads_b:{s.n_heads}", [k + "attn.bq", k + "attn.bk", k + "attn.bv"]),
            (h + "self_attention.dense.weight", "copy", [k + "attn.wo"]),
            (h + "self_attention.dense.bias", "copy", [k + "attn.bo"]),
            (h + "post_attention_layernorm.weight", "copy", [k + "mlp_norm.weight"]),
            (h + "post_attention_layernorm.bias", "copy", [k + "mlp_norm.bias"]),
            (h + "mlp.dense_h_to_4h.weight", "copy", [k + "mlp.w_fc"]),
            (h + "mlp.dense_h_to_4h.bias", "copy", [k + "mlp.b_fc"]),
            (h + "mlp.dense_4h_to_h.weight", "copy", [k + "mlp.w_proj"]),
            (h + "mlp.dense_4h_to_h.bias", "copy", [k + "mlp.b_proj"]),
        ]
    m += [("transformer.ln_f.weight", "copy", ["final_norm.weight"]),
          ("transformer.ln_f.bias", "copy", ["final_norm.bias"])]
    return m  # lm_head.weight is word_embeddings.weight (tied)


def llama_mapping(s: ModelSpec) -> list:
    m = [("model.embed_tokens.weight", "copy", ["tok_embed"])]
    for i in range(s.n_layers):
        h, k = f"model.layers.{i}.", f"layers.{i}."
        m += [
            (h + "input_layernorm.weight", "copy", [k + "attn_norm.weight"]),
            (h + "self_attn.q_proj.weight", "copy", [k + "attn.wq"]),
            (h + "self_attn.k_proj.weight", "copy", [k + "attn.wk"]),
            (h + "self_attn.v_proj.weight", "copy", [k + "attn.wv"]),
        ]
        if s.qkv_bias:
            m += [(h + f"self_attn.{x}_proj.bias", "copy", [k + f"attn.b{x}"]) for x in "qkv"]
        if s.qk_norm:
            m += [(h + f"self_attn.{x}_norm.weight", "copy", [k + f"attn.{x}_norm.weight"]) for x in "qk"]
        m += [
            (h + "self_attn.o_proj.weight", "copy", [k + "attn.wo"]),
            (h + "post_attention_layernorm.weight", "copy", [k + "mlp_norm.weight"]),
            (h + "mlp.gate_proj.weight", "copy", [k + "mlp.w_gate"]),
            (h + "mlp.up_proj.weight", "copy", [k + "mlp.w_up"]),
            (h + "mlp.down_proj.weight", "copy", [k + "mlp.w_down"]),
        ]
    m.append(("model.norm.weight", "copy", ["final_norm.weight"]))
    if not s.tied_embeddings:  # tied: lm_head.weight is embed_tokens.weight
        m.append(("lm_head.weight", "copy", ["lm_head"]))
    return m


def hf_from_keel(entry, keel: dict) -> torch.Tensor:
    """Assemble one HF tensor from keel tensors (differentiable)."""
    _, op, names = entry
    ts = [keel[n] for n in names]
    if op == "copy":
        return ts[0]
    if op == "T":
        return ts[0].t()
    if op == "qkv_T":
        return torch.cat([t.t() for t in ts], dim=1)
    if op == "qkv_b":
        return torch.cat(ts, dim=0)
    if op.startswith("qkv_heads"):
        # each projection [H hd, ...] -> [H, 1, hd, ...], interleaved to [H, 3, hd, ...] -> [3 H hd, ...]
        H = int(op.split(":")[1])
        parts = [t.reshape(H, 1, t.shape[0] // H, *t.shape[1:]) for t in ts]
        return torch.cat(parts, dim=1).reshape(-1, *ts[0].shape[1:])
    raise ValueError(op)


def keel_from_hf(entry, hf: torch.Tensor, keel_shapes: dict) -> dict:
    """Split one HF tensor into its keel tensors (contiguous copies)."""
    _, op, names = entry
    if op == "copy":
        out = {names[0]: hf}
    elif op == "T":
        out = {names[0]: hf.t()}
    elif op in ("qkv_T", "qkv_b"):
        dim = 1 if op == "qkv_T" else 0
        sizes = [keel_shapes[n][0] for n in names]  # out-features of wq, wk, wv
        parts = torch.split(hf, sizes, dim=dim)
        out = {n: (p.t() if op == "qkv_T" else p) for n, p in zip(names, parts)}
    elif op.startswith("qkv_heads"):
        H = int(op.split(":")[1])
        per_head = hf.reshape(H, 3, hf.shape[0] // (3 * H), *hf.shape[1:])
        out = {n: per_head[:, i].reshape(-1, *hf.shape[1:]) for i, n in enumerate(names)}
    else:
        raise ValueError(op)
    out = {n: t.detach().clone().contiguous() for n, t in out.items()}
    for n, t in out.items():
        assert tuple(t.shape) == keel_shapes[n], (n, tuple(t.shape), keel_shapes[n])
    return out


def check_mapping(model, spec: ModelSpec, mapping: list) -> None:
    """Every HF parameter mapped exactly once; every keel parameter produced exactly once."""
    hf_params = dict(model.named_parameters())  # tied duplicates listed once
    hf_in_table = [e[0] for e in mapping]
    dup_hf = {n for n in hf_in_table if hf_in_table.count(n) > 1}
    assert not dup_hf, f"HF params mapped twice: {sorted(dup_hf)}"
    missing = set(hf_params) - set(hf_in_table)
    extra = set(hf_in_table) - set(hf_params)
    assert not missing, f"HF params not mapped: {sorted(missing)}"
    assert not extra, f"mapping names unknown HF params: {sorted(extra)}"

    keel_in_table = [n for e in mapping for n in e[2]]
    dup_keel = {n for n in keel_in_table if keel_in_table.count(n) > 1}
    assert not dup_keel, f"keel params produced twice: {sorted(dup_keel)}"
    table_names = [p.name for p in spec.params]
    assert set(keel_in_table) == set(table_names), (
        f"keel table mismatch: missing {sorted(set(table_names) - set(keel_in_table))}, "
        f"extra {sorted(set(keel_in_table) - set(table_names))}")

    # Numel agrees per entry.
    shapes = {p.name: p.shape for p in spec.params}
    for hf_name, _, names in mapping:
        n_keel = sum(math.prod(shapes[n]) for n in names)
        assert hf_params[hf_name].numel() == n_keel, (hf_name, hf_params[hf_name].numel(), n_keel)

    # Tying is as the spec says.
    head = model.get_output_embeddings().weight
    emb = model.get_input_embeddings().weight
    assert (head is emb) == spec.tied_embeddings, "tied_embeddings does not match the HF model"

    # Round trip keel -> HF -> keel is the identity (catches transposes/splits).
    g = torch.Generator().manual_seed(1234)
    probe = {p.name: torch.randn(p.shape, generator=g, dtype=torch.float64) for p in spec.params}
    for e in mapping:
        hf_t = hf_from_keel(e, probe)
        assert tuple(hf_t.shape) == tuple(hf_params[e[0]].shape), (e[0], hf_t.shape)
        back = keel_from_hf(e, hf_t, shapes)
        for n in e[2]:
            assert torch.equal(back[n], probe[n]), f"round trip failed for {n}"


# ----------------------------------------------------------------------------
# Model construction
# ----------------------------------------------------------------------------

def make_specs() -> dict:
    gpt2 = ModelSpec(name="gpt2_tiny", family="gpt2", vocab_size=VOCAB, d_model=32, n_layers=2,
                     n_heads=4, n_kv_heads=4, ffn_hidden=128, norm_eps=1e-5, rope_theta=10000.0,
                     max_seq_len=32, tied_embeddings=True, seed=20240601)
    llama = ModelSpec(name="llama_tiny", family="llama", vocab_size=VOCAB, d_model=32, n_layers=2,
                      n_heads=4, n_kv_heads=2, ffn_hidden=64, norm_eps=1e-5, rope_theta=10000.0,
                      max_seq_len=64, tied_embeddings=False, seed=20240602)
    # BLOOM: gpt2 blocks with ALiBi and an embedding LayerNorm. 6 heads, not a power of two,
    # exercise ALiBi's second slope sequence (with p = 4 every slope is a power of two, so HF's
    # float32 slopes are exact).
    bloom = ModelSpec(name="bloom_tiny", family="gpt2", vocab_size=VOCAB, d_model=48, n_layers=2,
                      n_heads=6, n_kv_heads=6, ffn_hidden=192, norm_eps=1e-5, rope_theta=10000.0,
                      max_seq_len=32, tied_embeddings=True, seed=20240603, alibi=True,
                      embedding_norm=True, hf_arch="bloom")
    # Qwen2: llama with q/k/v biases (GQA 4/2, tied head as in the small Qwen2.5 models).
    # Both Qwen fixtures keep rope_theta at 10000, not Qwen's 1e6: over T = 16 positions most
    # pairs of a head of 8 or 16 would barely turn, parts of the gradients nearly cancel (for
    # Qwen2 the key bias's shift of a whole score row, as GPT-2's attn.bk does exactly: see its
    # zero_gradients note), and AdamW's m / sqrt(v) turns roundoff there into full-size updates:
    # at 1e6 PyTorch's own fp32 run drifts from float64 by up to 1.4e-5 in five steps and the
    # trajectory measures noise. (The logits and gradients at 1e6 agree to ~3e-7 / 1e-6; the HF
    # fixtures qwen2_bf16 and qwen3_fp32 of make_hf_fixtures.py keep 1e6.)
    qwen2 = ModelSpec(name="qwen2_tiny", family="llama", vocab_size=VOCAB, d_model=32, n_layers=2,
                      n_heads=4, n_kv_heads=2, ffn_hidden=64, norm_eps=1e-6, rope_theta=10000.0,
                      max_seq_len=64, tied_embeddings=True, seed=20240604, qkv_bias=True, hf_arch="qwen2")
    # Qwen3: per-head q/k RMSNorms, and 4 heads of 16 = 64 wide on a d_model of 32 (the small
    # Qwen3 models' head_dim 128 is also not hidden_size / heads).
    qwen3 = ModelSpec(name="qwen3_tiny", family="llama", vocab_size=VOCAB, d_model=32, n_layers=2,
                      n_heads=4, n_kv_heads=2, ffn_hidden=64, norm_eps=1e-6, rope_theta=10000.0,
                      max_seq_len=64, tied_embeddings=False, seed=20240605, qk_norm=True,
                      head_dim_override=16, hf_arch="qwen3")
    # Mistral: llama with a sliding window of 5 keys over T = 16 positions, so most rows lose
    # keys to it (rows 5 and on) and the first ones do not.
    mistral = ModelSpec(name="mistral_tiny", family="llama", vocab_size=VOCAB, d_model=32, n_layers=2,
                        n_heads=4, n_kv_heads=2, ffn_hidden=64, norm_eps=1e-5, rope_theta=10000.0,
                        max_seq_len=64, tied_embeddings=False, seed=20240606, sliding_window=5,
                        hf_arch="mistral")
    gpt2.hf_arch, llama.hf_arch = "gpt2", "llama"
    specs = (gpt2, llama, bloom, qwen2, qwen3, mistral)
    for s in specs:
        s.params = keel_param_table(s)
    return {s.name: s for s in specs}


def build_hf_model(s: ModelSpec):
    torch.manual_seed(s.seed)  # HF's own init is overwritten, but keep construction deterministic
    if s.hf_arch == "bloom":
        assert s.ffn_hidden == 4 * s.d_model and s.n_kv_heads == s.n_heads and s.tied_embeddings
        cfg = BloomConfig(
            vocab_size=s.vocab_size, hidden_size=s.d_model, n_layer=s.n_layers, n_head=s.n_heads,
            layer_norm_epsilon=s.norm_eps, hidden_dropout=0.0, attention_dropout=0.0,
            apply_residual_connection_post_layernorm=False, pretraining_tp=1, slow_but_exact=False,
            tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None,
            attn_implementation="eager")
        model = BloomForCausalLM(cfg)
        mapping = bloom_mapping(s)
    elif s.family == "gpt2":
        cfg = GPT2Config(
            vocab_size=s.vocab_size, n_positions=s.max_seq_len, n_embd=s.d_model,
            n_layer=s.n_layers, n_head=s.n_heads, n_inner=None,
            activation_function="gelu_new", layer_norm_epsilon=s.norm_eps,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0,
            tie_word_embeddings=True, bos_token_id=None, eos_token_id=None,
            attn_implementation="eager")
        model = GPT2LMHeadModel(cfg)
        mapping = gpt2_mapping(s)
    elif s.hf_arch in ("qwen2", "qwen3"):
        common = dict(
            vocab_size=s.vocab_size, hidden_size=s.d_model, intermediate_size=s.ffn_hidden,
            num_hidden_layers=s.n_layers, num_attention_heads=s.n_heads,
            num_key_value_heads=s.n_kv_heads, hidden_act="silu", rms_norm_eps=s.norm_eps,
            rope_parameters={"rope_type": "default", "rope_theta": s.rope_theta},
            max_position_embeddings=s.max_seq_len, tie_word_embeddings=s.tied_embeddings,
            use_sliding_window=False, attention_dropout=0.0, bos_token_id=None, eos_token_id=None,
            pad_token_id=None, attn_implementation="eager")
        if s.hf_arch == "qwen2":
            model = Qwen2ForCausalLM(Qwen2Config(**common))
        else:
            model = Qwen3ForCausalLM(Qwen3Config(head_dim=s.head_dim, attention_bias=False, **common))
        mapping = llama_mapping(s)
    elif s.hf_arch == "mistral":
        model = MistralForCausalLM(MistralConfig(
            vocab_size=s.vocab_size, hidden_size=s.d_model, intermediate_size=s.ffn_hidden,
            num_hidden_layers=s.n_layers, num_attention_heads=s.n_heads,
            num_key_value_heads=s.n_kv_heads, hidden_act="silu", rms_norm_eps=s.norm_eps,
            rope_parameters={"rope_type": "default", "rope_theta": s.rope_theta},
            max_position_embeddings=s.max_seq_len, tie_word_embeddings=s.tied_embeddings,
            sliding_window=s.sliding_window, attention_dropout=0.0, bos_token_id=None, eos_token_id=None,
            pad_token_id=None, attn_implementation="eager"))
        mapping = llama_mapping(s)
    else:
        cfg = LlamaConfig(
            vocab_size=s.vocab_size, hidden_size=s.d_model, intermediate_size=s.ffn_hidden,
            num_hidden_layers=s.n_layers, num_attention_heads=s.n_heads,
            num_key_value_heads=s.n_kv_heads, hidden_act="silu", rms_norm_eps=s.norm_eps,
            rope_theta=s.rope_theta, max_position_embeddings=s.max_seq_len,
            tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
            attention_dropout=0.0, bos_token_id=None, eos_token_id=None, pad_token_id=None,
            attn_implementation="eager")
        model = LlamaForCausalLM(cfg)
        mapping = llama_mapping(s)
    model.eval()  # dropouts are 0 anyway; eval() makes sure nothing random runs
    return model, mapping


def init_keel_params(s: ModelSpec) -> dict:
    """Fresh float32 parameters in keel layout, drawn in table order from one generator."""
    g = torch.Generator().manual_seed(s.seed)
    out = {}
    for p in s.params:
        z = torch.randn(p.shape, generator=g, dtype=torch.float32)
        if p.role in ("matrix", "embedding"):
            t = z * INIT_STD
        elif p.role == "norm":
            t = 1.0 + NORM_JITTER * z
        else:
            t = BIAS_STD * z
        out[p.name] = t
    return out


def make_batch(s: ModelSpec):
    g = torch.Generator().manual_seed(s.seed + 1)
    tokens = torch.randint(0, s.vocab_size, (B, T + 1), generator=g, dtype=torch.int64)
    tokens = tokens.to(torch.int32)
    inputs = tokens[:, :T].contiguous()
    targets = tokens[:, 1:].clone()
    for b, t in MASKED_TARGETS:
        targets[b, t] = IGNORE_INDEX
    return tokens, inputs, targets.contiguous()


def load_into_hf(model, mapping, keel: dict) -> None:
    params = dict(model.named_parameters())
    with torch.no_grad():
        for e in mapping:
            params[e[0]].copy_(hf_from_keel(e, keel))


def hf_to_keel(mapping, tensors: dict, s: ModelSpec) -> dict:
    shapes = {p.name: p.shape for p in s.params}
    out = {}
    for e in mapping:
        out.update(keel_from_hf(e, tensors[e[0]], shapes))
    return out


# ----------------------------------------------------------------------------
# float64 fidelity patches for HF Llama (upcasts to float32 in three places)
# ----------------------------------------------------------------------------

def _rmsnorm_keep_dtype(self, hidden_states):
    work = hidden_states.to(torch.promote_types(hidden_states.dtype, torch.float32))
    var = work.pow(2).mean(-1, keepdim=True)
    work = work * torch.rsqrt(var + self.variance_epsilon)
    return self.weight * work.to(hidden_states.dtype)


def _rotary_keep_dtype(self, x, position_ids):
    cfg = self.config
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rp = cfg.rope_parameters
    theta = rp["rope_theta"]
    dt = torch.promote_types(x.dtype, torch.float32)
    inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    if rp.get("rope_type", "default") == "llama3":  # Llama 3.1's frequency scaling, in float64
        L, f, lo, hi = (rp["original_max_position_embeddings"], rp["factor"], rp["low_freq_factor"],
                        rp["high_freq_factor"])
        wavelen = 2 * math.pi / inv_freq
        smooth = (L / wavelen - lo) / (hi - lo)
        inv_freq = torch.where(wavelen < L / hi, inv_freq,
                               torch.where(wavelen > L / lo, inv_freq / f, (1 - smooth) * inv_freq / f + smooth * inv_freq))
    else:
        assert rp.get("rope_type", "default") == "default", rp
    freqs = position_ids[..., None].to(torch.float64) * inv_freq.to(x.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dt).to(x.dtype), emb.sin().to(dt).to(x.dtype)


def _eager_attention_keep_dtype(module, query, key, value, attention_mask, scaling,
                                dropout=0.0, **kwargs):
    key = modeling_llama.repeat_kv(key, module.num_key_value_groups)
    value = modeling_llama.repeat_kv(value, module.num_key_value_groups)
    w = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        w = w + attention_mask
    w = F.softmax(w, dim=-1, dtype=torch.promote_types(query.dtype, torch.float32)).to(query.dtype)
    out = torch.matmul(w, value).transpose(1, 2).contiguous()
    return out, w


# Llama's code and its copies in Qwen2 / Qwen3 (each module has its own RMSNorm class and
# eager attention function, so each is patched in its own module).
LLAMA_LIKE_MODULES = {"llama": (modeling_llama, "LlamaRMSNorm"), "qwen2": (modeling_qwen2, "Qwen2RMSNorm"),
                      "qwen3": (modeling_qwen3, "Qwen3RMSNorm"), "mistral": (modeling_mistral, "MistralRMSNorm")}


@contextlib.contextmanager
def llama_float64_patches(model):
    module, rms_name = LLAMA_LIKE_MODULES[model.config.model_type]
    rms_cls = getattr(module, rms_name)
    saved = (rms_cls.forward, module.eager_attention_forward)
    rotary = model.model.rotary_emb
    rms_cls.forward = _rmsnorm_keep_dtype
    module.eager_attention_forward = _eager_attention_keep_dtype
    rotary.forward = _rotary_keep_dtype.__get__(rotary)
    try:
        yield
    finally:
        rms_cls.forward, module.eager_attention_forward = saved
        del rotary.forward  # back to the class method


class _SoftmaxKeepDtype:
    """torch.nn.functional for modeling_bloom, whose softmax ignores a requested dtype."""

    def __getattr__(self, name):
        return getattr(F, name)

    @staticmethod
    def softmax(x, dim=None, dtype=None):
        return F.softmax(x, dim=dim)


class _GeluExactConstant:
    """BLOOM's GeLUFunction (tanh GELU with sqrt(2/pi) written to 8 digits, in its forward and
    its hand-written backward), with the constant in full precision and autograd's backward."""

    @staticmethod
    def apply(x):
        return F.gelu(x, approximate="tanh")


@contextlib.contextmanager
def bloom_float64_patches():
    saved = (modeling_bloom.F, modeling_bloom.GeLUFunction)
    modeling_bloom.F, modeling_bloom.GeLUFunction = _SoftmaxKeepDtype(), _GeluExactConstant
    try:
        yield
    finally:
        modeling_bloom.F, modeling_bloom.GeLUFunction = saved


def hf_precision_context(model, s: ModelSpec):
    if s.family == "llama":
        return llama_float64_patches(model)
    if s.hf_arch == "bloom":
        return bloom_float64_patches()
    return contextlib.nullcontext()  # HF GPT-2's eager path keeps the input dtype


# ----------------------------------------------------------------------------
# Independent reference forward in keel's layout (cross-check of the mapping)
# ----------------------------------------------------------------------------

def alibi_slopes(n: int) -> list:
    """ALiBi's slopes (Press et al.), in float64, from the paper's recipe."""
    p = 2 ** int(math.floor(math.log2(n)))
    slopes = [2.0 ** (-8.0 * (h + 1) / p) for h in range(p)]
    slopes += [2.0 ** (-4.0 * (2 * k + 1) / p) for k in range(n - p)]
    return slopes


def _causal_attention(q, k, v, slopes=None, window=0):
    # q: [B, H, T, hd], k/v: [B, H, T, hd] (kv heads already expanded); window > 0: keys j > i - window
    hd = q.shape[-1]
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
    Tq = q.shape[-2]
    if slopes is not None:  # ALiBi: score(i, j) += m_h (j - i)
        dist = torch.arange(Tq, dtype=q.dtype)[None, :] - torch.arange(Tq, dtype=q.dtype)[:, None]
        scores = scores + torch.tensor(slopes, dtype=q.dtype)[:, None, None] * dist
    mask = torch.ones(Tq, Tq, dtype=torch.bool).triu(1)
    if window:
        mask |= torch.ones(Tq, Tq, dtype=torch.bool).tril(-window)
    scores = scores.masked_fill(mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def _rope_half(x, theta):
    # x: [B, H, T, hd]; pairs (j, j + hd/2) rotate by pos * theta^(-2j/hd)  (HF "rotate_half")
    hd, Tn = x.shape[-1], x.shape[-2]
    j = torch.arange(hd // 2, dtype=torch.float64)
    inv_freq = theta ** (-2.0 * j / hd)
    ang = torch.arange(Tn, dtype=torch.float64)[:, None] * inv_freq[None, :]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def reference_logits(s: ModelSpec, P: dict, idx: torch.Tensor) -> torch.Tensor:
    Bn, Tn = idx.shape
    H, KV, hd = s.n_heads, s.n_kv_heads, s.head_dim
    idx = idx.long()

    def heads(t, n):
        return t.view(Bn, Tn, n, hd).transpose(1, 2)

    if s.family == "gpt2":
        def norm(x, pfx):
            return F.layer_norm(x, (s.d_model,), P[pfx + ".weight"], P[pfx + ".bias"], s.norm_eps)
    else:
        def norm(x, pfx):  # over the last dimension: d_model, or head_dim for q_norm / k_norm
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + s.norm_eps) * P[pfx + ".weight"]

    x = P["tok_embed"][idx]
    if s.family == "gpt2" and not s.alibi:
        x = x + P["pos_embed"][:Tn][None]
    if s.embedding_norm:
        x = norm(x, "embed_norm")
    slopes = alibi_slopes(H) if s.alibi else None
    for i in range(s.n_layers):
        L = f"layers.{i}."
        h = norm(x, L + "attn_norm")
        q, k, v = h @ P[L + "attn.wq"].t(), h @ P[L + "attn.wk"].t(), h @ P[L + "attn.wv"].t()
        if s.family == "gpt2" or s.qkv_bias:
            q, k, v = q + P[L + "attn.bq"], k + P[L + "attn.bk"], v + P[L + "attn.bv"]
        q, k, v = heads(q, H), heads(k, KV), heads(v, KV)
        if s.qk_norm:
            q, k = norm(q, L + "attn.q_norm"), norm(k, L + "attn.k_norm")
        if s.family == "llama":
            q, k = _rope_half(q, s.rope_theta), _rope_half(k, s.rope_theta)
        rep = H // KV  # query head h reads kv head h // rep
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        o = _causal_attention(q, k, v, slopes, s.sliding_window).transpose(1, 2).reshape(Bn, Tn, H * hd)
        o = o @ P[L + "attn.wo"].t()
        if s.family == "gpt2":
            o = o + P[L + "attn.bo"]
        x = x + o
        h = norm(x, L + "mlp_norm")
        if s.family == "gpt2":
            a = h @ P[L + "mlp.w_fc"].t() + P[L + "mlp.b_fc"]
            a = F.gelu(a, approximate="tanh")
            m = a @ P[L + "mlp.w_proj"].t() + P[L + "mlp.b_proj"]
        else:
            a = F.silu(h @ P[L + "mlp.w_gate"].t()) * (h @ P[L + "mlp.w_up"].t())
            m = a @ P[L + "mlp.w_down"].t()
        x = x + m
    x = norm(x, "final_norm")
    head = P["tok_embed"] if s.tied_embeddings else P["lm_head"]
    return x @ head.t()


# ----------------------------------------------------------------------------
# Oracle computations
# ----------------------------------------------------------------------------

def masked_ce(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1).long(),
                           ignore_index=IGNORE_INDEX, reduction="mean")


def hf_forward(model, inputs):
    return model(input_ids=inputs.long(), use_cache=False).logits


def decay_groups_hf(model, mapping, s: ModelSpec):
    decay = {p.name: p.decay for p in s.params}
    params = dict(model.named_parameters())
    groups = {True: [], False: []}
    for hf_name, _, names in mapping:
        flags = {decay[n] for n in names}
        assert len(flags) == 1, f"{hf_name} mixes decay roles: {names}"
        groups[flags.pop()].append(params[hf_name])
    return groups


def adamw_run(params_decay, params_no_decay, loss_fn):
    """S AdamW steps; returns (losses, pre-clip grad norms)."""
    all_params = params_decay + params_no_decay
    opt = torch.optim.AdamW(
        [{"params": params_decay, "weight_decay": ADAMW["weight_decay"]},
         {"params": params_no_decay, "weight_decay": 0.0}],
        lr=ADAMW["lr"], betas=(ADAMW["beta1"], ADAMW["beta2"]), eps=ADAMW["eps"],
        foreach=False, fused=False)
    losses, norms = [], []
    for _ in range(ADAMW["steps"]):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn()
        loss.backward()
        # clip_grad_norm_ returns the total norm before clipping and scales every grad by
        # min(1, max_norm / (norm + 1e-6)).
        norm = torch.nn.utils.clip_grad_norm_(all_params, max_norm=ADAMW["grad_clip"],
                                              norm_type=2.0, foreach=False)
        losses.append(loss.item())
        norms.append(norm.item())
        opt.step()
    return losses, norms


def max_abs_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def build_fixture(s: ModelSpec, verbose: bool = True):
    model, mapping = build_hf_model(s)
    check_mapping(model, s, mapping)

    init32 = init_keel_params(s)
    tokens, inputs, targets = make_batch(s)
    init64 = {k: v.double() for k, v in init32.items()}

    # --- sanity: unpatched HF in float32 -------------------------------------
    load_into_hf(model, mapping, init32)
    with torch.no_grad():
        logits_f32 = hf_forward(model, inputs)

    # --- the oracle: HF in float64 ------------------------------------------
    model.double()
    load_into_hf(model, mapping, init64)
    with hf_precision_context(model, s):
        model.zero_grad(set_to_none=True)
        logits = hf_forward(model, inputs)
        loss = masked_ce(logits, targets)
        loss.backward()
        hf_grads = {n: p.grad for n, p in model.named_parameters()}
        grads = hf_to_keel(mapping, hf_grads, s)
        logits = logits.detach()
        loss_value = loss.item()

        # AdamW on the HF model (grouped by the keel role of each HF tensor).
        load_into_hf(model, mapping, init64)
        groups = decay_groups_hf(model, mapping, s)
        step_losses, step_norms = adamw_run(
            groups[True], groups[False], lambda: masked_ce(hf_forward(model, inputs), targets))
        final = hf_to_keel(mapping, {n: p.detach() for n, p in model.named_parameters()}, s)

    # --- cross-check: independent keel-layout reference in float64 ----------
    ref_P = {k: v.clone().requires_grad_(True) for k, v in init64.items()}
    ref_logits = reference_logits(s, ref_P, inputs)
    ref_loss = masked_ce(ref_logits, targets)
    ref_loss.backward()
    ref_grads = {k: v.grad for k, v in ref_P.items()}

    ref_adam = {k: v.clone().requires_grad_(True) for k, v in init64.items()}
    dec = [ref_adam[p.name] for p in s.params if p.decay]
    nodec = [ref_adam[p.name] for p in s.params if not p.decay]
    ref_losses, ref_norms = adamw_run(
        dec, nodec, lambda: masked_ce(reference_logits(s, ref_adam, inputs), targets))

    checks = {
        "logits |hf64 - ref64|": ((logits - ref_logits.detach()).abs().max().item(), 1e-12),
        "loss |hf64 - ref64|": (abs(loss_value - ref_loss.item()), 1e-12),
        "grads |hf64 - ref64|": (max_abs_diff(grads, ref_grads), 1e-12),
        "step losses |hf64 - ref64|": (max(abs(a - b) for a, b in zip(step_losses, ref_losses)), 1e-12),
        "grad norms |hf64 - ref64|": (max(abs(a - b) for a, b in zip(step_norms, ref_norms)), 1e-12),
        "final params |hf64 - ref64|": (max_abs_diff(final, {k: v.detach() for k, v in ref_adam.items()}), 1e-9),
        "logits |hf64 - hf32 unpatched|": ((logits - logits_f32.double()).abs().max().item(), 1e-4),
    }
    # How well-conditioned are the AdamW steps? The same run in float32 (PyTorch) against the
    # float64 oracle, per tensor ||f32 - f64|| / ||f64||. Adam divides by sqrt(v), so elements
    # with near-zero gradients (GPT-2's key path, which softmax partly cancels) amplify fp32
    # roundoff; keel's fp32 result is held to a small multiple of this, not to a guess.
    f32_adam = {k: v.clone().requires_grad_(True) for k, v in init32.items()}
    adamw_run([f32_adam[p.name] for p in s.params if p.decay],
              [f32_adam[p.name] for p in s.params if not p.decay],
              lambda: masked_ce(reference_logits(s, f32_adam, inputs), targets))
    ref_final = {k: v.detach() for k, v in ref_adam.items()}
    fp32_rel_error = {
        k: float((f32_adam[k].detach().double() - ref_final[k]).norm() / ref_final[k].norm().clamp_min(1e-300))
        for k in ref_final}

    failed = [k for k, (v, tol) in checks.items() if not (v <= tol)]
    if verbose:
        for k, (v, tol) in checks.items():
            print(f"    check {k:34s} {v:.2e}  (tol {tol:.0e})")
    if failed:
        raise SystemExit(f"{s.name}: cross-checks failed: {failed}")

    tensors = {}
    for p in s.params:
        tensors["param." + p.name] = init32[p.name]
    tensors["tokens"] = tokens
    tensors["targets"] = targets
    tensors["logits"] = logits.float()
    tensors["loss"] = torch.tensor([loss_value], dtype=torch.float64).float()
    for p in s.params:
        tensors["grad." + p.name] = grads[p.name].float()
    tensors["step_losses"] = torch.tensor(step_losses, dtype=torch.float64).float()
    tensors["step_grad_norms"] = torch.tensor(step_norms, dtype=torch.float64).float()
    for p in s.params:
        tensors["final." + p.name] = final[p.name].float()
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    for k, v in tensors.items():
        assert v.dtype in (torch.float32, torch.int32), (k, v.dtype)
        assert torch.isfinite(v.float()).all(), k

    results = {"loss": loss_value, "step_losses": step_losses, "step_grad_norms": step_norms,
               "final_fp32_rel_error": {p.name: float(f"{fp32_rel_error[p.name]:.3e}") for p in s.params}}
    return tensors, results


def generated_by() -> str:
    return (f"scripts/make_fixtures.py with torch {torch.__version__}, transformers "
            f"{transformers.__version__}, safetensors {safetensors.__version__}, "
            f"numpy {np.__version__}, python {sys.version.split()[0]}")


def fixture_json(s: ModelSpec, results: dict) -> dict:
    model = {
        "family": s.family,
        "vocab_size": s.vocab_size,
        "d_model": s.d_model,
        "n_layers": s.n_layers,
        "n_heads": s.n_heads,
        "n_kv_heads": s.n_kv_heads,
        "ffn_hidden": s.ffn_hidden,
        "norm_eps": s.norm_eps,
        "rope_theta": s.rope_theta,
        "max_seq_len": s.max_seq_len,
        "tied_embeddings": s.tied_embeddings,
    }
    if s.alibi:
        model["position_embedding"] = "alibi"
    if s.embedding_norm:
        model["embedding_norm"] = True
    if s.qkv_bias:
        model["qkv_bias"] = True
    if s.qk_norm:
        model["qk_norm"] = True
    if s.head_dim_override:
        model["head_dim"] = s.head_dim_override
    if s.sliding_window:
        model["sliding_window"] = s.sliding_window
    if s.family == "gpt2":
        conventions = {
            "norm": "layernorm (weight, bias)",
            "activation": "gelu tanh approximation (HF gelu_new)",
            "position": "learned pos_embed added to tok_embed",
            "rope_theta": "unused",
            "lm_head": "tied to tok_embed: grad.tok_embed includes the embedding and head uses",
        }
    else:
        conventions = {
            "norm": "rmsnorm: x * rsqrt(mean(x^2) + eps) * weight",
            "activation": "swiglu: w_down(silu(w_gate h) * w_up h)",
            "rope": "HF rotate_half layout: within a head, dims j and j + head_dim/2 form a pair, "
                    "rotated by pos * rope_theta^(-2j/head_dim), positions start at 0",
            "gqa": "query head h attends with kv head h // (n_heads / n_kv_heads)",
            "lm_head": "tied to tok_embed" if s.tied_embeddings else "untied",
        }
        if s.qkv_bias:
            conventions["qkv_bias"] = "q, k, v = h wq^T + bq, h wk^T + bk, h wv^T + bv (oracle: HF Qwen2ForCausalLM)"
        if s.qk_norm:
            conventions["qk_norm"] = ("each head of q and k: rmsnorm over head_dim with attn.q_norm.weight / "
                                      "attn.k_norm.weight (shared by all heads), before RoPE (oracle: HF "
                                      "Qwen3ForCausalLM)")
        if s.sliding_window:
            conventions["sliding_window"] = (f"query i attends keys j with i - {s.sliding_window} < j <= i "
                                             f"(oracle: HF MistralForCausalLM, sliding_window {s.sliding_window})")
        if s.head_dim_override:
            conventions["head_dim"] = (f"head_dim {s.head_dim} is not d_model / n_heads: wq is "
                                       f"[n_heads * head_dim, d_model], wo [d_model, n_heads * head_dim]")
    if s.alibi:
        conventions["position"] = (
            "ALiBi (oracle: HF BloomForCausalLM): no pos_embed; score(i, j) += m_h * (j - i) with "
            "m_h = 2^(-8 (h+1) / p) for h < p (p = the largest power of two <= n_heads), then "
            "2^(-4 (2k+1) / p) for the remaining heads")
    if s.embedding_norm:
        conventions["embedding_norm"] = "embed_norm (layernorm) applied to the token embedding before layer 0"
    conventions.update({
        "attention": "causal softmax(q k^T / sqrt(head_dim)) v, heads are contiguous slices of "
                     "wq/wk/wv output rows",
        "loss": "mean cross-entropy over targets != -1 (ignore_index -1)",
        "layouts": "row-major; Linear weights [out, in] (y = x W^T); float tensors float32, "
                   "tokens/targets int32",
        "oracle_precision": "computed in float64 from the float32 initial weights, stored as float32",
    })
    if s.family == "gpt2":
        conventions["zero_gradients"] = (
            "grad.layers.*.attn.bk is mathematically zero (a key bias adds the same q.bk to every "
            "score of a query row, which softmax cancels); the float64 oracle holds roundoff "
            "(~1e-19) there and final.*.attn.bk equals param.*.attn.bk. An fp32 implementation's "
            "roundoff there (~1e-9) is amplified by AdamW's m/(sqrt(v)+eps) to updates of up to "
            "~lr*|g|/(|g|+eps) per step, so compare attn.bk with an absolute tolerance." +
            ("" if s.alibi else " pos_embed rows >= T get exactly zero gradient, so AdamW only decays them."))
    else:
        conventions["zero_gradients"] = (
            "tok_embed rows of token ids absent from the inputs get exactly zero gradient, "
            "so AdamW only decays them (p *= 1 - lr*wd per step).")
    return {
        "model": model,
        "batch": {"B": B, "T": T},
        "adamw": dict(ADAMW),
        "adamw_notes": (
            "per step: loss, backward, total L2 grad norm over all parameters (recorded before "
            "clipping), grads *= min(1, grad_clip / (norm + 1e-6)), then torch.optim.AdamW "
            "(decoupled decay p *= 1 - lr*wd, bias-corrected moments, "
            "p -= lr/(1-beta1^t) * m / (sqrt(v)/sqrt(1-beta2^t) + eps)); "
            "weight_decay applies to params with weight_decay=true below, 0 otherwise"),
        "init": {"matrix_embedding_std": INIT_STD, "norm": f"1 + {NORM_JITTER} * N(0,1)",
                 "bias": f"{BIAS_STD} * N(0,1)", "seed": s.seed},
        "conventions": conventions,
        "params": [{"name": p.name, "shape": list(p.shape), "role": p.role,
                    "weight_decay": p.decay} for p in s.params],
        "tensors": {
            "param.<name>": "initial weights",
            "tokens": "[B, T+1] int32; inputs = tokens[:, :T]",
            "targets": "[B, T] int32 = tokens[:, 1:] with -1 at " +
                       ", ".join(f"[{b},{t}]" for b, t in MASKED_TARGETS),
            "logits": "[B, T, V]",
            "loss": "[1]",
            "grad.<name>": "d loss / d param at the initial weights",
            "step_losses": "[steps] loss before each AdamW step",
            "step_grad_norms": "[steps] global grad norm before clipping",
            "final.<name>": "weights after all AdamW steps",
        },
        "results": {"loss": results["loss"], "step_losses": results["step_losses"],
                    "step_grad_norms": results["step_grad_norms"],
                    "final_fp32_rel_error": results["final_fp32_rel_error"]},
        "final_fp32_rel_error_notes": "per tensor ||W_f32 - W_f64|| / ||W_f64|| after the AdamW steps when "
                                      "PyTorch itself runs them in float32: the conditioning of the steps",
        "generated_by": generated_by(),
    }


def write_fixture(out_dir: str, s: ModelSpec, tensors: dict, results: dict) -> list:
    os.makedirs(out_dir, exist_ok=True)
    st_path = os.path.join(out_dir, s.name + ".safetensors")
    js_path = os.path.join(out_dir, s.name + ".json")
    # One metadata key only: safetensors writes metadata from a hash map, so several keys
    # come out in a random order and the bytes would change run to run.
    meta = {"keel_fixture": f"v1 {s.name} {s.family}"}
    tmp = st_path + ".tmp"
    save_file(tensors, tmp, metadata=meta)
    os.replace(tmp, st_path)
    os.chmod(st_path, 0o644)
    text = json.dumps(fixture_json(s, results), indent=2) + "\n"
    tmp = js_path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, js_path)
    return [st_path, js_path]


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read())
    return h.hexdigest()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=DEFAULT_OUT, help="output directory (default test/fixtures)")
    ap.add_argument("--only", action="append", help="build only this fixture (repeatable)")
    ap.add_argument("--check", action="store_true",
                    help="regenerate into a temporary dir and compare bytes with --out")
    ap.add_argument("-q", "--quiet", action="store_true")
    args = ap.parse_args()

    # Single-threaded, deterministic kernels: identical bytes run to run.
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()

    specs = make_specs()
    names = args.only or list(specs)
    for n in names:
        if n not in specs:
            ap.error(f"unknown fixture {n!r}; known: {', '.join(specs)}")

    t0 = time.time()
    target_dir = tempfile.mkdtemp(prefix="keel_fixtures_") if args.check else args.out
    written = []
    for n in names:
        s = specs[n]
        t1 = time.time()
        if not args.quiet:
            print(f"[{n}] building ({s.family}, {sum(math.prod(p.shape) for p in s.params)} params)")
        tensors, results = build_fixture(s, verbose=not args.quiet)
        paths = write_fixture(target_dir, s, tensors, results)
        written += paths
        if not args.quiet:
            print(f"[{n}] loss {results['loss']:.6f}")
            print(f"[{n}] step losses     " + " ".join(f"{x:.6f}" for x in results["step_losses"]))
            print(f"[{n}] step grad norms " + " ".join(f"{x:.6f}" for x in results["step_grad_norms"]))
            print(f"[{n}] {len(tensors)} tensors; " + ", ".join(
                f"{os.path.basename(p)} {os.path.getsize(p)} B" for p in paths) +
                f"; {time.time() - t1:.2f}s")

    total = sum(os.path.getsize(p) for p in written)
    print(f"total {total} bytes in {len(written)} files, {time.time() - t0:.2f}s")

    if args.check:
        bad = []
        for p in written:
            ref = os.path.join(args.out, os.path.basename(p))
            if not os.path.exists(ref):
                bad.append(f"{ref} missing")
            elif sha256(ref) != sha256(p):
                bad.append(f"{ref} differs from a fresh build ({p})")
        if bad:
            print("CHECK FAILED:\n  " + "\n  ".join(bad))
            return 1
        for p in written:
            os.remove(p)
        os.rmdir(target_dir)
        print(f"check ok: fixtures in {args.out} match a fresh build byte for byte")
    else:
        for p in written:
            print(f"  {sha256(p)[:16]}  {os.path.relpath(p)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
