#!/usr/bin/env bash
# The tests under sanitizers (not part of CI: about 45 minutes on 2 cores, build included):
#
#   scripts/sanitize.sh                     AddressSanitizer + UBSan, every test -> build-sanitize/
#   scripts/sanitize.sh thread              ThreadSanitizer, the tests of keel's own threads
#                                           (checkpoint writer, NCCL call watch, tokenizer) -> build-tsan/
#   scripts/sanitize.sh address -R tokenize further arguments go to ctest
#
# address: the build has the CPU backend, MPI (the multi-rank tests run sanitized ranks under
# mpirun) and, where the CUDA toolkit's headers are found, the CUDA backend on the CPU-side
# emulator (test_gpu_ops), so the CUDA backend's host code and kernels are checked too; nvcc's
# code is not (KEEL_CUDA is off). Leaks are not checked (Open MPI keeps its allocations to the
# end). The guarded backend's test, whose child process must die by keel's own SIGSEGV handler,
# runs on its own with ASan's SEGV handling off.
#
# thread: no MPI and no emulator (neither Open MPI nor the emulator's fibers are annotated for
# TSan), one OpenMP thread (libgomp is not instrumented: its workers would be false reports);
# the threads tested are keel's own.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
MODE=${1:-address}
[[ $# -gt 0 ]] && shift
JOBS=${JOBS:-$(nproc)}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1}

case "$MODE" in
  address)
    BUILD=${BUILD:-$ROOT/build-sanitize}
    flags=()
    ;;
  thread)
    BUILD=${BUILD:-$ROOT/build-tsan}
    flags=(-DKEEL_MPI=OFF -DKEEL_EMULATED_GPU_TESTS=OFF)
    ;;
  *)
    echo "sanitize.sh: '$MODE' is not address or thread" >&2
    exit 2
    ;;
esac

mkdir -p "$BUILD"
cmake -S "$ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKEEL_SANITIZE="$MODE" -DKEEL_CUDA=OFF "${flags[@]}" \
  > "$BUILD/configure.log" 2>&1 || { tail -30 "$BUILD/configure.log"; exit 1; }

status=0
if [[ $MODE == address ]]; then
  cmake --build "$BUILD" -j"$JOBS"
  export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0:check_initialization_order=1:strict_string_checks=1}
  guard='guarded backend: ops and copies work'
  ctest --test-dir "$BUILD" -j"$JOBS" --output-on-failure --timeout 3600 -E "$guard" "$@" || status=$?
  ASAN_OPTIONS="$ASAN_OPTIONS:handle_segv=0" ctest --test-dir "$BUILD" --output-on-failure -R "$guard" || status=$?
else
  cmake --build "$BUILD" -j"$JOBS" --target keel test_data test_train test_parallel
  export TSAN_OPTIONS=${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1}
  export OMP_NUM_THREADS=1
  # The tests that start threads: keel tokenize and the corpus readers, background checkpoint
  # saves (their crash and kill tests too), and the helper thread that watches blocking NCCL
  # calls (BlockingCallWatch: the watch that fires, and the one armed and disarmed in time).
  filter=${TSAN_TESTS:-tokeni|corpus|async|background|hang|timeout|kill -9|crash|watch}
  ctest --test-dir "$BUILD" -j"$JOBS" --output-on-failure --timeout 3600 -R "$filter" "$@" || status=$?
fi
exit $status
