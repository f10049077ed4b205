"""``megasparse launch {local,slurm,deepspeed,mpi,hostfile}``: checks first, then one command line."""
from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from megasparse.errors import UserError
from megasparse.launch import commands as cmd
from megasparse.launch.slurm import SlurmJob, submit_job


def add_launch_commands(subcommands) -> None:
    launch = subcommands.add_parser("launch", help="start training with torchrun, Slurm, the DeepSpeed launcher or MPI")
    kinds = launch.add_subparsers(dest="launcher", required=True)

    local = _run_parser(kinds, "local", "this machine (or one node of several) with torchrun")
    local.add_argument("--nproc", type=int, required=True, help="processes on this node")
    local.add_argument("--nnodes", type=int, default=1)
    local.add_argument("--node-rank", type=int, default=0)
    local.add_argument("--master-addr", default="127.0.0.1", help="node 0's address (several nodes)")
    local.add_argument("--master-port", type=int, help="rendezvous port (required with --nnodes > 1)")
    local.set_defaults(run=_local)

    slurm = _run_parser(kinds, "slurm", "render an sbatch script for N nodes x G processes and submit it")
    slurm.add_argument("--nodes", type=int, required=True)
    slurm.add_argument("--procs-per-node", type=int, required=True, help="ranks per node (GPUs per node)")
    slurm.add_argument("--cpus-per-task", type=int, default=1, help="CPU cores per rank (OMP_NUM_THREADS)")
    slurm.add_argument("--gpus-per-node", type=int)
    slurm.add_argument("--time", help="time limit, e.g. 2-00:00:00")
    slurm.add_argument("--partition")
    slurm.add_argument("--account")
    slurm.add_argument("--job-name", default="megasparse")
    slurm.add_argument("--signal-seconds", type=int, default=300,
                       help="SIGUSR1 this long before the time limit: checkpoint, exit, requeue")
    slurm.add_argument("--sbatch-option", action="append", default=[], metavar="OPTION",
                       help="another #SBATCH option, e.g. --qos=high (repeatable)")
    slurm.set_defaults(run=_slurm)

    ds = _run_parser(kinds, "deepspeed", "the DeepSpeed launcher: one node (--num-gpus) or a hostfile")
    hosts = ds.add_mutually_exclusive_group()
    hosts.add_argument("--num-gpus", type=int, help="processes on this node only")
    hosts.add_argument("--hostfile", type=Path, help="DeepSpeed hostfile ('HOST slots=N' lines)")
    hosts.add_argument("--hosts", help="HOST:SLOTS,... (written to OUTPUT_DIR/hostfile)")
    ds.add_argument("--procs-per-node", type=int,
                    help="with neither --hosts nor --hostfile: every node of the Slurm allocation, this many slots")
    ds.add_argument("--launcher", default="pdsh", choices=cmd.DEEPSPEED_LAUNCHERS, help="how DeepSpeed reaches nodes")
    ds.add_argument("--master-addr", help="node 0's address (default: the first host)")
    ds.add_argument("--master-port", type=int, default=29500)
    ds.add_argument("--node-rank", type=int, help="no ssh: start only this node's ranks (run once per node)")
    ds.set_defaults(run=_deepspeed)

    mpi = _run_parser(kinds, "mpi", "mpiexec / mpirun")
    mpi.add_argument("-n", "--nproc", type=int, required=True, help="processes in all")
    mpi.add_argument("--hosts", help="HOST:SLOTS,... (default: this host)")
    mpi.add_argument("--mpiexec", help="the mpiexec to use (default: the one on PATH)")
    mpi.set_defaults(run=_mpi)

    hostfile = kinds.add_parser("hostfile", help="write a DeepSpeed hostfile from --hosts or the Slurm allocation")
    hostfile.add_argument("--hosts", help="HOST:SLOTS,...")
    hostfile.add_argument("--procs-per-node", type=int, help="slots per node of the Slurm allocation")
    hostfile.add_argument("-o", "--out", type=Path, help="write here (default: print)")
    hostfile.set_defaults(run=_hostfile)


def _run_parser(kinds, name: str, help_text: str) -> argparse.ArgumentParser:
    parser = kinds.add_parser(name, help=help_text)
    parser.add_argument("config", metavar="CONFIG", help="a YAML file or the name of a shipped config")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--resume", metavar="auto|PATH", help="passed to megasparse train")
    parser.add_argument("--dry-run", action="store_true", help="print what would run, start nothing")
    parser.add_argument("--allow-embedded-corpus", action="store_true",
                        help="on a cluster (Slurm, several nodes), train on the embedded corpus anyway")
    if name != "slurm":
        parser.add_argument("--allow-unsafe-stop", action="store_true",
                            help="inside a Slurm job, start the ranks through this launcher anyway (a preemption "
                                 "may kill them before their checkpoint is written)")
    return parser


def _start(command: list[str], dry_run: bool) -> None:
    print(shlex.join(command), flush=True)
    if not dry_run:
        os.execv(command[0], command)


def _train(args: argparse.Namespace) -> list[str]:
    return cmd.train_arguments(args.config, args.overrides, args.resume)


def _local(args: argparse.Namespace) -> None:
    if args.nnodes > 1 and args.master_port is None:
        raise UserError("--nnodes > 1 needs --master-port (and --master-addr of node 0), the same on every node")
    if not 0 <= args.node_rank < args.nnodes:
        raise UserError(f"--node-rank {args.node_rank} is outside 0..{args.nnodes - 1}")
    cmd.check_allocation(args.nnodes, args.nproc)
    if not args.allow_unsafe_stop:
        cmd.check_preemption_safe("torchrun", "use `megasparse launch slurm` (srun starts each rank)")
    cmd.checked_config(args.config, args.overrides, args.nproc * args.nnodes, args.resume, args.nnodes > 1,
                       args.allow_embedded_corpus)
    _start(cmd.torchrun_command(_train(args), args.nproc, args.nnodes, args.node_rank, args.master_addr,
                                args.master_port), args.dry_run)


def _slurm(args: argparse.Namespace) -> None:
    from megasparse.checkpoint.files import complete_checkpoints

    cfg = cmd.checked_config(args.config, args.overrides, args.nodes * args.procs_per_node, args.resume, True,
                             args.allow_embedded_corpus)
    output_dir = Path(cfg.training.output_dir).resolve()
    overrides = [o for o in args.overrides if not o.startswith("training.output_dir=")]
    if complete_checkpoints(cfg.checkpoint_dir) and args.resume != "auto":
        raise UserError(f"{cfg.checkpoint_dir} already holds checkpoints; pass --resume auto to continue them "
                        "in this job, or choose another training.output_dir")
    train = [sys.executable, "-m", "megasparse",
             *cmd.train_arguments(args.config, [*overrides, f"training.output_dir={output_dir}"], "auto")]
    job = SlurmJob(train, output_dir, args.nodes, args.procs_per_node, args.job_name, args.cpus_per_task, args.time,
                   args.partition, args.account, args.gpus_per_node, args.signal_seconds, tuple(args.sbatch_option))
    submitted = submit_job(job, args.dry_run)
    if submitted:
        print(f"submitted job {submitted[0]} ({submitted[1]}); logs in {job.log_dir}")


def _deepspeed(args: argparse.Namespace) -> None:
    if args.num_gpus is not None:
        hosts, hostfile = [("localhost", args.num_gpus)], None
    elif args.hostfile:
        hosts, hostfile = cmd.read_hostfile(args.hostfile), args.hostfile
    else:
        hosts = cmd.parse_hosts(args.hosts) if args.hosts else cmd.allocation_hosts(args.procs_per_node)
        hostfile = None  # written below, once the run is checked
    if args.node_rank is not None and not 0 <= args.node_rank < len(hosts):
        raise UserError(f"--node-rank {args.node_rank} is outside the {len(hosts)} host(s)")
    cmd.check_allocation(len(hosts), max(slots for _, slots in hosts))
    if args.launcher != "slurm" and not args.allow_unsafe_stop:
        cmd.check_preemption_safe("DeepSpeed's launcher", "use --launcher slurm or `megasparse launch slurm` (srun "
                                  "starts each rank)")
    cfg = cmd.checked_config(args.config, args.overrides, sum(slots for _, slots in hosts), args.resume,
                             len(hosts) > 1, args.allow_embedded_corpus)
    if args.num_gpus is None and hostfile is None:
        hostfile = Path(cfg.training.output_dir).resolve() / "hostfile"
        print(f"# {hostfile}\n{cmd.hostfile_text(hosts)}", end="")
        if not args.dry_run:
            hostfile.parent.mkdir(parents=True, exist_ok=True)
            hostfile.write_text(cmd.hostfile_text(hosts))
    master_addr = args.master_addr or (hosts[0][0] if args.num_gpus is None else None)
    _start(cmd.deepspeed_command(_train(args), hostfile, args.num_gpus, args.launcher, master_addr, args.master_port,
                                 args.node_rank), args.dry_run)


def _mpi(args: argparse.Namespace) -> None:
    hosts = cmd.parse_hosts(args.hosts) if args.hosts else None
    if hosts and sum(slots for _, slots in hosts) != args.nproc:
        raise UserError(f"--hosts has {sum(slots for _, slots in hosts)} slots for -n {args.nproc} processes")
    if hosts:
        cmd.check_allocation(len(hosts), max(slots for _, slots in hosts))
    else:
        cmd.check_allocation(1, args.nproc)
    if not args.allow_unsafe_stop:
        cmd.check_preemption_safe("mpiexec", "use `megasparse launch slurm` (srun starts each rank)")
    cmd.checked_config(args.config, args.overrides, args.nproc, args.resume, bool(hosts) and len(hosts) > 1,
                       args.allow_embedded_corpus)
    _start(cmd.mpi_command(_train(args), args.nproc, hosts, args.mpiexec), args.dry_run)


def _hostfile(args: argparse.Namespace) -> None:
    text = cmd.hostfile_text(cmd.parse_hosts(args.hosts) if args.hosts else cmd.allocation_hosts(args.procs_per_node))
    if args.out:
        args.out.write_text(text)
    else:
        print(text, end="")
