#!/usr/bin/env bash
# Everything issue 5 asks of a lent GPU machine, in as few device calls as possible. Run
# scripts/gpu_prebuild.sh here first, then on the device (carry: build-gpu/carry):
#
#   scripts/gpu_session.sh short        # the one call a 15-minute device budget allows (BUDGET=420
#                                       #   leaves time to rerun): env, keel vs PyTorch (both
#                                       #   shapes), the GPU tests with the error table, keel's rows
#                                       #   with the optional attention paths (variants), the op
#                                       #   profiles; in that order, each as the budget allows
#   scripts/gpu_session.sh check        # <= 9 min: env, GPU tests + per-op error table, memcheck
#   scripts/gpu_session.sh bench        # <= 9 min: keel vs PyTorch (both shapes), op profiles,
#                                       #           racecheck of the attention kernels
#   scripts/gpu_session.sh dry-run      # here, no GPU needed: that the binaries unpack and run, that
#                                       # every test filter selects tests, every file and `keel
#                                       # train` argument set the stages use is valid, and that
#                                       # the binaries are of this commit. Run it before a device call.
#   scripts/gpu_session.sh STAGE...     # any of: env build test memcheck racecheck throughput
#                                       # (bench's timings alone, BENCH_STAGES) variants
#                                       # (keel's benchmark rows with KEEL_ATTN_WGMMA=1 and with
#                                       # KEEL_ATTENTION=cudnn, against the bench stage's) profile
#                                       # recompute (Llama 1B with train.recompute "full": memory
#                                       # and ms/step against the bench stage's run) unfused (the
#                                       # profiles with every optional fusion off) wgmma (the
#                                       # profiles with the wgmma attention kernels) cudnn (the
#                                       # profiles with cuDNN attention) splitk (the
#                                       # profiles with KEEL_SPLITK_ANY=0) ncu (Nsight
#                                       # Compute on the attention kernels; NCU_KERNELS, NCU_COUNT,
#                                       # NCU_SKIP)
#
# Binaries: build-gpu/carry/bin.tar.gz (from gpu_prebuild.sh; unpacked into /tmp/keel-bin) or
# build-gpu/carry/bin when present, else the `build` stage
# compiles keel and test_gpu on the device with the carried header-only dependencies
# (build-gpu/carry/deps), or with system ones where the device has them.
#
# Output: a short summary on stdout (the device call returns its tail); logs and tables under
# /tmp/keel-gpu (RES): env.txt, test_gpu.log, test_gpu-wgmma.log, test_gpu-cudnn.log,
# test_gpu-attention-wgmma.log, error_table.md, memcheck.log, racecheck.log, bench/results.md (the
# section for bench/RESULTS.md), profile-<model>.txt. On a device call
# ($OUT set) they come back packed as $OUT/keel-gpu.tgz (less the token shards): the tool
# returns at most 8 files.
#
# Knobs: BUDGET (seconds, default 560), UNPACK (where bin.tar.gz goes, default /tmp/keel-bin),
# BENCH_STAGES (the bench stage's scripts/bench_gpu.sh
# stages with their seconds, default "peak:60 keel:180 torch:300 report:30").
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CARRY=${CARRY:-$ROOT/build-gpu/carry}
BIN=${BIN:-$CARRY/bin}
RES=${RES:-/tmp/keel-gpu}
PY=${PYTHON:-python3}
SUMMARY=$RES/summary.txt
say() { echo "$*" | tee -a "$SUMMARY"; }
# A device call may run 10 minutes: every limit below is cut to what is left of BUDGET seconds
# (default 560), so the summary is always printed.
BUDGET=${BUDGET:-560}
limit() {  # limit <wanted seconds>: that, or what is left of the budget (at least 1)
  local left=$((BUDGET - SECONDS))
  [ "$left" -lt 1 ] && left=1
  [ "$1" -lt "$left" ] && echo "$1" || echo "$left"
}

# The stages (stage_<name> below) a command line may name, besides check, bench and throughput.
STAGES=(env build test memcheck racecheck variants profile recompute unfused wgmma cudnn splitk ncu)
if [ $# -eq 0 ]; then set -- check; fi
stages=()
for a in "$@"; do
  case "$a" in
    short) stages+=(env bench test variants profile) ;;
    check) stages+=(env test memcheck) ;;
    bench) stages+=(env bench profile racecheck) ;;
    throughput) stages+=(bench) ;;
    dry-run) stages+=(dry_run) ;;
    *)
      if [[ " ${STAGES[*]} " == *" $a "* ]]; then stages+=("$a"); else
        echo "gpu_session.sh: unknown stage '$a' (short, check, bench, throughput, dry-run, ${STAGES[*]})" >&2; exit 2
      fi ;;
  esac
done
# test_gpu's filters: the test stage's runs, memcheck's and racecheck's.
TEST_SPECS=('~[wgmma]~[cudnn]' '[wgmma]' '[cudnn]' '[attention]~[wgmma]~[cudnn]')
MEMCHECK_FILTER='[gpu]~[train]~[oracle]~[determinism]~[ckpt]'
RACECHECK_FILTER=${RACECHECK_FILTER:-[attention]~[decode]}
mkdir -p "$RES"
: > "$SUMMARY"

# The CUDA libraries keel links (cuBLASLt, cudart, NCCL): the toolkit's, else the ones PyTorch's
# wheels bring, and libcudnn.so.9 for KEEL_ATTENTION=cudnn (opened at run time, not linked). The
# CUDA 13 wheels put theirs in nvidia/cu13/lib, the older ones in nvidia/<library>/lib.
setup_libs() {
  local d extra=""
  for d in /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/local/cuda/targets/x86_64-linux/lib; do
    [ -d "$d" ] && extra="$extra:$d"
  done
  for d in $("$PY" -c '
import os, nvidia
for root in nvidia.__path__:
    for sub in ("cu13", "cublas", "cuda_runtime", "nccl", "cudnn"):
        print(os.path.join(root, sub, "lib"))' 2>/dev/null); do
    [ -d "$d" ] && extra="$extra:$d"
  done
  export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}$extra"
}

have_bins() { [ -x "$BIN/keel" ] && [ -x "$BIN/test_gpu" ]; }
# The commit the carried binaries were built from (gpu_prebuild.sh's STAMP), for the bench reports.
stamp_commit() { head -1 "$CARRY/STAMP" 2>/dev/null | sed 's/^commit //'; }
if ! have_bins && [ -f "$CARRY/bin.tar.gz" ]; then
  UNPACK=${UNPACK:-/tmp/keel-bin}
  mkdir -p "$UNPACK" && tar -C "$UNPACK" -xzf "$CARRY/bin.tar.gz" && BIN=$UNPACK/bin
fi

stage_env() {
  {
    echo "== env $(date -u +%Y-%m-%dT%H:%MZ)"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>&1
    nvcc --version 2>&1 | tail -1
    g++ --version 2>&1 | head -1
    "$PY" -c 'import torch; print("torch", torch.__version__, torch.version.cuda)' 2>&1
    command -v compute-sanitizer ncu ninja cmake 2>&1
    [ -f "$CARRY/STAMP" ] && cat "$CARRY/STAMP"
    if have_bins; then ldd "$BIN/keel" | grep -E 'not found|cublas|cudart|gomp'; fi
    for d in ${LD_LIBRARY_PATH//:/ }; do ls "$d"/libcudnn.so.9* 2> /dev/null; done | head -1
  } > "$RES/env.txt" 2>&1
  cat "$RES/env.txt"
  head -1 "$RES/env.txt" >> "$SUMMARY"
  sed -n 2p "$RES/env.txt" >> "$SUMMARY"
  [ -f "$CARRY/STAMP" ] && head -1 "$CARRY/STAMP" >> "$SUMMARY"
  if have_bins && ldd "$BIN/keel" | grep -q 'not found'; then say "env: the carried binaries miss libraries (see env.txt)"; fi
}

stage_build() {
  local b=$ROOT/build-gpu/device t0=$SECONDS gen=()
  command -v ninja > /dev/null && gen=(-G Ninja)
  local prefix=()
  [ -d "$CARRY/deps" ] && prefix=(-DCMAKE_PREFIX_PATH="$CARRY/deps")
  say "== build on the device in $b"
  if ! cmake -S "$ROOT" -B "$b" "${gen[@]}" "${prefix[@]}" -DCMAKE_BUILD_TYPE=Release -DKEEL_CUDA=ON \
      -DCMAKE_CUDA_ARCHITECTURES=90a -DKEEL_MPI=OFF -DKEEL_TESTS=ON > "$RES/cmake.log" 2>&1; then
    tail -30 "$RES/cmake.log"; say "build: cmake failed"; return 1
  fi
  if ! cmake --build "$b" -j"$(nproc)" --target keel test_gpu > "$RES/build.log" 2>&1; then
    grep -m 20 -E 'error|Error' "$RES/build.log"; say "build: failed"; return 1
  fi
  mkdir -p "$b/bin"
  cp "$b/keel" "$b/test/test_gpu" "$b/bin/"
  BIN=$b/bin
  say "build: $((SECONDS - t0)) s"
}

ensure_bins() {
  have_bins && return 0
  stage_build || { say "no binaries: stop"; exit 1; }
}

# Worst measured error per (op, case) from KEEL_GPU_ERRORS lines: op, case, measured, tol, kind.
error_table() {
  "$PY" - "$1" <<'EOF'
import collections, sys
worst = collections.OrderedDict()
for line in open(sys.argv[1]):
    parts = line.rstrip("\n").split("\t")
    if len(parts) != 5:
        continue
    op, case, err, tol, kind = parts[0], parts[1], float(parts[2]), float(parts[3]), parts[4]
    key = (op, case, kind)
    n, e, t = worst.get(key, (0, -1.0, tol))
    worst[key] = (n + 1, max(e, err), t)
print("| op | case | comparisons | worst | tolerance | pass |")
print("| --- | --- | --- | --- | --- | --- |")
for (op, case, kind), (n, e, t) in worst.items():
    shown = (f"{int(e)} elements differ" if e else "bit-identical") if kind == "bits" else f"{e:.2e}"
    tol = "bit-identical" if kind == "bits" else f"{t:.0e}"
    print(f"| {op} | {case} | {n} | {shown} | {tol} | {'yes' if e <= t else 'NO'} |")
EOF
}

stage_test() {
  ensure_bins
  local t0=$SECONDS rc
  rm -f "$RES/gpu_errors.tsv"
  # The wgmma tests and the cuDNN ones (both off by default until measured: KEEL_ATTN_WGMMA,
  # KEEL_ATTENTION=cudnn) each in a process of their own, after the rest: a fault there cannot
  # take the other results with it. Last, every other attention test with the wgmma kernels in
  # place of the mma.sync ones (their errors not logged: the table is the default kernels').
  local spec log errors wgmma
  for spec in "${TEST_SPECS[@]}"; do
    case $spec in
      '~[wgmma]~[cudnn]') log=$RES/test_gpu.log wgmma=0 errors=$RES/gpu_errors.tsv ;;
      '[wgmma]') log=$RES/test_gpu-wgmma.log wgmma=0 errors=$RES/gpu_errors.tsv ;;
      '[cudnn]') log=$RES/test_gpu-cudnn.log wgmma=0 errors=$RES/gpu_errors.tsv ;;
      *) log=$RES/test_gpu-attention-wgmma.log wgmma=1 errors= ;;
    esac
    say "== test_gpu $spec (KEEL_CUDA_SYNC=1, KEEL_ATTN_WGMMA=$wgmma)"
    KEEL_CUDA_SYNC=1 KEEL_ATTN_WGMMA=$wgmma KEEL_REQUIRE_CUDNN=1 KEEL_GPU_ERRORS="$errors" KEEL_FIXTURE_DIR="$ROOT/test/fixtures" \
      timeout "$(limit 270)" "$BIN/test_gpu" "$spec" --durations yes > "$log" 2>&1
    rc=$?
    say "test_gpu $spec: exit $rc"
    grep -E '^(All tests passed|test cases:|assertions:)' "$log" | tee -a "$SUMMARY"
    [ $rc -eq 124 ] && say "test_gpu $spec: stopped at its time limit (partial)"
    if [ $rc -ne 0 ]; then
      # The first failures with their context (Catch2 prints the expansion and INFO lines).
      grep -n -B3 -A12 -m 8 'FAILED' "$log" | head -150
    fi
  done
  if [ -s "$RES/gpu_errors.tsv" ]; then
    error_table "$RES/gpu_errors.tsv" > "$RES/error_table.md"
    cat "$RES/error_table.md"
    say "error table: $(grep -c '| yes |' "$RES/error_table.md") rows pass, $(grep -c '| NO |' "$RES/error_table.md") fail"
  fi
  say "test_gpu: $((SECONDS - t0)) s"
}

# compute-sanitizer over the op tests (not the training-step ones: the CPU side dominates them).
sanitize() {
  local tool=$1 filter=$2 limit=$3 t0=$SECONDS rc
  ensure_bins
  command -v compute-sanitizer > /dev/null || { say "$tool: compute-sanitizer not found"; return; }
  say "== compute-sanitizer --tool $tool $filter"
  KEEL_FIXTURE_DIR="$ROOT/test/fixtures" timeout "$(limit "$limit")" compute-sanitizer --tool "$tool" --error-exitcode 9 \
    --print-limit 20 "$BIN/test_gpu" "$filter" > "$RES/$tool.log" 2>&1
  rc=$?
  grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|^(All tests passed|test cases:)' "$RES/$tool.log" | tail -3 | tee -a "$SUMMARY"
  [ $rc -eq 124 ] && say "$tool: stopped at its $limit s limit (partial)"
  [ $rc -eq 9 ] && grep -m 3 -A8 -E '^========= (Invalid|Race|Uninit|Barrier|Program hit)' "$RES/$tool.log"
  say "$tool: exit $rc, $((SECONDS - t0)) s"
}
# The whole training path under memcheck once: keel train on a tiny Llama with 64-wide heads
# (the fused attention kernels), 3 bf16 steps with a checkpoint at the end. Its arguments, in
# run_args, for the tokens in $1 and the run folder $2:
memcheck_train_args() {
  run_args=(--config "$ROOT/configs/llama-tiny.json" --device cuda --out "$2" --steps 3
    --set "data.train=[\"$1\"]" --set 'data.val=[]' --set schedule.warmup_steps=1
    --set model.n_heads=2 --set model.n_kv_heads=1 --set train.eval_interval=0 --set log.interval=1
    --set choice_eval.file= --set sample.interval=0)
}
memcheck_train() {
  local dir=$RES/memcheck-train t0=$SECONDS rc
  local -a run_args
  mkdir -p "$dir"
  "$PY" "$ROOT/scripts/random_shard.py" "$dir/train_000.bin" 100000 --config "$ROOT/configs/llama-tiny.json"
  say "== compute-sanitizer --tool memcheck keel train (tiny Llama, fused attention, bf16)"
  memcheck_train_args "$dir/train_000.bin" "$dir/run"
  timeout "$(limit 120)" compute-sanitizer --tool memcheck --error-exitcode 9 --print-limit 20 "$BIN/keel" train \
    "${run_args[@]}" > "$RES/memcheck-train.log" 2>&1
  rc=$?
  grep -E 'ERROR SUMMARY|lm loss' "$RES/memcheck-train.log" | tail -2 | tee -a "$SUMMARY"
  [ $rc -eq 9 ] && grep -m 3 -A8 -E '^========= (Invalid|Uninit|Program hit)' "$RES/memcheck-train.log"
  say "memcheck keel train: exit $rc, $((SECONDS - t0)) s"
}
stage_memcheck() {
  sanitize memcheck "$MEMCHECK_FILTER" 150
  memcheck_train
}
stage_racecheck() { sanitize racecheck "$RACECHECK_FILTER" "${RACECHECK_S:-120}"; }

stage_bench() {
  ensure_bins
  local t0=$SECONDS
  say "== bench (scripts/bench_gpu.sh)"
  local commit
  commit=$(stamp_commit)
  # stage:seconds wanted (torch.compile's warm-up dominates the PyTorch stage)
  for s in ${BENCH_STAGES:-peak:60 keel:180 torch:300 report:30}; do
    BUILD="$BIN" BENCH_OUT="$RES/bench" KEEL_COMMIT="${commit:-}" timeout "$(limit "${s#*:}")" \
      bash "$ROOT/scripts/bench_gpu.sh" "${s%%:*}" > "$RES/bench-${s%%:*}.log" 2>&1 || tail -20 "$RES/bench-${s%%:*}.log"
  done
  grep '^RESULT' "$RES"/bench/*/result.txt 2>/dev/null | sed 's/.*RESULT //' | tee -a "$SUMMARY"
  [ -f "$RES/bench/results.md" ] && cat "$RES/bench/results.md"
  say "bench: $((SECONDS - t0)) s"
}

# keel's benchmark rows again with each optional attention path (off by default until measured):
# the wgmma kernels (KEEL_ATTN_WGMMA=1) and cuDNN's SDPA (KEEL_ATTENTION=cudnn). The fastest that
# passes its tests should become the default. Each in its own BENCH_OUT, with the bench stage's
# peak when it ran in this call.
stage_variants() {
  ensure_bins
  local t0=$SECONDS commit v dir
  commit=$(stamp_commit)
  for v in KEEL_ATTN_WGMMA=1 KEEL_ATTENTION=cudnn; do
    dir=$RES/bench-${v%%=*}
    mkdir -p "$dir"
    [ -f "$RES/bench/peak.txt" ] && cp "$RES/bench/peak.txt" "$dir/"
    say "== variants: $v (scripts/bench_gpu.sh keel)"
    env "$v" BUILD="$BIN" BENCH_OUT="$dir" KEEL_COMMIT="${commit:-}" timeout "$(limit 150)" \
      bash "$ROOT/scripts/bench_gpu.sh" keel > "$dir.log" 2>&1 || tail -20 "$dir.log"
    grep -h '^RESULT' "$dir"/keel-*/result.txt 2>/dev/null | sed "s/.*RESULT /$v /" | tee -a "$SUMMARY"
    # what keel said of the path (a shape cuDNN refuses runs keel's kernels, said once)
    grep -h "${v%%=*}" "$dir"/keel-*/log.txt 2>/dev/null | sort -u | head -3 | tee -a "$SUMMARY"
  done
  say "variants: $((SECONDS - t0)) s (the bench stage's keel rows are the default kernels')"
}

# The Llama 1B benchmark again with every layer's activations recomputed: the memory it saves
# and the time it costs (about one more forward of the layers: 25-30% on the predicted profile).
stage_recompute() {
  ensure_bins
  local t0=$SECONDS commit
  commit=$(stamp_commit)
  say "== recompute (scripts/bench_gpu.sh keel llama1b, train.recompute full)"
  mkdir -p "$RES/bench-recompute"
  [ -f "$RES/bench/peak.txt" ] && cp "$RES/bench/peak.txt" "$RES/bench-recompute/"  # no second measurement
  BUILD="$BIN" BENCH_OUT="$RES/bench-recompute" KEEL_COMMIT="${commit:-}" KEEL_EXTRA="--set train.recompute=full" \
    timeout "$(limit 240)" bash "$ROOT/scripts/bench_gpu.sh" keel llama1b > "$RES/bench-recompute.log" 2>&1 ||
    tail -20 "$RES/bench-recompute.log"
  grep -h '^RESULT' "$RES"/bench/keel-llama1b/result.txt "$RES"/bench-recompute/keel-llama1b/result.txt 2>/dev/null |
    sed 's/.*RESULT //' | tee -a "$SUMMARY"
  say "recompute: $((SECONDS - t0)) s (the first RESULT line is the bench stage's, when it ran in this call)"
}

# Device time per op (KEEL_CUDA_PROFILE) over a few steps of each benchmark shape.
# $1: a name suffix and $2..: environment settings for the run (stage_unfused).
# A benchmark shape's config, sequence length and micro-batch: sets cfg, T and mbs.
shape_of() {
  case $1 in
    gpt2) cfg=$ROOT/configs/gpt2-124m.json T=1024 mbs=${MBS_GPT2:-32} ;;
    llama1b) cfg=$ROOT/configs/llama-1b.json T=2048 mbs=${MBS_LLAMA:-4} ;;
  esac
}
# The tokens of a short run of shape $1 (after shape_of): the bench stage's shard when it ran in
# this call, else random tokens for 8 steps, made once. Prints the path.
shard_for() {
  local shard
  shard=$(ls "$RES"/bench/keel-$1/train_000.bin 2>/dev/null | head -1)
  if [ -z "$shard" ]; then
    shard=$RES/profile-shard-$1.bin
    [ -f "$shard" ] || "$PY" "$ROOT/scripts/random_shard.py" "$shard" $((8 * mbs * (T + 1) + 4096)) --config "$cfg" >&2
  fi
  echo "$shard"
}
# `keel train` arguments of a short run of $2 steps on shard $1 (after shape_of) into run_args.
short_run_args() {
  run_args=(--config "$cfg" --device cuda --steps "$2" --set "data.train=[\"$1\"]" --set 'data.val=[]'
    --set data.shuffle=false --set train.micro_batch="$mbs" --set train.global_batch="$mbs" --set train.seq_len="$T"
    --set train.eval_interval=0 --set checkpoint.interval=0 --set checkpoint.save_at_end=false
    --set schedule.warmup_steps=1)
}

stage_profile() {
  ensure_bins
  local suffix=${1:-} m cfg T mbs dir
  local -a envs=("${@:2}") run_args
  for m in gpt2 llama1b; do
    shape_of $m
    dir=$RES/profile-$m$suffix
    mkdir -p "$dir"
    short_run_args "$(shard_for $m)" 6
    env "${envs[@]}" KEEL_CUDA_PROFILE="$RES/profile-$m$suffix.txt" timeout "$(limit 90)" "$BIN/keel" train \
      "${run_args[@]}" --out "$dir/run" --set log.interval=1 > "$dir/log.txt" 2>&1 ||
      { say "profile $m: keel failed"; tail -5 "$dir/log.txt"; continue; }
    say "profile $m$suffix (6 steps, B=$mbs T=$T${envs[*]:+, ${envs[*]}}):"
    head -14 "$RES/profile-$m$suffix.txt" | tee -a "$SUMMARY"
  done
}

# Nsight Compute on the attention kernels of each benchmark shape (first step's launches: ncu
# replays each kernel, so warm-up does not colour them): duration, throughput, occupancy, warp
# stalls. --clock-control none: the card's clocks are left as they are.
stage_ncu() {
  ensure_bins
  command -v ncu > /dev/null || { say "ncu: not found"; return; }
  local m cfg T mbs dir
  local -a run_args
  for m in gpt2 llama1b; do
    shape_of $m
    dir=$RES/ncu-$m
    mkdir -p "$dir"
    short_run_args "$(shard_for $m)" 1
    timeout "$(limit 150)" ncu --clock-control none -k "regex:${NCU_KERNELS:-flash_|attention_delta}" --launch-count "${NCU_COUNT:-4}" \
      --launch-skip "${NCU_SKIP:-$([ $m = gpt2 ] && echo 11 || echo 15)}" \
      --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
      --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section SchedulerStats \
      "$BIN/keel" train "${run_args[@]}" --out "$dir/run" > "$RES/ncu-$m.txt" 2>&1 ||
      say "ncu $m: exit $? (see ncu-$m.txt)"
    say "ncu $m:"
    grep -E '^  [a-z_]+.*\(|Duration|Compute \(SM\) Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Block Limit|Waves Per SM|Issued Ipc|No Eligible' "$RES/ncu-$m.txt" | tee -a "$SUMMARY"
  done
}

# The same profiles with every optional fusion off (cuBLASLt's GELU, residual and BGRADB
# epilogues; the attention backward's staged dS; the fused cross-entropy): what each one is
# worth, per op.
stage_unfused() {
  stage_profile -unfused KEEL_GELU_EPILOGUE=0 KEEL_RESIDUAL_EPILOGUE=0 KEEL_BGRAD_EPILOGUE=0 KEEL_ATTN_DS_MB=0 KEEL_XENT_FUSED=0
}

# The same profiles with the fused attention forward and dk-dv kernels on wgmma
# (KEEL_ATTN_WGMMA=1, off by default until measured): the attention rows against the profile
# stage's.
stage_wgmma() {
  stage_profile -wgmma KEEL_ATTN_WGMMA=1
}

# The same profiles with attention on cuDNN's SDPA graphs (KEEL_ATTENTION=cudnn): its attention
# rows and step time against the profile stage's keel kernels.
stage_cudnn() {
  stage_profile -cudnn KEEL_ATTENTION=cudnn
  grep -h 'KEEL_ATTENTION=cudnn' "$RES"/profile-*-cudnn/log.txt 2> /dev/null | sort -u | head -5 | tee -a "$SUMMARY"
}

# The same profiles with fp32-output matmuls (the weight gradients) held to the separate-pass
# split-K scheme of bf16 outputs (KEEL_SPLITK_ANY=0; the default lets cuBLASLt's heuristic pick
# any): the matmul rows against the profile stage's.
stage_splitk() {
  stage_profile -splitk KEEL_SPLITK_ANY=0
}

# Here, before a device call (no GPU needed): what the other stages need, each checked and named.
stage_dry_run() {
  local failed=0 spec m s cfg T mbs here stamp
  local -a run_args
  say "== dry-run: the carry and the stages' inputs, without a GPU"
  ok() {  # ok <what> <command...>: runs it, says ok or FAIL with its output's end
    local what=$1
    shift
    if "$@" > "$RES/dry-run.log" 2>&1; then say "ok   $what"; else
      say "FAIL $what"; tail -5 "$RES/dry-run.log" | sed 's/^/     /' | tee -a "$SUMMARY"; failed=1
    fi
  }
  not() { ! "$@"; }
  # (Catch2 v2's listings exit with the number of tests: the count is read from the names)
  selects() { [ "$("$BIN/test_gpu" "$1" --list-test-names-only | grep -c .)" -gt 0 ]; }
  ok "binaries: keel and test_gpu in $BIN" have_bins
  ok "keel --version" "$BIN/keel" --version
  ok "test_gpu lists its tests" selects '*'
  # the test stage runs [cudnn] with KEEL_REQUIRE_CUDNN=1: a keel without it fails there
  ok "keel built with cuDNN attention (scripts/fetch_cudnn_frontend.py before gpu_prebuild.sh)" \
    not grep -q "built without the cuDNN frontend headers" "$BIN/keel"
  for spec in "${TEST_SPECS[@]}" "$MEMCHECK_FILTER" "$RACECHECK_FILTER"; do
    ok "test_gpu '$spec' selects tests" selects "$spec"
  done
  for s in "${STAGES[@]}" bench; do ok "stage $s is defined" declare -F "stage_$s"; done
  for s in scripts/random_shard.py scripts/bench_gpu.sh scripts/bench_torch.py configs/llama-tiny.json test/fixtures; do
    ok "$s exists" test -e "$ROOT/$s"
  done
  memcheck_train_args /tmp/tokens.bin "$RES/dry-run-run"
  ok "memcheck's keel train arguments" "$BIN/keel" train "${run_args[@]}" --print-config
  for m in gpt2 llama1b; do
    shape_of $m
    short_run_args /tmp/tokens.bin 6
    ok "the profile's keel train arguments ($m)" "$BIN/keel" train "${run_args[@]}" --out "$RES/dry-run-run" --print-config
  done
  ok "the recompute stage's setting" "$BIN/keel" train "${run_args[@]}" --set train.recompute=full --print-config
  here=$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)
  stamp=$(head -1 "$CARRY/STAMP" 2>/dev/null)
  ok "binaries built from this commit ($here; STAMP: ${stamp:-none})" test "$stamp" = "commit $here"
  [ $failed -eq 0 ] && say "dry-run: all ok" || { say "dry-run: failures above"; return 1; }
}

setup_libs
for s in "${stages[@]}"; do
  if [ $((BUDGET - SECONDS)) -lt 30 ]; then say "$s: skipped, the ${BUDGET} s budget is spent"; continue; fi
  "stage_$s" || status=1
done
if [ -n "${OUT:-}" ]; then
  tar czf "$OUT/keel-gpu.tgz" -C "$RES" --exclude='*.bin' --exclude='run' . || say "packing $RES into \$OUT failed"
fi
echo
echo "==== summary ($RES/summary.txt)"
cat "$SUMMARY"
exit "${status:-0}"
