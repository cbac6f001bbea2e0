"""Machine noise, recorded with every run: what the rest of the machine did, and how fast it was.

A run's latencies move when other processes share its CPUs (or GPU), or when the
machine runs at another speed (frequency scaling, a noisy VM neighbour). diagnose
can only tell such a change from a software change when the bundle says what the
machine did, so ``layerscope run`` records:

- ``machine.parquet`` (``schema.MACHINE``): every ``interval_s`` while the run is
  recorded, the CPU time of the whole machine and of the run's own process tree
  (CPU-seconds per second, i.e. cores busy), their difference (``outside_cpu_cores``:
  other processes), the time the run's threads waited runnable for a CPU
  (``run_wait_cores``: on a saturated machine the CPUs are busy either way, and this is
  what shows that others held the run back), hypervisor steal, the 1-minute load average, the CPU frequency
  where readable, and on CUDA machines with NVML the GPU's utilisation and the
  processes on it that are not the run's;
- ``manifest["machine"]``: a fixed yardstick (``YARDSTICK_WORK``: a short, fixed
  single-core CPU workload, pure Python and numpy) timed ``yardstick_reps`` times
  before and after the load, and a summary of the time series.

The yardstick measures one core's speed; contention shows in ``outside_cpu_cores``
(a busy loop on one of two cores leaves the other core, and so the yardstick, alone).
Bundles without these (older bundles, ``bench``) still load: ``read_machine`` returns
None then. Nothing here imports the engine or torch.
"""

from __future__ import annotations

import math
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

MACHINE_FILE = "machine.parquet"
YARDSTICK_WORK = "ls-yardstick/1: 1M-iteration integer loop + 200 x (96x96 float64 matmul)"


def yardstick_once() -> float:
    """Seconds of one fixed CPU workload (about 0.1 s on one core of a quiet laptop-class CPU)."""
    rng = np.random.default_rng(0)
    m = rng.standard_normal((96, 96))
    t0 = time.perf_counter()
    acc = 0
    for i in range(1_000_000):
        acc = (acc + i * i) % 1_000_003
    x = m
    for _ in range(200):
        x = np.tanh(x @ m * 0.01)
    t = time.perf_counter() - t0
    if acc < 0 or not np.isfinite(x).all():  # keeps the work from being optimized away
        raise RuntimeError("yardstick failed")
    return t


def yardstick(reps: int = 3) -> list[float]:
    """``reps`` timings of ``yardstick_once`` (seconds)."""
    return [yardstick_once() for _ in range(reps)]


def _cpu_freq_mhz() -> float:
    try:
        import psutil

        f = psutil.cpu_freq()
        return float(f.current) if f and f.current else math.nan
    except (ImportError, OSError, NotImplementedError, AttributeError):
        return math.nan


class _Gpu:
    """NVML where available: GPU utilisation and the processes on it that are not the run's."""

    def __init__(self):
        self.handles = []
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nv = pynvml
            self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except Exception:  # no NVML, no driver, no GPU: nothing to sample
            self.handles = []

    def sample(self, own: set[int]) -> tuple[float, float, float]:
        if not self.handles:
            return math.nan, math.nan, math.nan
        util, procs, mem = 0.0, 0, 0
        for h in self.handles:
            try:
                util = max(util, float(self.nv.nvmlDeviceGetUtilizationRates(h).gpu))
                for p in self.nv.nvmlDeviceGetComputeRunningProcesses(h):
                    if p.pid not in own:
                        procs += 1
                        mem += int(p.usedGpuMemory or 0)
            except Exception:
                return math.nan, math.nan, math.nan
        return util, float(procs), float(mem)


class MachineSampler:
    """Samples the machine on a thread between ``start()`` and ``stop()``; times the
    yardstick with ``yardstick("before" | "after")``. ``root_pid``: the run's process
    (its children, recursively, are the run's too; default: this process)."""

    def __init__(self, interval_s: float = 0.25, root_pid: int | None = None, yardstick_reps: int = 3):
        self.interval_s = interval_s
        self.root_pid = root_pid or os.getpid()
        self.yardstick_reps = yardstick_reps
        self.rows: list[dict[str, float]] = []
        self.yardstick_s: dict[str, list[float]] = {"before": [], "after": []}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._gpu = None

    def yardstick(self, when: str) -> list[float]:
        self.yardstick_s[when] = yardstick(self.yardstick_reps)
        return self.yardstick_s[when]

    def start(self) -> "MachineSampler":
        self._thread = threading.Thread(target=self._loop, name="layerscope-machine", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> "MachineSampler":
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        return self

    def _loop(self) -> None:
        try:
            import psutil
        except ImportError:
            return
        self._gpu = _Gpu()
        root = psutil.Process(self.root_pid)
        seen: dict[int, float] = {}  # pid -> its CPU seconds at the last sample
        waited: dict[int, float] = {}  # pid -> its threads' run-queue wait seconds at the last sample
        ncpu = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)

        front = [0.0, 0.0]  # the root process's own CPU and wait seconds in the last sample

        def tree_cpu(first: bool = False) -> tuple[float, float, set[int]]:
            """CPU seconds the run's tree used, and seconds its threads waited runnable for a CPU
            (/proc/PID/task/*/schedstat), since the last sample (exited processes keep their last
            count; a process new since the last sample counts all its time). The root process's
            own share goes to ``front`` (in ``layerscope run``: the gateway and the client)."""
            d, w, pids = 0.0, 0.0, set()
            front[0] = front[1] = 0.0
            try:
                procs = [root] + root.children(recursive=True)
            except psutil.Error:
                procs = []
            for p in procs:
                try:
                    t = p.cpu_times()
                    c = t.user + t.system
                except psutil.Error:
                    continue
                pids.add(p.pid)
                dc = max(c - seen.get(p.pid, c if first else 0.0), 0.0)
                d += dc
                seen[p.pid] = c
                q = _wait_s(p.pid)
                dw = 0.0
                if not math.isnan(q):
                    dw = max(q - waited.get(p.pid, q if first else 0.0), 0.0)
                    w += dw
                    waited[p.pid] = q
                if p.pid == self.root_pid:
                    front[0], front[1] = dc, dw if not math.isnan(q) else math.nan
            return d, w, pids

        def machine_cpu() -> tuple[float, float]:
            t = psutil.cpu_times()
            idle = t.idle + getattr(t, "iowait", 0.0)
            total = sum(t)  # guest time is included in user on Linux: subtract to not count it twice
            total -= getattr(t, "guest", 0.0) + getattr(t, "guest_nice", 0.0)
            return total - idle, getattr(t, "steal", math.nan)

        has_schedstat = os.path.exists(f"/proc/{self.root_pid}/task")
        tree_cpu(first=True)  # baseline counts
        busy0, steal0 = machine_cpu()
        t0 = time.monotonic()
        while not self._stop.wait(self.interval_s):
            run_s, wait_s, pids = tree_cpu()
            busy1, steal1 = machine_cpu()
            t1 = time.monotonic()
            dt = t1 - t0
            if dt <= 0:
                continue
            busy = (busy1 - busy0 - (steal1 - steal0 if not math.isnan(steal1) else 0.0)) / dt
            util, procs, mem = self._gpu.sample(pids)
            self.rows.append({
                "t_ns": time.monotonic_ns(), "interval_s": dt, "cpu_busy_cores": busy, "run_cpu_cores": run_s / dt,
                "outside_cpu_cores": float(np.clip(busy - run_s / dt, 0.0, ncpu)),
                "run_wait_cores": wait_s / dt if has_schedstat else math.nan,
                "front_cpu_cores": front[0] / dt,
                "front_wait_cores": front[1] / dt if has_schedstat else math.nan,
                "steal_cores": (steal1 - steal0) / dt if not math.isnan(steal1) else math.nan,
                "load_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else math.nan,
                "cpu_freq_mhz": _cpu_freq_mhz(), "gpu_util_pct": util, "gpu_other_procs": procs,
                "gpu_other_memory_bytes": mem})
            busy0, steal0, t0 = busy1, steal1, t1

    # ---- what goes into the bundle ----
    def table(self):
        import pyarrow as pa

        from layerscope.probes.schema import MACHINE

        cols = {f.name: [r.get(f.name) for r in self.rows] for f in MACHINE}
        return pa.Table.from_pydict(cols, schema=MACHINE)

    def manifest_section(self) -> dict[str, Any]:
        """manifest["machine"]: yardstick timings and a summary of the samples (docs/DESIGN.md)."""
        ys = self.yardstick_s["before"] + self.yardstick_s["after"]
        rows = self.rows

        def stat(key: str, fn) -> float | None:
            v = np.array([r[key] for r in rows], np.float64)
            v = v[~np.isnan(v)]
            return float(fn(v)) if len(v) else None

        return {
            "sample_interval_s": self.interval_s,
            "num_samples": len(rows),
            "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "yardstick": {"work": YARDSTICK_WORK, "before_s": self.yardstick_s["before"],
                          "after_s": self.yardstick_s["after"],
                          "median_s": float(np.median(ys)) if ys else None},
            "outside_cpu_cores_mean": stat("outside_cpu_cores", np.mean),
            "outside_cpu_cores_p90": stat("outside_cpu_cores", lambda v: np.quantile(v, 0.9)),
            "run_cpu_cores_mean": stat("run_cpu_cores", np.mean),
            "run_wait_cores_mean": stat("run_wait_cores", np.mean),
            "front_wait_share": _front_wait_share(rows),
            "steal_cores_mean": stat("steal_cores", np.mean),
            "load_1m_mean": stat("load_1m", np.mean),
            "cpu_freq_mhz_mean": stat("cpu_freq_mhz", np.mean),
            "gpu_util_pct_mean": stat("gpu_util_pct", np.mean),
            "gpu_other_procs_max": stat("gpu_other_procs", np.max),
        }


def client_machine_section(before_s: list[float], after_s: list[float]) -> dict[str, Any]:
    """manifest["machine"] of a client-side bundle (``bench --endpoint``): the yardstick only. The
    server is not this process's child, so its CPU would count as "other processes": contention
    is not the client's to measure; the machine's speed (and how much it varied) is."""
    ys = before_s + after_s
    return {"source": "client", "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else os.cpu_count(), "yardstick": {"work": YARDSTICK_WORK, "before_s": before_s, "after_s": after_s,
                                               "median_s": float(np.median(ys)) if ys else None}}


def _front_wait_share(rows: list[dict[str, float]]) -> float | None:
    """Over the whole load: the root process's run-queue wait / (wait + CPU) (None when unmeasured)."""
    w = sum(r["front_wait_cores"] * r["interval_s"] for r in rows if not math.isnan(r["front_wait_cores"]))
    c = sum(r["front_cpu_cores"] * r["interval_s"] for r in rows if not math.isnan(r["front_wait_cores"]))
    return float(w / (w + c)) if w + c > 0 else None


def _wait_s(pid: int) -> float:
    """Seconds the threads of ``pid`` spent runnable but waiting for a CPU (Linux schedstat;
    NaN elsewhere). On a saturated machine this, not other processes' CPU time (the CPUs
    are busy either way), shows how much others held the run back."""
    total = 0.0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return math.nan
    for t in tasks:
        try:
            with open(f"/proc/{pid}/task/{t}/schedstat") as f:
                total += int(f.read().split()[1]) / 1e9
        except (OSError, ValueError, IndexError):
            continue
    return total


def read_machine(path: str | Path, manifest: dict[str, Any] | None = None):
    """(samples DataFrame or None, manifest["machine"] or None) of a bundle; both None
    for bundles recorded without machine sampling."""
    p = Path(path)
    if manifest is None:
        from layerscope.probes.reader import read_manifest  # pandas and pyarrow: not at the sampler's import

        try:
            manifest = read_manifest(p)
        except (OSError, ValueError):  # BundleError is a ValueError: no readable manifest, no section
            manifest = {}
    section = manifest.get("machine") if isinstance(manifest.get("machine"), dict) else None
    f = p / MACHINE_FILE
    df = None
    if f.is_file():
        import pyarrow.parquet as pq

        try:
            df = pq.read_table(f).to_pandas()
        except Exception:  # a damaged optional table must not stop a diagnosis: treat as absent
            df = None
    return df, section
