"""The torch and DeepSpeed releases megasparse is tested with, and a warning when others are installed.

megasparse reaches into DeepSpeed's ZeRO internals (``_hp_mapping``, ``round_robin_bit16_groups``, the
checkpoint engine, the layout of its optimizer files), which a minor release may move. ``setup.py``
installs these ranges (they are read from here), and CI tests both ends of DeepSpeed's: the release
that ``pip`` picks and the lower bound. An environment built by hand (``pip install --no-deps``,
another package's pin) can still hold another release: :func:`warn_if_untested` says so once.
"""
from __future__ import annotations

import sys
from functools import cache
from typing import IO

TESTED = {
    "torch": ">=2.13,<2.14",
    "deepspeed": ">=0.19.0,<0.20",
}


def lowest_tested(name: str) -> str:
    """The lower end of ``name``'s tested range (the release CI installs to test it)."""
    return next(spec.version for spec in _specifiers(name) if spec.operator == ">=")


def _specifiers(name: str):
    from packaging.specifiers import SpecifierSet

    return SpecifierSet(TESTED[name])


def untested(installed: dict[str, str] | None = None) -> list[str]:
    """``"deepspeed 0.20.1 (tested: >=0.19.0,<0.20)"`` for each package of :data:`TESTED` whose installed
    release (or the one given in ``installed``) is outside its tested range."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.version import Version

    found = []
    for name, spec in TESTED.items():
        try:
            release = (installed or {}).get(name) or version(name)
        except PackageNotFoundError:
            continue  # torch and deepspeed are requirements: their absence fails loudly elsewhere
        if not _specifiers(name).contains(Version(release), prereleases=True):
            found.append(f"{name} {release} (tested: {spec})")
    return found


@cache
def warn_if_untested(stream: IO[str] | None = None) -> None:
    """One warning line (once per process) naming every installed release outside its tested range."""
    outside = untested()
    if outside:
        print(f"megasparse: warning: installed {', '.join(outside)}; megasparse is tested only inside these ranges "
              "(it reaches into DeepSpeed's ZeRO internals)", file=stream or sys.stderr, flush=True)
