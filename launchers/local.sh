#!/usr/bin/env bash
# Train on this machine with several processes (torchrun, standalone rendezvous on a free port):
#   launchers/local.sh NPROC CONFIG [--set SECTION.KEY=VALUE ...] [--resume auto]
#   launchers/local.sh 2 quickstart --set training.steps=100
# Several nodes without a scheduler: megasparse launch local CONFIG --nproc G --nnodes N
#   --node-rank K --master-addr NODE0 --master-port PORT, once on each node.
set -euo pipefail
if [ $# -lt 2 ] || ! [[ "$1" =~ ^[1-9][0-9]*$ ]]; then
    echo "usage: $0 NPROC CONFIG [megasparse train options...]" >&2
    exit 2
fi
nproc=$1 config=$2
shift 2
exec megasparse launch local "$config" --nproc "$nproc" "$@"
