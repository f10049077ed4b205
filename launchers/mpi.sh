#!/usr/bin/env bash
# mpiexec / mpirun: ranks from the MPI environment (Open MPI or MPICH), rendezvous on loopback for
# one host and rank 0's address (over mpi4py) across hosts.
#   launchers/mpi.sh NPROC CONFIG [--hosts node0:8,node1:8] [--mpiexec /path/to/mpirun]
set -euo pipefail
if [ $# -lt 2 ] || ! [[ "$1" =~ ^[1-9][0-9]*$ ]]; then
    echo "usage: $0 NPROC CONFIG [megasparse launch mpi options...]" >&2
    exit 2
fi
nproc=$1 config=$2
shift 2
exec megasparse launch mpi "$config" -n "$nproc" "$@"
