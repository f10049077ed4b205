#!/usr/bin/env bash
# Submit a training job to Slurm: N nodes x G ranks per node, one rank per srun task, with a
# SIGUSR1 warning before the time limit -> checkpoint, requeue, resume (see README, "Running on a cluster").
#   launchers/slurm.sh CONFIG NODES PROCS_PER_NODE [megasparse launch slurm options...]
#   launchers/slurm.sh spectron-llama-130m 4 8 --gpus-per-node 8 --cpus-per-task 8 \
#       --time 2-00:00:00 --partition gpu --account myproject --set data.path=data/mycorpus
# Add --dry-run to print the sbatch script instead of submitting it.
set -euo pipefail
if [ $# -lt 3 ]; then
    echo "usage: $0 CONFIG NODES PROCS_PER_NODE [megasparse launch slurm options...]" >&2
    exit 2
fi
config=$1 nodes=$2 procs=$3
shift 3
exec megasparse launch slurm "$config" --nodes "$nodes" --procs-per-node "$procs" "$@"
