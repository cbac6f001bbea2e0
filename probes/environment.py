"""Environment snapshot for the manifest: software versions and hardware.

Versions come from package metadata (importing triton or transformers just to read
a version would cost seconds); the git revision from the source checkout, if any.
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def git_revision(path: str | Path | None = None) -> tuple[str | None, bool | None]:
    """(HEAD commit, whether the work tree has uncommitted changes) of the checkout at ``path``."""
    root = Path(path) if path else Path(__file__).resolve().parent.parent
    try:
        rev = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=5)
        if rev.returncode:
            return None, None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5)
        return rev.stdout.strip(), bool(dirty.stdout.strip()) if dirty.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):
        return None, None


def git_diff_sha(path: str | Path | None = None) -> str | None:
    """SHA-256 of the checkout's uncommitted change to tracked files (``git diff HEAD``), None when
    it cannot be read: two dirty runs of one commit ran the same code only if these match."""
    root = Path(path) if path else Path(__file__).resolve().parent.parent
    try:
        d = subprocess.run(["git", "-C", str(root), "diff", "HEAD", "--no-ext-diff", "--binary"],
                           capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return hashlib.sha256(d.stdout).hexdigest() if d.returncode == 0 else None


def versions() -> dict[str, Any]:
    """layerscope + git rev (dirty: the uncommitted change's hash), python, torch, triton,
    transformers (None when absent)."""
    from layerscope import __version__

    rev, dirty = git_revision()
    return {
        "layerscope": __version__,
        "git_rev": rev,
        "git_dirty": dirty,
        "git_diff_sha": git_diff_sha() if dirty else None,
        "python": platform.python_version(),
        "torch": _version("torch"),
        "triton": _version("triton"),
        "transformers": _version("transformers"),
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpu() -> dict[str, Any] | None:
    torch = sys.modules.get("torch")  # only ask if the engine already loaded torch
    if torch is None or not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return {"name": props.name, "count": torch.cuda.device_count(), "memory_bytes": int(props.total_memory),
            "cuda": torch.version.cuda}


def hardware() -> dict[str, Any]:
    """cpu model, cores, memory, gpu (None without CUDA), platform."""
    try:
        import psutil

        physical = psutil.cpu_count(logical=False)
        memory = int(psutil.virtual_memory().total)
    except ImportError:  # psutil is a dependency; keep the manifest writable without it
        physical = None
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "physical_cores": physical,
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_bytes": memory,
        "gpu": _gpu(),
        "platform": platform.platform(),
    }
