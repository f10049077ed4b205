#!/usr/bin/env bash
# The DeepSpeed launcher across the nodes of a Slurm allocation (or pass --hosts / --hostfile):
# writes OUTPUT_DIR/hostfile ("HOST slots=G") and starts `deepspeed --hostfile ... --module megasparse train`.
#   salloc -N 2 --ntasks-per-node 8 launchers/deepspeed.sh CONFIG 8 [--launcher slurm|pdsh|openmpi|mpich]
# Without ssh between nodes, run on every node with its rank:
#   megasparse launch deepspeed CONFIG --hosts node0:8,node1:8 --node-rank K
set -euo pipefail
if [ $# -lt 2 ]; then
    echo "usage: $0 CONFIG PROCS_PER_NODE [megasparse launch deepspeed options...]" >&2
    exit 2
fi
config=$1 procs=$2
shift 2
exec megasparse launch deepspeed "$config" --procs-per-node "$procs" "$@"
