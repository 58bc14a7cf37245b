#!/usr/bin/env python3
"""Trains one model under every tp x pp x dp layout of N ranks (mpirun) and under one process,
then prints a Markdown table: layout, max relative loss and grad-norm difference from the single
process over the run, wall time. fp32, so the differences are summation order only.

  python3 scripts/layout_table.py --keel build/keel --family llama --ranks 8 --steps 20

Data: the demo corpus (scripts/prepare_data.py). The model is the tiny demo shape made
divisible by 8 everywhere (8 layers, 16 query / 8 kv heads for Llama).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def layouts(n):
    out = []
    for tp in (1, 2, 4, 8):
        for pp in (1, 2, 4, 8):
            if n % (tp * pp) == 0 and tp * pp <= n:
                out.append((tp, pp, n // (tp * pp)))
    return out


def run(keel, config, out, layout, steps, mpirun):
    tp, pp, dp = layout
    cmd = [keel, "train", "--config", config, "--out", out, "-q", "--steps", str(steps),
           "--set", f"parallel.tp={tp}", "--set", f"parallel.pp={pp}", "--set", f"parallel.dp={dp}"]
    if tp * pp * dp > 1:
        cmd = mpirun + ["-np", str(tp * pp * dp)] + cmd
    env = dict(os.environ, OMP_NUM_THREADS="1")
    start = time.time()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.time() - start
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    recs = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl")) if l.strip()]
    recs = [x for x in recs if "loss" in x]
    return [x["loss"] for x in recs], [x["grad_norm"] for x in recs], wall


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keel", default="build/keel")
    ap.add_argument("--family", choices=["llama", "gpt2"], default="llama")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--mpirun", default="mpirun --oversubscribe --allow-run-as-root")
    a = ap.parse_args()

    base = "configs/llama-tiny.json" if a.family == "llama" else "configs/gpt2-tiny.json"
    cfg = json.load(open(base))
    cfg["model"].update({"n_layers": 8, "d_model": 128, "ffn_hidden": 512, "max_seq_len": 64, "vocab_size": 2048})
    if a.family == "llama":
        cfg["model"].update({"n_heads": 16, "n_kv_heads": 8})
    else:
        cfg["model"].update({"n_heads": 8, "n_kv_heads": 8})
    cfg["precision"] = {"mode": "fp32"}
    cfg["train"].update({"global_batch": 16, "micro_batch": 2, "seq_len": 64, "eval_interval": 0, "eval_batches": 0})
    cfg["data"] = {"train": "data/fortunes/train_*.bin"}
    cfg.pop("choice_eval", None)
    cfg.pop("sample", None)  # generation during training needs tp = pp = 1
    cfg["checkpoint"] = {"interval": 0, "save_at_end": False}
    cfg["log"] = {"interval": 1}
    work = tempfile.mkdtemp(prefix="keel-layouts-")
    config = os.path.join(work, "config.json")
    json.dump(cfg, open(config, "w"))

    mpirun = a.mpirun.split()
    ref_loss, ref_norm, ref_wall = run(a.keel, config, os.path.join(work, "single"), (1, 1, 1), a.steps, mpirun)
    print(f"{a.family}, fp32, {a.steps} steps; single process: final loss {ref_loss[-1]:.6f}, wall {ref_wall:.1f} s\n")
    print("| layout | max rel. loss diff | max rel. grad-norm diff | wall (s) |")
    print("|---|---|---|---|")
    for lay in layouts(a.ranks):
        loss, norm, wall = run(a.keel, config, os.path.join(work, "l%d%d%d" % lay), lay, a.steps, mpirun)
        dl = max(abs(x - y) / abs(y) for x, y in zip(loss, ref_loss))
        dn = max(abs(x - y) / abs(y) for x, y in zip(norm, ref_norm))
        print(f"| tp={lay[0]} pp={lay[1]} dp={lay[2]} | {dl:.1e} | {dn:.1e} | {wall:.1f} |", flush=True)


if __name__ == "__main__":
    main()
