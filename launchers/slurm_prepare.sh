#!/usr/bin/env bash
# Prepare a data mixture (data.sources) on a Slurm cluster: an array of one task per source, each tokenising its
# source on its own node (data.workers processes), then one job, started when all of them succeeded, that indexes
# them (it reads no token again, and prepares any source no task did). data.path must be on a shared filesystem.
#   launchers/slurm_prepare.sh CONFIG SOURCES [sbatch options...]
#   launchers/slurm_prepare.sh configs/my-mixture.yaml 3 --partition cpu --cpus-per-task 16 --time 12:00:00
# SOURCES is the number of entries in data.sources. Prints the two job ids; --dry-run prints the sbatch commands.
set -euo pipefail
if [ $# -lt 2 ] || ! [[ $2 =~ ^[1-9][0-9]*$ ]]; then
    echo "usage: $0 CONFIG SOURCES [sbatch options...] [--dry-run]  (SOURCES: the number of data.sources)" >&2
    exit 2
fi
raw_config=$1 config=$(printf %q "$1") sources=$2
shift 2
dry=0 options=()
for option in "$@"; do
    if [ "$option" = --dry-run ]; then dry=1; else options+=("$option"); fi
done
submit() {  # sbatch ARGS..., printing its job id (or, dry, the command and a placeholder id)
    if [ $dry = 1 ]; then printf '%q ' sbatch "$@" >&2; echo >&2; echo "JOB"; else sbatch --parsable "$@"; fi
}
if [ $dry = 0 ]; then
    megasparse config "$raw_config" > /dev/null  # a config megasparse refuses fails here, in one line, before any job
fi
parts=$(submit --job-name prepare-sources --array "0-$((sources - 1))" "${options[@]}" \
    --wrap "megasparse prepare-data $config --source \$SLURM_ARRAY_TASK_ID")
index=$(submit --job-name prepare-index --dependency "afterok:${parts%%;*}" --kill-on-invalid-dep=yes \
    "${options[@]}" --wrap "megasparse prepare-data $config")
echo "sources: job ${parts%%;*} (array of $sources), index: job ${index%%;*}"
