#!/usr/bin/env python3
"""Build the Hugging Face model fixtures for keel's conversion, sampling and finetuning tests
(test/train/test_hf_convert.cpp, test/train/test_hf_cli.cpp).

Four tiny LlamaForCausalLM models, a GPT2LMHeadModel, a BloomForCausalLM, a Qwen2ForCausalLM, a
Qwen3ForCausalLM and a MistralForCausalLM, saved with save_pretrained exactly as transformers writes them, each with a
tokenizer.json:

  llama_trained   fp32, GQA (4 query / 2 kv heads), untied head, Llama 2 style tokenizer
                  (SentencePiece BPE with byte fallback, vocab 512); trained here with AdamW on
                  Debian's fortunes to a low loss, so a finetune that loses the pretrained
                  weights (seed-000) shows as a loss jump
  llama_tied      bf16, random, tied embeddings, one kv head (MQA), rope_theta 500000,
                  rms_norm_eps 1e-6, GPT-2 style byte-level tokenizer (vocab 300)
  llama_sharded   fp16, random, plain multi-head attention, untied, three layers, split into
                  shards by max_shard_size (model-0000X-of-0000N.safetensors + index)
  llama3_rope     fp32, random, Llama 3.1's "llama3" RoPE scaling (factor 8 over an original
                  context of 64, so the 16 test positions feel it); its expected file also holds
                  HF's fp32 inv_freq as int32 bit patterns
  gpt2_tied       fp32, random GPT2LMHeadModel (tied head, learned positions, Conv1D weights
                  stored [in, out], fused c_attn), byte-level tokenizer (vocab 300)
  bloom_bf16      bf16, random BloomForCausalLM (ALiBi with 6 heads, so the slopes take the
                  non-power-of-two path; word_embeddings_layernorm; query_key_value fused per
                  head as [q_h; k_h; v_h]), byte-level tokenizer (vocab 300)
  qwen2_bf16      bf16, random Qwen2ForCausalLM (q/k/v biases, GQA 4/2, tied head, rope_theta
                  1e6, eps 1e-6), Qwen2-style tokenizer (NFC, Qwen2 regex, byte-level BPE, vocab 800)
  qwen3_fp32      fp32, random Qwen3ForCausalLM (per-head q_norm / k_norm, head_dim 16 with 4 heads
                  on hidden_size 32, GQA 4/2, untied), the same tokenizer
  mistral_bf16    bf16, random MistralForCausalLM with a sliding window of 6 keys (shorter than
                  the 16 logit positions and the 21 of greedy decoding), GQA 4/2, untied,
                  byte-level tokenizer (vocab 300)
Norm gains, norm biases and (GPT-2, BLOOM) linear biases are drawn away from HF's 1 and 0, so a
mixed-up norm or bias shows in the logits.

and multiple-choice items for keel eval (test/fixtures/hf/choices/, scored in
test/fixtures/hf/expected/choices_<model>.json):
  fortunes.jsonl  text items for llama_trained from fortunes it was not trained on (the last
                  tenth of the stream): the first part of a fortune as context, its own rest and
                  the rests of three other fortunes as endings (each with its leading space;
                  scored as the tokens of context + ending past the context's)
  gpt2_ids.jsonl  token-id items for gpt2_tied, endings of 1 to 6 tokens
each ending's log-likelihood from HF in float64 (context + ending in one forward, no cache).

and for each model (test/fixtures/hf/expected/<name>.json + .safetensors):
  logits     [16, V] float32: HF's logits for 16 fixed tokens, computed in float64 from the
             stored weights (make_fixtures.py's float64 patches of HF Llama's and BLOOM's
             upcasts; GPT-2's eager path keeps the dtype)
  greedy     16 greedy new tokens after a fixed prompt (HF generate, float64); the smallest
             top-1/top-2 logit gap along the way is recorded and must be > 1e-3, so an fp32
             implementation cannot flip a token
  text       (llama_trained) a text prompt, its ids with <s>, and HF's greedy continuation
  train_loss (llama_trained) the fp32 model's mean loss over the windows of
             test/fixtures/hf/data/fortunes_sp.bin (an llm.c shard of text it was trained on)

Deterministic (one thread, fixed seeds): --check rebuilds into a temporary directory and
compares every file byte for byte.

Usage:
  python3 scripts/make_hf_fixtures.py [--only llama3_rope ...]
  python3 scripts/make_hf_fixtures.py --check
"""

from __future__ import annotations

import argparse
import contextlib
import filecmp
import json
import math
import os
import shutil
import sys
import tempfile

import numpy as np
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import save_file
from transformers import (AutoModelForCausalLM, BloomConfig, BloomForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig,
                          LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_fixtures  # noqa: E402  (float64 patches of HF Llama)
import make_tokenizer_fixtures as tokfix  # noqa: E402  (corpus reader and tokenizer builders)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(REPO_ROOT, "test", "fixtures", "hf")
N_LOGIT_TOKENS = 16
N_NEW = 16
MIN_MARGIN = 1e-3
TRAIN_SEQ = 64
TEXT_PROMPT = "The best way to"


def bytelevel_tokenizer():
    corpus = tokfix.read_fortunes(tokfix.TRAIN_FILES)
    return tokfix.train_bytelevel(corpus, 300, tokfix.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
                                  ["<|endoftext|>"])


def qwen_tokenizer():
    return tokfix.make_qwen2(tokfix.read_fortunes(tokfix.TRAIN_FILES))


def sp_tokenizer():
    corpus = tokfix.read_fortunes(tokfix.TRAIN_FILES)
    vocab, merges = tokfix.sp_model(corpus, 512 - 258)
    return tokfix.sp_tokenizer(vocab, merges, metaspace=False)


def llama(vocab, d, layers, heads, kv, ffn, tied, theta, eps, init, seed, bos=None, eos=None, rope_scaling=None):
    torch.manual_seed(seed)
    rope = {"rope_type": "default", "rope_theta": theta} if rope_scaling is None else dict(rope_scaling, rope_theta=theta)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=d, intermediate_size=ffn, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=128,
                      rms_norm_eps=eps, rope_parameters=rope, tie_word_embeddings=tied, initializer_range=init,
                      attention_bias=False, mlp_bias=False, bos_token_id=bos, eos_token_id=eos, pad_token_id=None,
                      attn_implementation="eager")
    return perturb_norms_and_biases(LlamaForCausalLM(cfg))


def qwen(arch, vocab, d, layers, heads, kv, ffn, tied, init, seed, head_dim=None):
    """Qwen2 (q/k/v biases) or Qwen3 (q/k norms, head_dim), with Qwen's theta and eps."""
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=d, intermediate_size=ffn, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=128, rms_norm_eps=1e-6,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=tied,
                  initializer_range=init, use_sliding_window=False, bos_token_id=None, eos_token_id=0,
                  pad_token_id=None, attn_implementation="eager")
    if arch == "qwen2":
        return perturb_norms_and_biases(Qwen2ForCausalLM(Qwen2Config(**common)))
    return perturb_norms_and_biases(Qwen3ForCausalLM(Qwen3Config(head_dim=head_dim, attention_bias=False, **common)))


def mistral(vocab, d, layers, heads, kv, ffn, window, init, seed):
    torch.manual_seed(seed)
    cfg = MistralConfig(vocab_size=vocab, hidden_size=d, intermediate_size=ffn, num_hidden_layers=layers,
                        num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=128,
                        rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                        tie_word_embeddings=False, initializer_range=init, sliding_window=window, bos_token_id=None,
                        eos_token_id=None, pad_token_id=None, attn_implementation="eager")
    return perturb_norms_and_biases(MistralForCausalLM(cfg))


def perturb_norms_and_biases(model):
    """Norm gains away from 1 and biases away from 0, so a mixed-up norm or bias shows."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() != 1:
                continue
            if name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape))
            else:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape))
    return model.eval()


def gpt2(vocab, d, layers, heads, n_pos, init, seed):
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=vocab, n_embd=d, n_layer=layers, n_head=heads, n_positions=n_pos, n_inner=None,
                     activation_function="gelu_new", layer_norm_epsilon=1e-5, initializer_range=init,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                     attn_implementation="eager")
    return perturb_norms_and_biases(GPT2LMHeadModel(cfg))


def bloom(vocab, d, layers, heads, init, seed):
    torch.manual_seed(seed)
    cfg = BloomConfig(vocab_size=vocab, hidden_size=d, n_layer=layers, n_head=heads, layer_norm_epsilon=1e-5,
                      initializer_range=init, hidden_dropout=0.0, attention_dropout=0.0, bos_token_id=0,
                      eos_token_id=0, pad_token_id=None, attn_implementation="eager")
    return perturb_norms_and_biases(BloomForCausalLM(cfg))


def precision_patches(model):
    """make_fixtures.py's float64 patches for the model's architecture."""
    if model.config.model_type in make_fixtures.LLAMA_LIKE_MODULES:
        return make_fixtures.llama_float64_patches(model)
    if model.config.model_type == "bloom":
        return make_fixtures.bloom_float64_patches()
    return contextlib.nullcontext()  # GPT-2's eager attention keeps the input dtype


def train_model(model, tokens: np.ndarray, steps: int, seed: int):
    """AdamW on random windows of the token stream (a plain pretraining loop)."""
    g = torch.Generator().manual_seed(seed)
    data = torch.from_numpy(tokens.astype(np.int64))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 30) * (0.1 + 0.9 * (1 - s / steps)))
    model.train()
    for step in range(steps):
        starts = torch.randint(0, len(data) - TRAIN_SEQ - 1, (16,), generator=g)
        batch = torch.stack([data[s:s + TRAIN_SEQ + 1] for s in starts])
        logits = model(input_ids=batch[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=False)
        opt.step()
        sched.step()
        if step % 100 == 0 or step == steps - 1:
            print(f"    train step {step:4d} loss {loss.item():.4f}")
    return model.eval()


def write_llmc_shard(path: str, tokens: np.ndarray) -> None:
    header = np.zeros(256, dtype="<i4")
    header[0], header[1], header[2] = 20240520, 1, len(tokens)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype("<u2").tobytes())


def loss_on_windows(model, tokens: np.ndarray) -> float:
    """Mean next-token loss over the non-overlapping windows keel's sampler cuts (fp32)."""
    n = (len(tokens) - 1) // TRAIN_SEQ
    data = torch.from_numpy(tokens.astype(np.int64))
    total, count = 0.0, 0
    with torch.no_grad():
        for w in range(n):
            x = data[w * TRAIN_SEQ:(w + 1) * TRAIN_SEQ + 1]
            logits = model(input_ids=x[None, :-1], use_cache=False).logits[0]
            total += F.cross_entropy(logits.double(), x[1:], reduction="sum").item()
            count += TRAIN_SEQ
    return total / count


def float64_model(path: str):
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, attn_implementation="eager")
    return m.eval()


def oracle_logits(m64, ids) -> torch.Tensor:
    with precision_patches(m64), torch.no_grad():
        return m64(input_ids=torch.tensor([ids]), use_cache=False).logits[0]


def greedy(m64, prompt, n=N_NEW, eos=None):
    """HF generate (float64, KV cache), and the smallest top-1/top-2 gap along the way."""
    with precision_patches(m64), torch.no_grad():
        out = m64.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=eos,
                           pad_token_id=0)[0].tolist()[len(prompt):]
        margin = math.inf
        seq = list(prompt)
        for tok in out:
            logits = m64(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1]
            top = torch.topk(logits, 2).values
            margin = min(margin, (top[0] - top[1]).item())
            assert logits.argmax().item() == tok
            seq.append(tok)
    return out, margin


def build(out: str, only=None) -> None:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()
    os.makedirs(os.path.join(out, "expected"), exist_ok=True)
    os.makedirs(os.path.join(out, "data"), exist_ok=True)

    sp = sp_tokenizer()
    bl = bytelevel_tokenizer()
    qt = qwen_tokenizer()
    # The trained model's data: fortunes through the SentencePiece-style tokenizer, documents
    # separated by </s>.
    docs = tokfix.read_fortunes(tokfix.TRAIN_FILES)
    stream = []
    for enc in sp.encode_batch(docs, add_special_tokens=True):
        stream += enc.ids + [2]
    stream = np.asarray(stream, dtype=np.int64)
    print(f"  corpus: {len(docs)} fortunes, {len(stream)} tokens (vocab {sp.get_vocab_size()})")

    specs = {
        "llama_trained": dict(tok=sp, dtype=torch.float32, shard=None,
                              model=lambda: llama(sp.get_vocab_size(), 48, 2, 4, 2, 128, False, 10000.0, 1e-5, 0.02,
                                                  1001, bos=1, eos=2)),
        "llama_tied": dict(tok=bl, dtype=torch.bfloat16, shard=None,
                           model=lambda: llama(bl.get_vocab_size(), 32, 2, 4, 1, 64, True, 500000.0, 1e-6, 0.3, 1002)),
        "llama_sharded": dict(tok=bl, dtype=torch.float16, shard="40KB",
                              model=lambda: llama(bl.get_vocab_size(), 32, 3, 4, 4, 64, False, 10000.0, 1e-5, 0.3,
                                                  1003)),
        # Llama 3.1's RoPE scaling, shrunk so the tiny model's positions feel it: head_dim 16 at
        # theta 10000 puts frequencies in all three bands (kept, interpolated, divided by 8) of
        # an original context of 64.
        "llama3_rope": dict(tok=bl, dtype=torch.float32, shard=None,
                            model=lambda: llama(bl.get_vocab_size(), 64, 2, 4, 2, 128, False, 10000.0, 1e-5, 0.3, 1004,
                                                rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                              "original_max_position_embeddings": 64})),
        "gpt2_tied": dict(tok=bl, dtype=torch.float32, shard=None,
                          model=lambda: gpt2(bl.get_vocab_size(), 32, 2, 4, 64, 0.3, 1005)),
        "bloom_bf16": dict(tok=bl, dtype=torch.bfloat16, shard=None,
                           model=lambda: bloom(bl.get_vocab_size(), 48, 2, 6, 0.3, 1008)),
        "qwen2_bf16": dict(tok=qt, dtype=torch.bfloat16, shard=None,
                           model=lambda: qwen("qwen2", qt.get_vocab_size(), 32, 2, 4, 2, 64, True, 0.3, 1009)),
        "qwen3_fp32": dict(tok=qt, dtype=torch.float32, shard=None,
                           model=lambda: qwen("qwen3", qt.get_vocab_size(), 32, 2, 4, 2, 64, False, 0.3, 1010,
                                              head_dim=16)),
        "mistral_bf16": dict(tok=bl, dtype=torch.bfloat16, shard=None,
                             model=lambda: mistral(bl.get_vocab_size(), 32, 2, 4, 2, 64, 6, 0.3, 1011)),
    }
    for name, spec in specs.items():
        if only and name not in only:
            continue
        print(f"[{name}]")
        model = spec["model"]()
        V = model.config.vocab_size
        expected = {"model": name, "dtype": str(spec["dtype"]).replace("torch.", ""), "vocab_size": V}
        if name == "llama_trained":
            model = train_model(model, stream[:len(stream) * 9 // 10], 600, 7)
            shard = stream[len(stream) * 9 // 10:][:16 * 1024 + 1]
            write_llmc_shard(os.path.join(out, "data", "fortunes_sp.bin"), shard)
            expected["train_loss"] = {"file": "data/fortunes_sp.bin", "seq_len": TRAIN_SEQ,
                                      "loss": loss_on_windows(model, shard),
                                      "note": "mean loss of the fp32 HF model over the shard's non-overlapping windows "
                                              "of seq_len + 1 tokens (keel's sampler windows)"}
            print(f"    loss on fortunes_sp.bin: {expected['train_loss']['loss']:.4f} (ln V = {math.log(V):.4f})")
        model = model.to(spec["dtype"])
        path = os.path.join(out, name)
        shutil.rmtree(path, ignore_errors=True)
        kwargs = {"max_shard_size": spec["shard"]} if spec["shard"] else {}
        model.save_pretrained(path, **kwargs)
        spec["tok"].save(os.path.join(path, "tokenizer.json"))

        # Oracles from the files as saved.
        m64 = float64_model(path)
        g = torch.Generator().manual_seed(len(name))
        ids = torch.randint(3, V, (N_LOGIT_TOKENS,), generator=g).tolist()
        logits = oracle_logits(m64, ids)
        with torch.no_grad():  # sanity: unpatched HF in fp32 agrees
            m32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
            l32 = m32(input_ids=torch.tensor([ids]), use_cache=False).logits[0].double()
        rel = ((l32 - logits).norm() / logits.norm()).item()
        assert rel < 1e-5, (name, rel)
        prompt = ids[:5]
        new, margin = greedy(m64, prompt)
        assert margin > MIN_MARGIN, (name, margin)
        if name == "llama3_rope":  # HF's own fp32 frequencies, for a bit-for-bit check of keel's
            expected["rope_inv_freq_fp32_bits"] = [int(b) for b in m32.model.rotary_emb.inv_freq.view(torch.int32)]
        expected.update({"logits_tokens": ids, "fp32_vs_fp64_logits_rel": float(f"{rel:.3e}"),
                         "greedy": {"prompt_ids": prompt, "new_ids": new, "min_top2_gap": float(f"{margin:.4g}")}})
        if name == "llama_trained":
            p_ids = spec["tok"].encode(TEXT_PROMPT, add_special_tokens=True).ids
            t_new, t_margin = greedy(m64, p_ids, eos=2)
            assert t_margin > MIN_MARGIN, (name, t_margin)
            expected["text"] = {"prompt": TEXT_PROMPT, "prompt_ids": p_ids, "new_ids": t_new,
                                "completion": spec["tok"].decode(p_ids + t_new, skip_special_tokens=True),
                                "min_top2_gap": float(f"{t_margin:.4g}"), "eos_token_id": 2}
        print(f"    logits fp32 vs fp64 {rel:.2e}; greedy {new} (min gap {margin:.3g})")
        save_file({"logits": logits.float().contiguous()}, os.path.join(out, "expected", name + ".safetensors"),
                  metadata={"keel_fixture": name})
        with open(os.path.join(out, "expected", name + ".json"), "w") as f:
            f.write(json.dumps(expected, indent=1) + "\n")
    if not only or "choices" in only:
        build_choices(out, sp, docs, stream)


def choice_logprobs(m64, ctx, endings):
    """Sum of log p(ending token | everything before) per ending, context + ending in one
    float64 forward."""
    out = []
    with precision_patches(m64), torch.no_grad():
        for end in endings:
            ids = torch.tensor([ctx + end])
            logp = torch.log_softmax(m64(input_ids=ids, use_cache=False).logits[0].double(), dim=-1)
            out.append(sum(logp[len(ctx) - 1 + i, t].item() for i, t in enumerate(end)))
    return out


def first_max(v):
    return max(range(len(v)), key=lambda i: (v[i], -i))


def build_choices(out: str, sp, docs, stream) -> None:
    os.makedirs(os.path.join(out, "choices"), exist_ok=True)
    rng = np.random.default_rng(11)
    # Fortunes whose tokens lie in the held-out last tenth of the training stream.
    starts, pos = [], 0
    for enc in sp.encode_batch(docs, add_special_tokens=True):
        starts.append(pos)
        pos += len(enc.ids) + 1
    held = [d for d, st in zip(docs, starts) if st >= len(stream) * 9 // 10]
    held = [" ".join(d.split()) for d in held]
    held = [d for d in held if 60 <= len(d) <= 160]
    text_items = []
    for k in rng.permutation(len(held))[:24]:
        words = held[k].split(" ")
        cut = max(3, len(words) // 2)
        # Endings carry their leading space, as HellaSwag's " " + ending: context + ending is the text.
        ctx, right = " ".join(words[:cut]), " " + " ".join(words[cut:])
        others = [o for o in rng.permutation(len(held)) if o != k][:3]
        endings = [" " + " ".join(held[o].split(" ")[max(3, len(held[o].split(" ")) // 2):]) for o in others]
        label = int(rng.integers(0, 4))
        endings.insert(label, right)
        text_items.append({"context": ctx, "endings": endings, "label": label})
    V = 300
    id_items = []
    for k in range(8):
        ctx = rng.integers(3, V, int(rng.integers(4, 11))).tolist()
        endings = [rng.integers(3, V, n).tolist() for n in ([1, 6, 3, 2] if k % 2 else [4, 1, 5, 2])]
        id_items.append({"context_ids": ctx, "ending_ids": endings, "label": int(rng.integers(0, 4))})

    for model_name, file_name, items in (("llama_trained", "fortunes.jsonl", text_items),
                                         ("gpt2_tied", "gpt2_ids.jsonl", id_items)):
        with open(os.path.join(out, "choices", file_name), "w") as f:
            for it in items:
                f.write(json.dumps(it, ensure_ascii=False) + "\n")
        m64 = float64_model(os.path.join(out, model_name))
        scored, correct, margin = [], 0, math.inf
        for it in items:
            if "context" in it:
                # lm-evaluation-harness's rule: an ending's tokens are those of encode(context +
                # ending) past encode(context) (encoded alone, a SentencePiece tokenizer would give
                # " ending" a second "▁"). No token straddles the join in these items.
                ctx = sp.encode(it["context"], add_special_tokens=True).ids
                wholes = [sp.encode(it["context"] + e, add_special_tokens=True).ids for e in it["endings"]]
                assert all(w[:len(ctx)] == ctx for w in wholes), it
                ends = [w[len(ctx):] for w in wholes]
            else:
                ctx, ends = it["context_ids"], it["ending_ids"]
            lp = choice_logprobs(m64, ctx, ends)
            top = sorted(lp, reverse=True)
            margin = min(margin, top[0] - top[1])
            pick = first_max(lp)
            correct += pick == it["label"]
            rec = {"context_ids": ctx, "ending_ids": ends, "logprob": lp, "pick": pick,
                   "pick_per_token": first_max([v / len(e) for v, e in zip(lp, ends)])}
            if "endings" in it:
                rec["pick_per_byte"] = first_max([v / len(e.encode()) for v, e in zip(lp, it["endings"])])
            scored.append(rec)
        assert margin > MIN_MARGIN, (model_name, margin)
        expected = {"model": model_name, "file": "choices/" + file_name, "acc": correct / len(items),
                    "min_top2_gap": float(f"{margin:.4g}"), "items": scored}
        print(f"[choices {file_name}] {model_name}: acc {correct}/{len(items)}, min gap {margin:.3g}")
        with open(os.path.join(out, "expected", "choices_" + model_name + ".json"), "w") as f:
            f.write(json.dumps(expected, indent=1) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--check", action="store_true", help="rebuild in a temporary directory and compare")
    ap.add_argument("--only", nargs="+", metavar="NAME", help="build only these models (and their expected files)")
    args = ap.parse_args()
    if not args.check:
        build(args.out, args.only)
        total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(args.out) for f in fs)
        print(f"wrote {args.out} ({total} bytes)")
        return 0
    tmp = tempfile.mkdtemp(prefix="keel_hf_fixtures_")
    build(tmp)
    bad = []
    for d, _, files in os.walk(tmp):
        for f in files:
            rel = os.path.relpath(os.path.join(d, f), tmp)
            ref = os.path.join(args.out, rel)
            if not os.path.exists(ref) or not filecmp.cmp(ref, os.path.join(d, f), shallow=False):
                bad.append(rel)
    shutil.rmtree(tmp)
    if bad:
        print("CHECK FAILED: " + ", ".join(sorted(bad)))
        return 1
    print(f"check ok: {args.out} matches a fresh build")
    return 0


if __name__ == "__main__":
    sys.exit(main())
