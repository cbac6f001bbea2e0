"""py-spy capture (``--probes full``): sample the engine process and its children.

``PySpy.start()`` launches ``py-spy record --pid PID --subprocesses --format raw``
(folded stacks, one line per distinct stack with its sample count) non-blocking, so
the engine is not paused per sample; ``stop()`` sends SIGINT, which makes py-spy
write its output, and converts the folded stacks to speedscope JSON next to it:

    traces/pyspy-<pid>.folded.txt        flamegraph.pl / speedscope input
    traces/pyspy-<pid>.speedscope.json   one "sampled" profile per process
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


class PySpy:
    """One py-spy recording of a process tree."""

    def __init__(self, out_dir: str | Path, pid: int | None = None, rate: int = 100, subprocesses: bool = True):
        self.out_dir = Path(out_dir)
        self.pid = pid or os.getpid()
        self.rate = rate
        self.subprocesses = subprocesses
        self.proc: subprocess.Popen | None = None
        self.folded = self.out_dir / f"pyspy-{self.pid}.folded.txt"
        self.speedscope = self.out_dir / f"pyspy-{self.pid}.speedscope.json"
        self.log = self.out_dir / f"pyspy-{self.pid}.log"

    def start(self, wait_s: float = 5.0) -> bool:
        """Launch py-spy; wait until it is sampling (up to ``wait_s``). False (with a warning) if it can't."""
        exe = find_pyspy()
        if exe is None:
            _warn("py-spy is not installed (pip install py-spy); the run has no py-spy profile")
            return False
        self.out_dir.mkdir(parents=True, exist_ok=True)
        cmd = [exe, "record", "--pid", str(self.pid), "--format", "raw", "-o", str(self.folded),
               "--rate", str(self.rate), "--nonblocking"]
        if self.subprocesses:
            cmd.append("--subprocesses")
        log = open(self.log, "wb")
        try:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        except OSError as e:
            _warn(f"py-spy could not start: {e}")
            return False
        finally:
            log.close()
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                _warn(f"py-spy exited at once (rc={self.proc.returncode}): {self._log_tail()}")
                self.proc = None
                return False
            if b"Sampling process" in self.log.read_bytes():
                return True
            time.sleep(0.02)
        return True  # still starting; samples will come

    def stop(self, timeout_s: float = 30.0) -> Path | None:
        """SIGINT py-spy, wait for its output, write speedscope JSON; return the speedscope path."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                _warn(f"py-spy did not stop within {timeout_s}s; killed (no profile)")
                return None
        if not self.folded.is_file():
            _warn(f"py-spy wrote no profile: {self._log_tail()}")
            return None
        lines = self.folded.read_text(errors="replace").splitlines()
        doc = folded_to_speedscope(lines, f"layerscope engine pid {self.pid}")
        tmp = self.speedscope.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, self.speedscope)
        return self.speedscope

    def _log_tail(self) -> str:
        try:
            return self.log.read_text(errors="replace").strip()[-500:]
        except OSError:
            return "(no log)"


def _warn(msg: str) -> None:
    logger.warning(msg)
    warnings.warn(msg, RuntimeWarning, stacklevel=3)
