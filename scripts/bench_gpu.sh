#!/usr/bin/env bash
# keel vs PyTorch training throughput on one GPU, in one run: GPT-2 124M at T=1024 and a Llama of
# 1.24B parameters (configs/llama-1b.json) at T=2048, same shapes, micro-batch and sequence length
# on both sides, random tokens.
#
#   scripts/bench_gpu.sh [STAGE] [MODELS]
#     STAGE   all (default) | build | peak | keel | torch | report
#     MODELS  all (default) | gpt2 | llama1b
#
# Stages (each can be run on its own, e.g. to fit a time limit per call; results accumulate in
# $BENCH_OUT):
#   build   cmake + build keel for sm_90a (Release, no tests) into $BUILD
#   peak    measured peak bf16 matmul TFLOP/s of this GPU (8192^3 products, PyTorch/cuBLAS)
#   keel    synthetic token shards, then `keel train` for STEPS steps; median ms/step of the
#           steps after the first WARMUP, tokens/s, MFU, peak memory (KEEL_CUDA_MEMSTATS)
#   torch   scripts/bench_torch.py: bf16 autocast, fused AdamW, SDPA, torch.compile
#   report  the table, and a dated section appended to bench/RESULTS.md (and $BENCH_OUT/results.md)
#
# Knobs (environment): BUILD (build dir, default build-bench), BENCH_OUT (default $OUT when set,
# else /tmp/keel-bench), JOBS, STEPS_GPT2 (20), STEPS_LLAMA (12), WARMUP (4), MBS_GPT2 (32),
# MBS_LLAMA (4), KEEL_EXTRA (more `keel train` arguments, e.g. "--set precision.mode=fp32").
#
# MFU = model FLOPs per second / measured peak: FLOPs per token are keel's
# Transformer::flops_per_token (6 x matmul parameters incl. the head + 12 x layers x T x q_dim),
# the same number on both sides.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
STAGE=${1:-all}
MODELS=${2:-all}
BUILD=${BUILD:-$ROOT/build-bench}
BENCH_OUT=${BENCH_OUT:-${OUT:-/tmp/keel-bench}}
JOBS=${JOBS:-$(nproc)}
STEPS_GPT2=${STEPS_GPT2:-20}
STEPS_LLAMA=${STEPS_LLAMA:-12}
WARMUP=${WARMUP:-4}
MBS_GPT2=${MBS_GPT2:-32}
MBS_LLAMA=${MBS_LLAMA:-4}
KEEL_EXTRA=${KEEL_EXTRA:-}
PY=${PYTHON:-python3}
mkdir -p "$BENCH_OUT"

models() {
  case "$MODELS" in
    all) echo "gpt2 llama1b" ;;
    gpt2 | llama1b) echo "$MODELS" ;;
    *) echo "bench_gpu.sh: unknown model set '$MODELS' (all, gpt2, llama1b)" >&2; exit 2 ;;
  esac
}
# name -> config, seq_len, micro-batch, steps
cfg_of() { case "$1" in gpt2) echo "$ROOT/configs/gpt2-124m.json" ;; llama1b) echo "$ROOT/configs/llama-1b.json" ;; esac; }
T_of() { case "$1" in gpt2) echo 1024 ;; llama1b) echo 2048 ;; esac; }
mbs_of() { case "$1" in gpt2) echo "$MBS_GPT2" ;; llama1b) echo "$MBS_LLAMA" ;; esac; }
steps_of() { case "$1" in gpt2) echo "$STEPS_GPT2" ;; llama1b) echo "$STEPS_LLAMA" ;; esac; }

stage_build() {
  echo "== build keel (sm_90a, Release) in $BUILD"
  local t0=$SECONDS
  # Header-only dependencies carried from gpu_prebuild.sh, where the GPU machine has none.
  local prefix=()
  [ -d "$ROOT/build-gpu/carry/deps" ] && prefix=(-DCMAKE_PREFIX_PATH="$ROOT/build-gpu/carry/deps")
  cmake -S "$ROOT" -B "$BUILD" "${prefix[@]}" -DCMAKE_BUILD_TYPE=Release -DKEEL_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a \
    -DKEEL_TESTS=OFF -DKEEL_MPI=OFF > "$BENCH_OUT/cmake.log" 2>&1 || { tail -30 "$BENCH_OUT/cmake.log"; exit 1; }
  cmake --build "$BUILD" -j"$JOBS" --target keel > "$BENCH_OUT/build.log" 2>&1 || { tail -40 "$BENCH_OUT/build.log"; exit 1; }
  echo "   built in $((SECONDS - t0)) s: $(keel_bin)"
}

keel_bin() {
  local b
  for b in "$BUILD/keel" "$BUILD/train/keel"; do [ -x "$b" ] && { echo "$b"; return; }; done
  b=$(find "$BUILD" -maxdepth 3 -type f -name keel -perm -u+x 2>/dev/null | head -1)
  [ -n "$b" ] || { echo "bench_gpu.sh: no keel binary under $BUILD (run the build stage)" >&2; exit 1; }
  echo "$b"
}

stage_peak() {
  echo "== peak bf16 matmul rate"
  "$PY" "$ROOT/scripts/bench_torch.py" --peak | tee "$BENCH_OUT/peak.txt"
}

peak_tflops() {
  [ -f "$BENCH_OUT/peak.txt" ] || stage_peak > /dev/null
  sed -n 's/.*bf16_tflops=\([0-9.]*\).*/\1/p' "$BENCH_OUT/peak.txt"
}

# Random-token llm.c shard for a config's vocabulary: enough windows for the run.
make_shard() { "$PY" "$ROOT/scripts/random_shard.py" "$2" "$3" --config "$1"; }

stage_keel() {
  local bin peak
  bin=$(keel_bin)
  peak=$(peak_tflops)
  for m in $(models); do
    local cfg T mbs steps dir tokens
    cfg=$(cfg_of "$m"); T=$(T_of "$m"); mbs=$(mbs_of "$m"); steps=$(steps_of "$m")
    dir="$BENCH_OUT/keel-$m"
    rm -rf "$dir"; mkdir -p "$dir"
    tokens=$(( (steps + 2) * mbs * (T + 1) + 4096 ))
    make_shard "$cfg" "$dir/train_000.bin" "$tokens"
    echo "== keel $m: B=$mbs T=$T, $steps steps"
    set +e
    KEEL_CUDA_MEMSTATS=1 "$bin" train --config "$cfg" --out "$dir/run" --device cuda --steps "$steps" \
      --set "data.train=[\"$dir/train_000.bin\"]" --set 'data.val=[]' --set data.shuffle=false \
      --set train.micro_batch="$mbs" --set train.global_batch="$mbs" --set train.seq_len="$T" \
      --set train.eval_interval=0 --set checkpoint.interval=0 --set checkpoint.save_at_end=false \
      --set schedule.warmup_steps=2 --set log.interval=1 $KEEL_EXTRA > "$dir/log.txt" 2>&1
    local rc=$?
    set -e
    if [ $rc -ne 0 ]; then
      echo "   keel failed (exit $rc):"; tail -20 "$dir/log.txt"
      echo "RESULT framework=keel model=$m failed=1" > "$dir/result.txt"
      continue
    fi
    "$PY" - "$dir/log.txt" "$WARMUP" "$peak" "$m" "$mbs" "$T" > "$dir/result.txt" <<'EOF'
import re, statistics, sys
log, warm, peak, name, B, T = sys.argv[1], int(sys.argv[2]), float(sys.argv[3] or 0), sys.argv[4], int(sys.argv[5]), int(sys.argv[6])
ms, tf = [], []
mem = float("nan")
for line in open(log):
    m = re.search(r"elapsed time per iteration \(ms\): ([0-9.]+).*TFLOPs: ([0-9.]+)", line)
    if m:
        ms.append(float(m.group(1))); tf.append(float(m.group(2)))
    m = re.search(r"peak device memory held by keel ([0-9.]+) GiB", line)
    if m:
        mem = float(m.group(1))
ms, tf = ms[warm:] or ms, tf[warm:] or tf
med = statistics.median(ms)
tps = B * T / (med / 1e3)
tflops = statistics.median(tf)
mfu = tflops / peak if peak > 0 else float("nan")
print(f"RESULT framework=keel model={name} tokens_per_s={tps:.0f} ms_per_step={med:.2f} tflops={tflops:.1f} mfu={mfu:.3f} peak_mem_gib={mem:.2f}")
EOF
    cat "$dir/result.txt"
  done
}

stage_torch() {
  local peak
  peak=$(peak_tflops)
  for m in $(models); do
    local dir="$BENCH_OUT/torch-$m"
    mkdir -p "$dir"
    echo "== pytorch $m: B=$(mbs_of "$m") T=$(T_of "$m"), $(steps_of "$m") steps after $WARMUP warm-up (compile)"
    set +e
    "$PY" "$ROOT/scripts/bench_torch.py" --config "$(cfg_of "$m")" --name "$m" --micro-batch "$(mbs_of "$m")" \
      --seq-len "$(T_of "$m")" --steps "$(steps_of "$m")" --warmup "$WARMUP" --peak-tflops "$peak" \
      > "$dir/result.txt" 2> "$dir/log.txt"
    local rc=$?
    set -e
    if [ $rc -ne 0 ]; then
      echo "   pytorch failed (exit $rc):"; tail -20 "$dir/log.txt"
      echo "RESULT framework=pytorch model=$m failed=1" > "$dir/result.txt"
    fi
    cat "$dir/result.txt"
  done
}

stage_report() {
  local device commit date peak
  device=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1 || echo unknown)
  # KEEL_COMMIT: what the binaries were built from (scripts/gpu_session.sh passes it on from
  # gpu_prebuild.sh's STAMP, since a GPU machine's copy of the tree has no git history).
  if [ -n "${KEEL_COMMIT:-}" ]; then
    commit=$KEEL_COMMIT
  else
    commit=$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)
    if ! git -C "$ROOT" diff --quiet 2>/dev/null; then commit="$commit (+ local changes)"; fi
  fi
  date=$(date -u +%Y-%m-%d)
  peak=$(peak_tflops)
  "$PY" - "$BENCH_OUT" "$device" "$commit" "$date" "$peak" "$STEPS_GPT2" "$STEPS_LLAMA" "$WARMUP" "$MBS_GPT2" "$MBS_LLAMA" \
    > "$BENCH_OUT/results.md" <<'EOF'
import glob, os, sys
out, device, commit, date, peak = sys.argv[1:6]
steps_gpt2, steps_llama, warm, mbs_gpt2, mbs_llama = sys.argv[6:11]
rows = {}
for f in glob.glob(os.path.join(out, "*", "result.txt")):
    for line in open(f):
        if line.startswith("RESULT"):
            kv = dict(p.split("=", 1) for p in line.split()[1:])
            rows[(kv["model"], kv["framework"])] = kv
print(f"## {date} - {device}\n")
print(f"- commit: {commit}")
print(f"- command: `scripts/bench_gpu.sh` (steps gpt2 {steps_gpt2}, llama1b {steps_llama}; first {warm} not timed; "
      f"micro-batch gpt2 {mbs_gpt2}, llama1b {mbs_llama}; no gradient accumulation)")
print(f"- measured peak bf16 matmul: {peak} TFLOP/s\n")
print("| model | T | framework | tokens/s | ms/step | TFLOP/s | MFU | peak memory (GiB) | keel / PyTorch |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for model, T in (("gpt2", 1024), ("llama1b", 2048)):
    base = rows.get((model, "pytorch"), {})
    for fw in ("keel", "pytorch"):
        r = rows.get((model, fw))
        if not r:
            continue
        if r.get("failed"):
            print(f"| {model} | {T} | {fw} | failed | | | | | |")
            continue
        ratio = ""
        if fw == "keel" and base and not base.get("failed"):
            ratio = f"{float(r['tokens_per_s']) / float(base['tokens_per_s']):.2f}x"
        mfu = float(r["mfu"])
        print(f"| {model} | {T} | {fw} | {float(r['tokens_per_s']):,.0f} | {r['ms_per_step']} | {r['tflops']} | "
              f"{mfu:.1%} | {r['peak_mem_gib']} | {ratio} |")
print()
EOF
  echo
  cat "$BENCH_OUT/results.md"
  if [ -f "$ROOT/bench/RESULTS.md" ]; then
    { echo; cat "$BENCH_OUT/results.md"; } >> "$ROOT/bench/RESULTS.md"
    echo "(appended to bench/RESULTS.md; copy it back from the GPU machine: $BENCH_OUT/results.md)"
  fi
}

case "$STAGE" in
  build) stage_build ;;
  peak) stage_peak ;;
  keel) stage_keel ;;
  torch) stage_torch ;;
  report) stage_report ;;
  all)
    [ -x "$BUILD/keel" ] || stage_build
    stage_peak
    stage_keel
    stage_torch
    stage_report
    ;;
  *) echo "usage: scripts/bench_gpu.sh [all|build|peak|keel|torch|report] [all|gpt2|llama1b]" >&2; exit 2 ;;
esac
