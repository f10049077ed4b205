"""``megasparse study``: ``plan`` a scaling study (every run counted, nothing trained), ``run`` it here (resumable),
submit it to Slurm as a job array (``slurm``), and ``fit`` its records."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_study_commands(commands: argparse._SubParsersAction) -> None:
    study = commands.add_parser("study", help="scaling studies: which method, size and token count for a budget")
    actions = study.add_subparsers(dest="action", required=True)
    planned = actions.add_parser("plan", help="every run of a study (shape, parameters, tokens, FLOPs executed and "
                                              "theoretical, bytes per device) and the study's time; trains nothing")
    _study_argument(planned)
    planned.set_defaults(run=_plan)

    run = actions.add_parser("run", help="train a study's runs here, one after another; a recorded budget is "
                                         "skipped and a killed one resumed")
    _study_argument(run)
    _out_argument(run)
    run.add_argument("--task", type=int, metavar="I", help="only task I (a (method, size, seed) in the plan's "
                                                           "order, from 0; a Slurm array's index)")
    run.add_argument("--dry-run", action="store_true", help="list the tasks and what each has left; train nothing")
    run.add_argument("--prepare-only", action="store_true", help="prepare the study's corpus (once), train nothing: "
                                                                 "before a Slurm array, on a node with the CPUs")
    run.set_defaults(run=_run)

    slurm = actions.add_parser("slurm", help="submit a study as a Slurm job array: a task per (method, size, seed), "
                                             "at most K at a time, requeued when stopped")
    _study_argument(slurm)
    _out_argument(slurm)
    slurm.add_argument("--concurrency", type=int, default=4, metavar="K", help="array tasks at a time (%%K)")
    slurm.add_argument("--procs-per-node", type=int, help="ranks per node (default: the study's devices, one node)")
    slurm.add_argument("--cpus-per-task", type=int, default=1, help="CPU cores per rank (OMP_NUM_THREADS)")
    slurm.add_argument("--gpus-per-node", type=int)
    slurm.add_argument("--time", help="each task's time limit, e.g. 1-00:00:00 (a stopped task is requeued)")
    slurm.add_argument("--partition")
    slurm.add_argument("--account")
    slurm.add_argument("--signal-seconds", type=int, default=300,
                       help="SIGUSR1 this long before the time limit: checkpoint, exit, requeue")
    slurm.add_argument("--sbatch-option", action="append", default=[], metavar="OPTION",
                       help="another #SBATCH option, e.g. --qos=high (repeatable)")
    slurm.add_argument("--dry-run", action="store_true", help="print the array's script, submit nothing")
    slurm.set_defaults(run=_slurm)

    fit = actions.add_parser("fit", help="fit scaling laws to a study's records: per method, jointly with a "
                                         "multiplier per method, bootstrap intervals, a hold-out, frontiers; "
                                         "JSON, markdown and figures")
    _study_argument(fit)
    _out_argument(fit)
    fit.add_argument("--report", type=Path, metavar="DIR", help="where the report goes (default: OUT/report)")
    fit.add_argument("--resamples", type=int, default=4000, help="bootstrap draws (default 4,000, as Besiroglu "
                                                                 "et al.)")
    fit.add_argument("--seed", type=int, default=0, help="the bootstrap's random seed")
    fit.add_argument("--starts", type=int, default=64, help="L-BFGS-B runs per fit, from the grid's starts with "
                                                            "the lowest objective (default 64 of 5,400)")
    fit.set_defaults(run=_fit)


def _study_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("study", metavar="STUDY", help="a study YAML file or the name of a shipped study "
                                                       "(configs/studies/NAME.yaml)")


def _out_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, metavar="DIR",
                        help="the study's directory: its corpus, runs and records (default: studies/STUDY)")


def _plan(args: argparse.Namespace) -> None:
    from megasparse.study.plan import plan_table, study_runs
    from megasparse.study.spec import load_study

    study = load_study(args.study)
    print(plan_table(study, study_runs(study)))


def _tasks(args: argparse.Namespace):
    from megasparse.errors import UserError
    from megasparse.study.plan import study_runs
    from megasparse.study.run import check_records, study_tasks
    from megasparse.study.spec import load_study

    study = load_study(args.study)
    out = args.out or Path("studies") / study.name
    tasks = study_tasks(study, study_runs(study), out)
    if any(t.budgets[0].config.training.eval_samples == 0 for t in tasks):
        raise UserError(f"{study.path}: training.eval_samples is 0: a study's budgets are measured by their "
                        "final validation loss")
    if getattr(args, "task", None) is not None:
        if not 0 <= args.task < len(tasks):
            raise UserError(f"--task {args.task}: the study has tasks 0 to {len(tasks) - 1}")
        tasks = [tasks[args.task]]
    check_records(tasks)
    return study, out, tasks


def _run(args: argparse.Namespace) -> None:
    from megasparse.study.run import prepare_corpus, run_study

    study, out, tasks = _tasks(args)
    if args.dry_run:
        for task in tasks:
            left = [b.directory.name for b in task.budgets if not b.record.is_file()]
            print(f"{task.run.name}: {len(task.budgets) - len(left)} of {len(task.budgets)} budgets recorded"
                  + (f"; to train: {'trunk, ' if task.trunk and left else ''}{', '.join(left)}" if left else ""))
        return
    if args.prepare_only:
        data = tasks[0].budgets[0].config
        print(f"the study's corpus: {data.data.path} (index sha256 {prepare_corpus(data, data.data.path)})")
        return
    sys.exit(run_study(study, tasks, study.devices))


def _slurm(args: argparse.Namespace) -> None:
    from megasparse.errors import UserError
    from megasparse.launch.slurm import SlurmJob, submit_job

    study, out, tasks = _tasks(args)
    procs = args.procs_per_node or study.devices
    if procs <= 0 or study.devices % procs:
        raise UserError(f"--procs-per-node {procs}: the study's {study.devices} devices must be whole nodes of it")
    if args.concurrency <= 0:
        raise UserError(f"--concurrency {args.concurrency}: at least one task at a time")
    out = out.resolve()
    corpus = Path(tasks[0].budgets[0].config.data.path)
    if not (corpus / "index.json").is_file():
        unprepared = (f"{corpus}: the study's corpus is not prepared; prepare it once before the array: "
                      f"megasparse study run {args.study} --out {out} --prepare-only")
        if not args.dry_run:
            raise UserError(unprepared)
        print(f"megasparse: warning: {unprepared}", file=sys.stderr)
    # the array's tasks read a copy, its corpus path absolute: indices and runs stay those submitted, whatever
    # becomes of the study's file while the tasks wait or are requeued
    copy = out / study.path.name
    text = _submitted_study(study, corpus)
    if copy.is_file() and copy.read_text() != text:
        raise UserError(f"{copy}: another version of the study was submitted to this directory; use another --out")
    command = [sys.executable, "-m", "megasparse", "study", "run", str(copy), "--out", str(out)]
    job = SlurmJob(command, out, study.devices // procs, procs, f"study-{study.name}", args.cpus_per_task,
                   args.time, args.partition, args.account, args.gpus_per_node, args.signal_seconds,
                   tuple(args.sbatch_option), array=f"0-{len(tasks) - 1}%{args.concurrency}",
                   template="study.sbatch")
    if not args.dry_run:
        out.mkdir(parents=True, exist_ok=True)
        copy.write_text(text)
    submitted = submit_job(job, args.dry_run)
    if submitted:
        print(f"submitted job array {submitted[0]} ({len(tasks)} tasks, at most {args.concurrency} at a time; "
              f"{submitted[1]}); logs in {job.log_dir}")


def _submitted_study(study, corpus: Path) -> str:
    """The study's YAML as an array reads it: its corpus named by absolute path."""
    import yaml

    data = yaml.safe_load(study.path.read_text(encoding="utf-8"))
    data.setdefault("config", {}).setdefault("data", {})["path"] = str(corpus)
    return yaml.safe_dump(data, sort_keys=False)


def _fit(args: argparse.Namespace) -> None:
    from megasparse.errors import UserError
    from megasparse.study.analysis import analyse
    from megasparse.study.report import write_report
    from megasparse.study.run import read_records
    from megasparse.study.spec import load_study

    study = load_study(args.study)
    out = args.out or Path("studies") / study.name
    found = read_records(out)
    records = [r for r in found if r["method"] in study.methods and r["size"] in study.sizes]
    if not records:
        raise UserError(f"{out}: no records of this study's methods and sizes (OUT/records/*.json): run the study "
                        "first (megasparse study run)")
    corpora = {r["data_index_sha256"] for r in records}
    if len(corpora) > 1:
        raise UserError(f"{out}: the records were trained on {len(corpora)} different corpora (data_index_sha256); "
                        "a fit needs one")
    if len(records) < len(found):
        print(f"left out {len(found) - len(records)} record(s) of methods or sizes the study no longer has")
    if args.resamples < 100:
        raise UserError(f"--resamples {args.resamples}: at least 100 draws for 95 % intervals")
    if args.starts < 1:
        raise UserError(f"--starts {args.starts}: at least one start")
    report = args.report or out / "report"
    result = analyse(records, study.reference, args.resamples, args.seed, study.hypotheses, args.starts)
    write_report(result, records, report, f"study {study.name}")
    print(f"fitted {len(records)} runs of {len(result['methods'])} method(s); report in {report} (fit.json, "
          "report.md, loss_vs_compute.png, isoflop.png, allocation.png, loss_vs_memory.png)")
