#!/usr/bin/env bash
# One node, N ranks: keel under mpirun. tp*pp*dp in the config must equal N.
#   scripts/launch_mpirun.sh 8 configs/gpt2-124m.json [more keel train args]
# Each rank picks its GPU from its local rank (OMPI_COMM_WORLD_LOCAL_RANK); on CPU, give each
# rank a share of the cores with OMP_NUM_THREADS.
set -euo pipefail
np=${1:?usage: $0 NP CONFIG [keel train args...]}
config=${2:?usage: $0 NP CONFIG [keel train args...]}
shift 2
keel=${KEEL:-$(dirname "$0")/../build/keel}
threads=${OMP_NUM_THREADS:-$(( $(nproc) / np > 0 ? $(nproc) / np : 1 ))}
extra=()
[[ $(id -u) -eq 0 ]] && extra+=(--allow-run-as-root)
(( np > $(nproc) )) && extra+=(--oversubscribe)
# --bind-to none: keel's OpenMP threads may use more than one core per rank.
exec mpirun -np "$np" "${extra[@]}" --bind-to none -x OMP_NUM_THREADS="$threads" \
  -x KEEL_COMM_TIMEOUT="${KEEL_COMM_TIMEOUT:-600}" \
  "$keel" train --config "$config" "$@"
