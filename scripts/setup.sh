#!/usr/bin/env bash
# Installs what keel needs on Debian/Ubuntu. Safe to run again (only installs what is missing).
#   scripts/setup.sh          build and test dependencies (compiler, CMake, json, CLI11, Catch2, MPI,
#                             numpy for the attention-kernel emulation test) and, where nvcc is
#                             found, the cuDNN frontend headers (scripts/fetch_cudnn_frontend.py)
#   scripts/setup.sh --demo   also the demo corpus (Debian's fortunes) and a Python venv (.venv)
#                             with the HF `tokenizers` package for scripts/prepare_data.py
set -euo pipefail
cd "$(dirname "$0")/.."

demo=0
[[ "${1:-}" == "--demo" ]] && demo=1

packages=(build-essential cmake nlohmann-json3-dev libcli11-dev catch2 libopenmpi-dev openmpi-bin python3-numpy)
((demo)) && packages+=(fortunes python3 python3-venv)

missing=()
for p in "${packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})); then
  sudo=""
  [[ $(id -u) -ne 0 ]] && sudo="sudo"
  echo "setup: installing ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# With the CUDA toolkit: the cuDNN frontend headers for KEEL_ATTENTION=cudnn (third_party/, from
# PyPI). Without them keel builds without cuDNN attention, so a failure only warns.
if command -v nvcc >/dev/null 2>&1 || [[ -x /usr/local/cuda/bin/nvcc ]]; then
  python3 scripts/fetch_cudnn_frontend.py ||
    echo "setup: warning: no cuDNN frontend headers: keel builds without cuDNN attention (KEEL_ATTENTION=cudnn)"
fi

if ((demo)); then
  if [[ ! -x .venv/bin/python ]] || ! .venv/bin/python -c "import numpy, tokenizers, matplotlib" 2>/dev/null; then
    echo "setup: creating .venv with tokenizers and matplotlib"
    python3 -m venv .venv
    .venv/bin/pip install -q --disable-pip-version-check numpy tokenizers matplotlib
  fi
fi
echo "setup: ok"
