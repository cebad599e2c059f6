"""Results as data: every living benchmark writes one JSON record per run under ``benchmarks/results/``.

A record is ``{"benchmark", "date", "commit", "machine", "settings", ...figures}``: what ran, when,
at which commit (``+`` when the tracked files differed from it), on what machine and with which
settings, beside the numbers themselves. ``benchmarks/tables.py`` builds the tables the README and
``docs/results.md`` show from these files, so a number a user reads names the run that measured it.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
import subprocess
from pathlib import Path

#: Where the records live (one file per run, ``<benchmark>-<UTC date and time>.json``).
RESULTS = Path(__file__).parent / "results"


def cpu_name() -> str:
    """The processor's model name, as /proc/cpuinfo gives it."""
    try:
        with open("/proc/cpuinfo") as info:
            line = next(line for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown processor"
    return line.split(":", 1)[1].strip()


def commit() -> str:
    """The checkout's commit, ``+`` when its tracked files differ from it."""
    root = Path(__file__).parent.parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+" if dirty else "")


def cpu_flags() -> str:
    """A short digest of the processor's feature flags (/proc/cpuinfo): two machines whose
    processors have one name may still differ in the instructions their kernels use."""
    try:
        with open("/proc/cpuinfo") as info:
            line = next(line for line in info if line.startswith("flags"))
    except (OSError, StopIteration):
        return "unknown"
    return hashlib.sha256(" ".join(sorted(line.split(":", 1)[1].split())).encode()).hexdigest()[:12]


def machine() -> dict:
    """The processor, core count, load, platform and library versions a run measured on."""
    import torch
    import transformers

    info = {
        "cpu": cpu_name(),
        "cpu_flags": cpu_flags(),
        "cores": len(os.sched_getaffinity(0)),
        "load_average": os.getloadavg(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def started() -> datetime.datetime:
    """Now, in UTC: a run's date (take it when the run starts)."""
    return datetime.datetime.now(datetime.timezone.utc)


def new_record(benchmark: str, settings: dict, *, date: datetime.datetime | None = None) -> dict:
    """The provenance part of a record; the caller adds its figures under keys of its own."""
    date = date or started()
    return {
        "benchmark": benchmark,
        "date": date.isoformat(timespec="seconds"),
        "commit": commit(),
        "machine": machine(),
        "settings": settings,
    }


def settings_of(args) -> dict:
    """A parsed command line as a record's settings: every flag's value, paths as strings."""
    return {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}


def write(record: dict, path: str | Path | None = None) -> Path:
    """Write ``record`` to ``path`` (default: ``RESULTS/<benchmark>-<date>.json``) and return the path."""
    if path is None:
        date = datetime.datetime.fromisoformat(record["date"])
        path = RESULTS / f"{record['benchmark']}-{date:%Y%m%d-%H%M%S}.json"
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path
