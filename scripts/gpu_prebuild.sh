#!/usr/bin/env bash
# Builds, on this machine (no GPU needed), what a lent GPU machine runs, so that its device time
# goes to tests and timings rather than to compiling:
#
#   scripts/gpu_prebuild.sh            -> build-gpu/carry/  (about 18 MB)
#
# build-gpu/carry/ holds
#   bin.tar.gz               bin/keel and bin/test_gpu: Release, sm_90a (H100/H200), no MPI,
#                            generic x86-64 host code (-DKEEL_NATIVE=OFF: the GPU machine's CPU
#                            may lack this one's instructions); stripped, and packed (46 MB ->
#                            14): a device call's working tree, carried paths included, must
#                            stay under 64 MiB. gpu_session.sh unpacks them.
#   deps/                    the header-only libraries keel's CMake needs (nlohmann-json, CLI11,
#                            Catch2) with their CMake package files, for a build on the GPU
#                            machine itself (its image has none of them and cannot fetch them):
#                            cmake -DCMAKE_PREFIX_PATH=$PWD/build-gpu/carry/deps ...
#   STAMP                    the commit (and whether the tree had local changes) the binaries
#                            were built from
#
# Then name build-gpu/carry in the device call's `carry` and run scripts/gpu_session.sh there.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${BUILD:-$ROOT/build-gpu}
CARRY=$BUILD/carry
JOBS=${JOBS:-$(nproc)}

mkdir -p "$BUILD"
cmake -S "$ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DKEEL_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a -DKEEL_EMULATED_GPU_TESTS=OFF \
  -DKEEL_MPI=OFF -DKEEL_NATIVE=OFF -DKEEL_TESTS=ON > "$BUILD/configure.log" 2>&1 ||
  { tail -30 "$BUILD/configure.log"; exit 1; }
# cuDNN attention (KEEL_ATTENTION=cudnn) needs the frontend headers here (scripts/setup.sh fetches
# them); the binaries open libcudnn.so.9 on the device (gpu_session.sh finds PyTorch's).
grep -q 'cuDNN attention ON' "$BUILD/configure.log" ||
  echo "gpu_prebuild.sh: warning: built without cuDNN attention: $(grep 'cuDNN attention' "$BUILD/configure.log")" >&2
cmake --build "$BUILD" -j"$JOBS" --target keel test_gpu

rm -rf "$CARRY"
mkdir -p "$CARRY/bin" "$CARRY/deps/include" "$CARRY/deps/share/cmake" "$CARRY/deps/lib/cmake"
cp "$BUILD/keel" "$BUILD/test/test_gpu" "$CARRY/bin/"
strip "$CARRY/bin/keel" "$CARRY/bin/test_gpu"
tar -C "$CARRY" -czf "$CARRY/bin.tar.gz" bin && rm -rf "$CARRY/bin"

# Header-only dependencies, laid out as under /usr so that their CMake files (which locate
# the headers relative to themselves) work from here.
copy_pkg() {  # copy_pkg <path under /usr> ...
  local p
  for p in "$@"; do
    [ -e "/usr/$p" ] || { echo "gpu_prebuild.sh: /usr/$p missing (run scripts/setup.sh)" >&2; exit 1; }
    mkdir -p "$CARRY/deps/$(dirname "$p")"
    cp -r "/usr/$p" "$CARRY/deps/$p"
  done
}
copy_pkg include/nlohmann share/cmake/nlohmann_json include/CLI share/cmake/CLI11 include/catch2 lib/cmake/Catch2
# Catch2's package file checks that its (unused) main library exists.
[ -e /usr/lib/libCatch2WithMain.a ] && cp /usr/lib/libCatch2WithMain.a "$CARRY/deps/lib/"

{
  echo "commit $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)$(git -C "$ROOT" diff --quiet HEAD 2>/dev/null || echo ' (+ local changes)')"
  echo "built $(date -u +%Y-%m-%dT%H:%MZ) on $(uname -n) with $(nvcc --version | tail -1)"
} > "$CARRY/STAMP"
cat "$CARRY/STAMP"
du -sh "$CARRY"
# What a device call carries (limit 64 MiB): the checkout's tracked files and its untracked ones
# that git does not ignore (a shared/ folder inside the checkout among them; the ../shared beside
# it stays behind), and the carried paths: this folder.
tree_bytes=$(git -C "$ROOT" ls-files -z --cached --others --exclude-standard |
  (cd "$ROOT" && xargs -0 du -cb 2>/dev/null) | awk '$2 == "total" { n += $1 } END { print n + 0 }')
carry_bytes=$(du -sb "$CARRY" | cut -f1)
total=$((tree_bytes + carry_bytes))
echo "a device call carries about $((total / 1048576)) MiB (the checkout's files and $CARRY; limit 64)"
[ "$total" -lt $((60 * 1048576)) ] || echo "gpu_prebuild.sh: warning: that is close to or over the device's 64 MiB" >&2
# A device call carries paths inside the checkout only (and only the checkout of the session
# that makes it): gpu_session.sh looks for build-gpu/carry.
[ "$CARRY" -ef "$ROOT/build-gpu/carry" ] ||
  echo "gpu_prebuild.sh: note: $CARRY is not build-gpu/carry of this checkout: a device call will not carry it from there" >&2
