"""py-spy capture (``--probes full``): sample the engine process and its children.

``PySpy.start()`` launches ``py-spy record --pid PID --format raw`` (folded stacks,
one line per distinct stack with its sample count, non-blocking so the engine is not
paused per sample) for the process and each of its Python children (TP workers);
``stop()`` sends SIGINT, which makes py-spy write its output, and merges the folded
stacks into one speedscope JSON:

    traces/pyspy-<pid>.folded.txt        per process: flamegraph.pl / speedscope input
    traces/pyspy-<root>.speedscope.json  one "sampled" profile per process
    traces/pyspy-<pid>.log               py-spy's own messages

py-spy needs ptrace rights on the target (root, or CAP_SYS_PTRACE, or
kernel.yama.ptrace_scope=0). Absent or failing py-spy is a warning, never an error.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

logger = logging.getLogger(__name__)


def find_pyspy() -> str | None:
    """The py-spy executable: on PATH, else beside this Python (a venv's bin/)."""
    exe = shutil.which("py-spy")
    if exe:
        return exe
    cand = Path(sys.executable).parent / "py-spy"
    return str(cand) if cand.is_file() and os.access(cand, os.X_OK) else None


def folded_to_speedscope(lines: list[str], name: str) -> dict:
    """Convert folded stacks (``a;b;c COUNT``) to a speedscope document, one profile per process.

    py-spy with ``--subprocesses`` starts each stack with a ``process PID:"cmd"`` frame;
    that frame picks the profile and is dropped from the stack.
    """
    frames: list[dict] = []
    index: dict[str, int] = {}
    profiles: dict[str, tuple[list[list[int]], list[int]]] = {}
    for line in lines:
        line = line.rstrip("\n")
        if not line or " " not in line:
            continue
        stack, count = line.rsplit(" ", 1)
        try:
            n = int(count)
        except ValueError:
            continue
        parts = stack.split(";")
        proc = name
        if parts and parts[0].startswith("process "):
            proc, parts = parts[0], parts[1:]
        ids = []
        for p in parts:
            if p not in index:
                index[p] = len(frames)
                fn, _, loc = p.partition(" (")
                frame = {"name": fn}
                if loc:
                    file, _, ln = loc.rstrip(")").rpartition(":")
                    frame["file"] = file or loc.rstrip(")")
                    if ln.isdigit():
                        frame["line"] = int(ln)
                frames.append(frame)
            ids.append(index[p])
        samples, weights = profiles.setdefault(proc, ([], []))
        samples.append(ids)
        weights.append(n)
    return {
        "$schema": "https://www.speedscope.app/file-format-schema.json",
        "shared": {"frames": frames},
        "profiles": [
            {"type": "sampled", "name": proc, "unit": "none", "startValue": 0, "endValue": sum(w),
             "samples": s, "weights": w}
            for proc, (s, w) in profiles.items()
        ],
        "name": name,
        "activeProfileIndex": 0,
        "exporter": "layerscope.probes.pyspy",
    }


def python_children(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of the Python processes below ``pid`` (multiprocessing helpers excluded)."""
    try:
        import psutil

        out = []
        for child in psutil.Process(pid).children(recursive=True):
            try:
                cmd = " ".join(child.cmdline())
            except (psutil.Error, OSError):
                continue
            if "python" in cmd.lower() and "resource_tracker" not in cmd and "forkserver" not in cmd:
                out.append((child.pid, cmd))
        return out
    except (ImportError, Exception):  # psutil missing or the process gone: profile the root only
        return []


class PySpy:
    """py-spy recordings of a process and its Python children, one py-spy per process.

    py-spy's own ``--subprocesses`` did not pick up already-running multiprocessing
    children here (py-spy 0.4.3), so the children are found with psutil at ``start()``
    and each gets its own recorder; children started later are not sampled.
    """

    def __init__(self, out_dir: str | Path, pid: int | None = None, rate: int = 100, subprocesses: bool = True):
        self.out_dir = Path(out_dir)
        self.pid = pid or os.getpid()
        self.rate = rate
        self.subprocesses = subprocesses
        self._procs: list[tuple[int, str, subprocess.Popen]] = []
        self.speedscope = self.out_dir / f"pyspy-{self.pid}.speedscope.json"
        self.log = self.out_dir / f"pyspy-{self.pid}.log"

    def folded(self, pid: int) -> Path:
        return self.out_dir / f"pyspy-{pid}.folded.txt"

    def start(self, wait_s: float = 5.0) -> bool:
        """Launch py-spy on the process tree; wait until each is sampling (up to ``wait_s``).
        False, with a warning, when py-spy is absent or cannot attach to the root."""
        exe = find_pyspy()
        if exe is None:
            _warn("py-spy is not installed (pip install py-spy); the run has no py-spy profile")
            return False
        self.out_dir.mkdir(parents=True, exist_ok=True)
        targets = [(self.pid, " ".join(sys.argv) or "python")]
        if self.subprocesses:
            targets += python_children(self.pid)
        for pid, cmd in targets:
            args = [exe, "record", "--pid", str(pid), "--format", "raw", "-o", str(self.folded(pid)),
                    "--rate", str(self.rate), "--nonblocking"]
            log = open(self._log(pid), "wb")
            try:
                self._procs.append((pid, cmd, subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                                               stdin=subprocess.DEVNULL)))
            except OSError as e:
                _warn(f"py-spy could not start for pid {pid}: {e}")
            finally:
                log.close()
        deadline = time.monotonic() + wait_s
        pending = list(self._procs)
        while pending and time.monotonic() < deadline:
            for item in list(pending):
                pid, _, proc = item
                if proc.poll() is not None:
                    _warn(f"py-spy exited at once for pid {pid} (rc={proc.returncode}): {self._log_tail(pid)}")
                    self._procs.remove(item)
                    pending.remove(item)
                elif b"Sampling process" in self._log(pid).read_bytes():
                    pending.remove(item)
            time.sleep(0.02)
        return any(pid == self.pid for pid, _, _ in self._procs)

    def stop(self, timeout_s: float = 30.0) -> Path | None:
        """SIGINT every py-spy, wait for their output, write one speedscope JSON (a profile per
        process); return its path (None when nothing was recorded)."""
        procs, self._procs = self._procs, []
        for _, _, proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        lines: list[str] = []
        for pid, cmd, proc in procs:
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                _warn(f"py-spy for pid {pid} did not stop within {timeout_s}s; killed (no profile)")
                continue
            f = self.folded(pid)
            if not f.is_file():
                _warn(f"py-spy wrote no profile for pid {pid}: {self._log_tail(pid)}")
                continue
            head = f'process {pid}:"{cmd}"'
            for line in f.read_text(errors="replace").splitlines():
                lines.append(line if line.startswith("process ") else f"{head};{line}")
        if not lines:
            return None
        doc = folded_to_speedscope(lines, f"layerscope pid {self.pid}")
        tmp = self.speedscope.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, self.speedscope)
        return self.speedscope

    def _log(self, pid: int) -> Path:
        return self.out_dir / f"pyspy-{pid}.log"

    def _log_tail(self, pid: int) -> str:
        try:
            return self._log(pid).read_text(errors="replace").strip()[-500:]
        except OSError:
            return "(no log)"


def _warn(msg: str) -> None:
    logger.warning(msg)
    warnings.warn(msg, RuntimeWarning, stacklevel=3)
