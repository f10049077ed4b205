#!/usr/bin/env bash
# Train on this machine with several processes: launchers/local.sh NPROC CONFIG [train options...]
#   launchers/local.sh 2 quickstart --set training.steps=100
# torchrun's standalone mode picks a free rendezvous port, so several jobs can share a host.
set -euo pipefail
if [ $# -lt 2 ] || ! [[ "$1" =~ ^[1-9][0-9]*$ ]]; then
    echo "usage: $0 NPROC CONFIG [megasparse train options...]" >&2
    exit 2
fi
nproc=$1
shift
exec torchrun --standalone --nproc_per_node "$nproc" -m megasparse train "$@"
