"""Live servers for tests and benchmarks: start one in its own process group, wait for its health
endpoint, stop the whole group."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx


def free_port() -> int:
    """A free loopback port (free when asked: a server binds it soon after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@functools.cache
def empty_cwd() -> str:
    """An empty directory to start other projects' Python in: its working directory goes on
    sys.path, and in the shared temp directory any folder shadows a package of the same name
    (a leftover /tmp/z3 broke torch's `import z3` in vLLM's workers)."""
    return tempfile.mkdtemp(prefix="layerscope-foreign-cwd-")


def start(argv: list, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``argv`` in its own process group, outside the repository, output to ``log``."""
    with open(log, "w") as out:
        return subprocess.Popen([str(a) for a in argv], cwd=empty_cwd(), stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})}, start_new_session=True)


def wait_healthy(argv: list, proc: subprocess.Popen, log: Path, startup_s: float = 900.0) -> str:
    """The base URL of the server ``argv`` started as ``proc``, once its ``/health`` answers 200."""
    url = f"http://127.0.0.1:{argv[argv.index('--port') + 1]}"
    deadline = time.monotonic() + startup_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{argv[0]} exited with {proc.returncode}: {log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2, trust_env=False).status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"server not up after {startup_s:.0f} s: {log.read_text()[-3000:]}")
        time.sleep(2)


@contextmanager
def server(argv: list, log: Path, env: dict[str, str] | None = None,
           startup_s: float = 900.0) -> Iterator[tuple[str, subprocess.Popen]]:
    """Run ``argv`` (binding 127.0.0.1 and the port in it) in its own process group, outside the
    repository; yield (base URL, process) once ``/health`` answers 200; stop the whole group on exit."""
    proc = start(argv, log, env)
    try:
        yield wait_healthy(argv, proc, log, startup_s), proc
    finally:
        stop_group(proc)


def stop_group(proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """SIGTERM ``proc``'s process group and wait until every process of it is gone (a server's engine
    processes too: one left shutting down, or stuck, would take CPU from what runs next); SIGKILL
    whatever is left after ``timeout_s``."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    sig = signal.SIGTERM
    while True:
        proc.poll()  # reap the leader: a zombie still counts as a member of the group
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        if time.monotonic() > deadline:
            if sig == signal.SIGKILL:
                return
            sig = signal.SIGKILL
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            deadline = time.monotonic() + 10
        time.sleep(0.1)
