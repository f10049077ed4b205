"""``megasparse study``: ``plan`` a scaling study (every run counted, nothing trained)."""
from __future__ import annotations

import argparse


def add_study_commands(commands: argparse._SubParsersAction) -> None:
    study = commands.add_parser("study", help="scaling studies: which method, size and token count for a budget")
    actions = study.add_subparsers(dest="action", required=True)
    planned = actions.add_parser("plan", help="every run of a study (shape, parameters, tokens, FLOPs executed and "
                                              "theoretical, bytes per device) and the study's time; trains nothing")
    planned.add_argument("study", metavar="STUDY", help="a study YAML file or the name of a shipped study "
                                                        "(configs/studies/NAME.yaml)")
    planned.set_defaults(run=_plan)


def _plan(args: argparse.Namespace) -> None:
    from megasparse.study.plan import plan_table, study_runs
    from megasparse.study.spec import load_study

    study = load_study(args.study)
    print(plan_table(study, study_runs(study)))
