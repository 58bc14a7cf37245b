#!/usr/bin/env python3
"""PyTorch side of scripts/bench_gpu.sh: the same training step as keel, timed on one GPU.

    python3 scripts/bench_torch.py --peak                       # measured peak bf16 matmul TFLOP/s
    python3 scripts/bench_torch.py --config configs/gpt2-124m.json --micro-batch 32 --seq-len 1024 \
        --steps 20 --warmup 5 --peak-tflops 790

The model is built from the keel config (GPT-2 or Llama family, same shapes, tied head, padded
vocabulary), in plain PyTorch: bf16 autocast over fp32 parameters, F.scaled_dot_product_attention
(causal; GQA with enable_gqa), fused AdamW, global-norm clipping at 1.0, torch.compile of the
whole forward + loss. Tokens are uniform random (the step costs the same on any tokens).

Prints one line a script can parse:
    RESULT framework=pytorch model=<name> tokens_per_s=<x> ms_per_step=<x> tflops=<x> mfu=<x> peak_mem_gib=<x>
MFU uses keel's FLOP count (Transformer::flops_per_token: 6 x matmul parameters incl. the head
+ 12 x layers x T x q_dim per token) over the peak measured by --peak on the same GPU.
"""
import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


def model_shape(cfg):
    m = dict(cfg["model"])
    m.setdefault("n_kv_heads", m["n_heads"])
    m.setdefault("tied_embeddings", False)
    m.setdefault("norm_eps", 1e-5)
    m.setdefault("rope_theta", 10000.0)
    pad = m.get("pad_vocab_to_multiple_of", 1) or 1
    m["embed_rows"] = (m["vocab_size"] + pad - 1) // pad * pad
    m["head_dim"] = m["d_model"] // m["n_heads"]
    return m


def flops_per_token(m, T):
    """keel's Transformer::flops_per_token."""
    d, hd = m["d_model"], m["head_dim"]
    q, kv, Fh = m["n_heads"] * hd, m["n_kv_heads"] * hd, m["ffn_hidden"]
    mlp = 3 * d * Fh if m["family"] == "llama" else 2 * d * Fh
    per_layer = d * (q + 2 * kv) + q * d + mlp
    matmul_params = m["n_layers"] * per_layer + m["embed_rows"] * d
    return 6 * matmul_params + 12 * m["n_layers"] * T * q


class Block(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m
        d, hd = m["d_model"], m["head_dim"]
        self.nh, self.nkv, self.hd = m["n_heads"], m["n_kv_heads"], hd
        gpt2 = m["family"] == "gpt2"
        self.gpt2 = gpt2
        self.qkv = nn.Linear(d, (self.nh + 2 * self.nkv) * hd, bias=gpt2)
        self.wo = nn.Linear(self.nh * hd, d, bias=gpt2)
        if gpt2:
            self.ln1 = nn.LayerNorm(d, eps=m["norm_eps"])
            self.ln2 = nn.LayerNorm(d, eps=m["norm_eps"])
            self.fc = nn.Linear(d, m["ffn_hidden"], bias=True)
            self.proj = nn.Linear(m["ffn_hidden"], d, bias=True)
        else:
            self.n1 = nn.Parameter(torch.ones(d))
            self.n2 = nn.Parameter(torch.ones(d))
            self.gate_up = nn.Linear(d, 2 * m["ffn_hidden"], bias=False)
            self.down = nn.Linear(m["ffn_hidden"], d, bias=False)

    def norm(self, x, which):
        if self.gpt2:
            return (self.ln1 if which == 1 else self.ln2)(x)
        w = self.n1 if which == 1 else self.n2
        return F.rms_norm(x, (x.shape[-1],), w, self.m["norm_eps"])

    def forward(self, x, rope):
        B, T, _ = x.shape
        h = self.norm(x, 1)
        qkv = self.qkv(h)
        q, k, v = qkv.split([self.nh * self.hd, self.nkv * self.hd, self.nkv * self.hd], dim=-1)
        q = q.view(B, T, self.nh, self.hd).transpose(1, 2)
        k = k.view(B, T, self.nkv, self.hd).transpose(1, 2)
        v = v.view(B, T, self.nkv, self.hd).transpose(1, 2)
        if not self.gpt2:
            cos, sin = rope
            cos, sin = cos[:T].to(q.dtype), sin[:T].to(q.dtype)

            def rot(t):
                a, b = t.chunk(2, dim=-1)
                return t * cos + torch.cat((-b, a), dim=-1) * sin

            q, k = rot(q), rot(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.nkv != self.nh)
        x = x + self.wo(y.transpose(1, 2).reshape(B, T, self.nh * self.hd))
        h = self.norm(x, 2)
        if self.gpt2:
            h = self.proj(F.gelu(self.fc(h), approximate="tanh"))
        else:
            g, u = self.gate_up(h).chunk(2, dim=-1)
            h = self.down(F.silu(g) * u)
        return x + h


class Model(nn.Module):
    def __init__(self, m, T):
        super().__init__()
        self.m = m
        d = m["d_model"]
        self.tok = nn.Embedding(m["embed_rows"], d)
        self.gpt2 = m["family"] == "gpt2"
        if self.gpt2:
            self.pos = nn.Embedding(T, d)
            self.lnf = nn.LayerNorm(d, eps=m["norm_eps"])
        else:
            self.nf = nn.Parameter(torch.ones(d))
            hd = m["head_dim"]
            inv = 1.0 / (m["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
            ang = torch.outer(torch.arange(T, dtype=torch.float32), inv)
            emb = torch.cat((ang, ang), dim=-1)
            self.register_buffer("cos", emb.cos(), persistent=False)
            self.register_buffer("sin", emb.sin(), persistent=False)
        self.blocks = nn.ModuleList()
        for _ in range(m["n_layers"]):
            self.blocks.append(Block(m))
        if not m["tied_embeddings"]:
            self.head = nn.Linear(d, m["embed_rows"], bias=False)
        for p in self.parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx, targets):
        B, T = idx.shape
        x = self.tok(idx)
        if self.gpt2:
            x = x + self.pos(torch.arange(T, device=idx.device))
        rope = None if self.gpt2 else (self.cos, self.sin)
        for blk in self.blocks:
            x = blk(x, rope)
        if self.gpt2:
            x = self.lnf(x)
        else:
            x = F.rms_norm(x, (x.shape[-1],), self.nf, self.m["norm_eps"])
        w = self.tok.weight if self.m["tied_embeddings"] else self.head.weight
        logits = F.linear(x, w)
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


def peak_bf16_tflops(n=8192, reps=30):
    """Median bf16 matmul rate over rotating random inputs (not zeros: zeros run faster)."""
    torch.manual_seed(0)
    sets = [(torch.randn(n, n, device="cuda", dtype=torch.bfloat16),
             torch.randn(n, n, device="cuda", dtype=torch.bfloat16)) for _ in range(3)]
    out = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    for i in range(5):
        torch.matmul(*sets[i % 3], out=out)
    times = []
    for i in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        torch.matmul(*sets[i % 3], out=out)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return 2 * n ** 3 / statistics.median(times) / 1e12


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peak", action="store_true", help="measure the peak bf16 matmul rate and exit")
    ap.add_argument("--config")
    ap.add_argument("--name")
    ap.add_argument("--micro-batch", type=int)
    ap.add_argument("--seq-len", type=int)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--peak-tflops", type=float, default=0.0)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: a smoke run of this script's logic on a machine without a GPU (not a benchmark)")
    args = ap.parse_args()
    dev = args.device
    if dev == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_torch.py: no CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    if args.peak:
        print(f"PEAK bf16_tflops={peak_bf16_tflops():.1f} device={torch.cuda.get_device_name()}")
        return

    cfg = json.load(open(args.config))
    m = model_shape(cfg)
    T = args.seq_len or cfg["train"]["seq_len"]
    B = args.micro_batch or cfg["train"]["micro_batch"]
    name = args.name or os.path.splitext(os.path.basename(args.config))[0]
    opt_cfg = cfg.get("optimizer", {})
    torch.manual_seed(1234)
    model = Model(m, T).to(dev)
    decay = [p for n_, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n_, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": opt_cfg.get("weight_decay", 0.1)}, {"params": no_decay, "weight_decay": 0.0}],
        lr=opt_cfg.get("lr", 3e-4), betas=(opt_cfg.get("beta1", 0.9), opt_cfg.get("beta2", 0.95)),
        eps=opt_cfg.get("eps", 1e-8), fused=dev == "cuda")
    step_fn = model if args.no_compile else torch.compile(model)
    vocab = m["vocab_size"]
    g = torch.Generator(device=dev)
    g.manual_seed(1)

    def batch():
        tok = torch.randint(0, vocab, (B, T + 1), device=dev, generator=g)
        return tok[:, :-1].contiguous(), tok[:, 1:].contiguous()

    def step():
        x, y = batch()
        with torch.autocast(dev, dtype=torch.bfloat16):
            loss = step_fn(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), opt_cfg.get("grad_clip", 1.0))
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    def timed_step():  # ms of one step: CUDA events on the GPU, the host clock on the CPU
        if dev == "cpu":
            t = time.perf_counter()
            loss = step()
            return loss, (time.perf_counter() - t) * 1e3
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        loss = step()
        e.record()
        e.synchronize()
        return loss, s.elapsed_time(e)

    t0 = time.time()
    for _ in range(args.warmup):
        step()
    if dev == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    print(f"bench_torch: {name}: warm-up (compile) {time.time() - t0:.1f} s", file=sys.stderr)
    times = []
    for _ in range(args.steps):
        loss, ms_step = timed_step()
        times.append(ms_step)
    ms = statistics.median(times)
    tokens = B * T
    tps = tokens / (ms / 1e3)
    tflops = flops_per_token(m, T) * tps / 1e12
    mfu = tflops / args.peak_tflops if args.peak_tflops > 0 else float("nan")
    mem = torch.cuda.max_memory_allocated() / 2 ** 30 if dev == "cuda" else float("nan")
    params = sum(p.numel() for p in model.parameters())
    print(f"bench_torch: {name}: {params / 1e6:.1f}M parameters, B={B} T={T}, loss {loss.item():.4f}, "
          f"ms/step min {min(times):.1f} median {ms:.1f} max {max(times):.1f}", file=sys.stderr)
    print(f"RESULT framework=pytorch model={name} tokens_per_s={tps:.0f} ms_per_step={ms:.2f} tflops={tflops:.1f} "
          f"mfu={mfu:.3f} peak_mem_gib={mem:.2f}")


if __name__ == "__main__":
    main()
