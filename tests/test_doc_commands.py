"""Every command the README, docs/ and the launcher scripts show that can be checked without running it is
checked: ``megasparse launch ...`` with ``--dry-run`` (inside a faked Slurm allocation where the command runs
under ``salloc``), ``megasparse train CONFIG ...`` under any launcher as ``megasparse config CONFIG ...
--world-size N`` (the same config checks against the same process count), and the usage examples of
``launchers/*.sh`` with ``--dry-run``. A shipped command that megasparse itself refuses fails here."""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import TIMEOUT_S, megasparse

from megasparse.config import shipped_configs

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL_VALUES = {"$K": "1"}  # the node rank of the commands run once per node


@dataclass(frozen=True)
class Shown:
    where: str  # file:line
    words: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.where}: {shlex.join(self.words)}"


def logical_lines(lines: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Shell lines with backslash continuations joined and comments dropped, with their first line's number."""
    joined, start, parts = [], None, []
    for number, line in lines:
        text = line.split(" #")[0].rstrip() if not line.lstrip().startswith("#") else ""
        if start is None:
            start = number
        parts.append(text.removesuffix("\\").strip())
        if not text.endswith("\\"):
            if " ".join(parts).strip():
                joined.append((start, " ".join(p for p in parts if p)))
            start, parts = None, []
    return joined


def shell_blocks(path: Path) -> list[Shown]:
    """The commands of every ```bash block of a markdown file."""
    shown, block = [], None
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("```"):
            if block is None and line.strip() in ("```bash", "```sh", "```shell"):
                block = []
            elif block is not None:
                shown += [Shown(f"{path.name}:{n}", tuple(shlex.split(_expand(text)))) for n, text in logical_lines(block)]
                block = None
        elif block is not None:
            block.append((number, line))
    return shown


def script_examples(path: Path) -> list[Shown]:
    """A launcher script's usage examples: its comment lines that run it with concrete arguments."""
    lines = [(n, line.removeprefix("#").strip()) for n, line in enumerate(path.read_text().splitlines(), 1)
             if line.startswith("#   ")]
    examples = []
    for number, text in logical_lines(lines):
        words = shlex.split(_expand(text))
        if words and words[0] == f"launchers/{path.name}" and not any(re.fullmatch(r"\[?[A-Z_]{3,}.*", w) for w in words):
            examples.append(Shown(f"{path.name}:{number}", tuple(words)))
    return examples


def _expand(text: str) -> str:
    for variable, value in SHELL_VALUES.items():
        text = text.replace(variable, value)
    return text


def _world_size(words: tuple[str, ...]) -> int:
    for flag in ("--nproc_per_node", "--num_gpus", "-n", "-np"):
        if flag in words:
            return int(words[words.index(flag) + 1])
    return 1


FAKE_SCONTROL = """#!/bin/sh
# scontrol show hostnames A,B,...: one host a line (the allocation's node list is written without ranges)
[ "$1 $2" = "show hostnames" ] && echo "$3" | tr , '\\n'
"""


def _allocation(words: tuple[str, ...], tmp_path: Path) -> dict[str, str]:
    """The environment of the ``salloc -N NODES --ntasks-per-node G`` a command runs under, with an ``scontrol``
    that expands its node list."""
    nodes, per_node = int(words[words.index("-N") + 1]), words[words.index("--ntasks-per-node") + 1]
    scontrol = tmp_path / "bin" / "scontrol"
    scontrol.parent.mkdir()
    scontrol.write_text(FAKE_SCONTROL)
    scontrol.chmod(0o755)
    return {"SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_NTASKS_PER_NODE": per_node,
            "SLURM_JOB_NODELIST": ",".join(f"node{i}" for i in range(nodes)),
            "PATH": f"{scontrol.parent}:{os.environ['PATH']}"}


def _dry(words: tuple[str, ...]) -> tuple[str, ...]:
    return words if "--dry-run" in words else (*words, "--dry-run")


def _without_resume(options: tuple[str, ...]) -> list[str]:
    kept, skip = [], False
    for word in options:
        if not skip and word != "--resume":
            kept.append(word)
        skip = word == "--resume"
    return kept


def checks(shown: Shown) -> tuple[str, ...] | None:
    """What to run for a shown command (``None``: nothing that can be checked without running it)."""
    words = shown.words
    if "megasparse" not in words and not words[0].startswith("launchers/"):
        return None
    if words[0].startswith("launchers/"):
        return _dry(words)
    command = words[words.index("megasparse") + 1:]
    if command[:1] == ("launch",) and command[1:2] != ("hostfile",):  # (a checkpoint to resume is the user's)
        return _dry(tuple(_without_resume(command)) if "--resume" in command and "auto" not in command else command)
    if command[:1] == ("plan",) or command[:2] == ("study", "plan"):  # cheap: run as shown
        return command
    if command[:1] == ("train",) and command[1] in shipped_configs():
        return ("config", command[1], *_without_resume(command[2:]), "--world-size", str(_world_size(words)))
    return None


SHOWN = [s for document in DOCUMENTS for s in shell_blocks(document)] + \
        [s for script in sorted((REPO / "launchers").glob("*.sh")) for s in script_examples(script)]
CHECKED = [(shown, checks(shown)) for shown in SHOWN if checks(shown) is not None]


def test_the_documents_show_commands_of_every_kind():
    kinds = {" ".join(command[:2]) if command[0] == "launch" else command[0] for _, command in CHECKED}
    assert {"launch local", "launch slurm", "launch deepspeed", "launch mpi", "config", "plan"} <= kinds, kinds
    assert any(shown.words[0].startswith("launchers/") for shown, _ in CHECKED)


def _datasets(words: tuple[str, ...], dataset: Path, tmp_path: Path) -> None:
    """The prepared datasets a command names (``data.path=PATH``), made from the tests' small one, where the
    command runs: the cluster commands name the user's corpus, as a run on a cluster must."""
    for word in words:
        if word.startswith("data.path="):
            shutil.copytree(dataset, tmp_path / word.removeprefix("data.path="))


@pytest.mark.parametrize("shown,command", CHECKED, ids=[str(s.where) for s, _ in CHECKED])
def test_a_shown_command_is_accepted(shown, command, tmp_path, dataset):
    _datasets(shown.words, dataset, tmp_path)
    env = {"SLURM_JOB_ID": None, "SLURM_JOB_NUM_NODES": None, "SLURM_NTASKS_PER_NODE": None,
           "SLURM_JOB_NODELIST": None, **(_allocation(shown.words, tmp_path) if shown.words[0] == "salloc" else {})}
    if command[0].startswith("launchers/"):
        environment = {k: v for k, v in {**os.environ, **env}.items() if v is not None}
        proc = subprocess.run(["bash", str(REPO / command[0]), *command[1:]], capture_output=True, text=True,
                              cwd=tmp_path, env=environment, timeout=TIMEOUT_S)
        assert proc.returncode == 0, f"{shown}\n{proc.stderr}"
        return
    result = megasparse(*command, launcher="none", cwd=tmp_path, env=env)
    assert result.returncode == 0, f"{shown}\n{result.stderr}"
