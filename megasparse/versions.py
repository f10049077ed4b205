"""The torch and DeepSpeed releases megasparse is tested with, and a warning when others are installed.

megasparse reaches into DeepSpeed's ZeRO internals (``_hp_mapping``, ``round_robin_bit16_groups``, the
checkpoint engine, the layout of its optimizer files), which a minor release may move. ``setup.py``
installs these ranges (they are read from here), and CI tests both ends of DeepSpeed's: the release
that ``pip`` picks and the lower bound. An environment built by hand (``pip install --no-deps``,
another package's pin) can still hold another release: :func:`warn_if_untested` says so once.
"""
from __future__ import annotations

import os
import sys

TESTED = {
    "torch": ">=2.13.0a0,<2.14",  # a0: NVIDIA's container builds of 2.13 call themselves 2.13.0a0+<commit>
    "deepspeed": ">=0.19.0,<0.20",
}
CHECKED = "MEGASPARSE_VERSIONS_CHECKED"  # set for the processes a command starts: one warning per job


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

    from packaging.version import InvalidVersion, Version

    found = []
    for name, spec in TESTED.items():
        try:
            release = (installed or {}).get(name) or version(name)
            inside = _specifiers(name).contains(Version(release), prereleases=True)
        except PackageNotFoundError:
            continue  # torch and deepspeed are requirements: their absence fails loudly elsewhere
        except InvalidVersion:
            inside = False
        if not inside:
            found.append(f"{name} {release} (tested: {spec})")
    return found


def warn_if_untested() -> None:
    """One warning line on standard error naming every installed release outside its tested range: once per
    job, since the check marks the environment (``MEGASPARSE_VERSIONS_CHECKED``) that this process and the
    processes it starts share."""
    if os.environ.get(CHECKED):
        return
    os.environ[CHECKED] = "1"
    outside = untested()
    if outside:
        print(f"megasparse: warning: installed {', '.join(outside)}; megasparse is tested only inside these ranges "
              "(it reaches into DeepSpeed's ZeRO internals)", file=sys.stderr, flush=True)
