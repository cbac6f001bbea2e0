"""Profiler windows (``--probes full``): torch.profiler over K steps every M steps.

Each window wraps the model execution of K consecutive steps (through the recorder's
``step_context``), marks each step with a ``layerscope::step#N`` range, and when it
closes turns the profiler's events into kernels.parquet rows and writes a Chrome
trace into the trace directory.

The op timeline of a step: walking down from the step's range, the first
``layerscope::<kernel>`` range (kernels/dispatch.py names every kernel call),
``aten::`` op or collective (``gloo:``/``nccl:``/``c10d::``) on each path is one row
(plus collectives that gloo runs on its own thread, placed by time); what runs inside it is part of it. On CPU
this is the host timeline, and the gaps between consecutive rows (``gap_before_s``)
are the host's idle/overhead between ops, the CPU analogue of launch gaps. On CUDA
the rows are the device kernels run inside the step's range instead, and the gaps
are device idle time between kernels.

``start_ns`` is the profiler's clock (epoch ns) mapped onto ``time.monotonic_ns()`` by
an offset sampled when the window closes (microsecond-accurate; exact within a window).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable

import torch

logger = logging.getLogger(__name__)

STEP_PREFIX = "layerscope::step#"
_COMM = ("all_reduce", "allreduce", "all_gather", "allgather", "broadcast", "c10d::", "nccl", "gloo",
         "reduce_scatter")
_MEMORY = ("aten::copy_", "aten::to", "aten::_to_copy", "aten::empty", "aten::empty_strided", "aten::zeros",
           "aten::zero_", "aten::fill_", "aten::index_put_", "aten::cat", "aten::clone", "aten::contiguous",
           "aten::lift_fresh", "aten::detach_", "aten::index_copy_", "aten::scatter_", "aten::new_empty",
           "layerscope::write_kv")


def op_category(name: str) -> str:
    """compute | communication | memory, from an op or kernel name."""
    low = name.lower()
    if any(k in low for k in _COMM):
        return "communication"
    if name in _MEMORY:
        return "memory"
    return "compute"


def _is_op(name: str) -> bool:
    if name.startswith(("aten::", "mkldnn::", "gloo:", "nccl:", "c10d::")):
        return True
    return name.startswith("layerscope::") and not name.startswith(STEP_PREFIX)


def kineto_events(prof) -> list[tuple[str, int, int, int, bool]]:
    """(name, start_ns, end_ns, thread, is_device) of every event of a stopped profiler (epoch ns).

    Read straight from the kineto results: ``prof.events()`` would build the
    FunctionEvent tree in Python, which costs ~1 s per window on a loaded CPU.
    """
    out = []
    for e in prof.profiler.kineto_results.events():
        start = e.start_ns()
        is_dev = e.device_type() != torch.autograd.DeviceType.CPU
        out.append((e.name(), start, start + e.duration_ns(), -1 if is_dev else e.start_thread_id(), is_dev))
    return out


def timeline_rows(events: list[tuple[str, int, int, int, bool]], window: int, replica: int,
                  offset_ns: int = 0) -> list[tuple]:
    """kernels.parquet rows from ``(name, start_ns, end_ns, thread, is_device)`` events.

    Host events nest by time on their thread (the profiler's own tree, rebuilt with a
    stack). Without device events a step's rows are its top-level ops (see the module
    docstring); with device events (CUDA) they are the device kernels that ran inside
    the step's range (the engine syncs before the step ends). ``offset_ns`` is added to
    every start (to move the profiler clock onto the monotonic clock).
    """
    host = sorted((e for e in events if not e[4]), key=lambda e: (e[3], e[1], -e[2]))
    markers = [(e[1], e[2], int(e[0][len(STEP_PREFIX):])) for e in host if e[0].startswith(STEP_PREFIX)]
    per_step: dict[int, list[tuple[str, int, int]]] = {sid: [] for _, _, sid in markers}
    device = [e for e in events if e[4]]
    if device:
        for name, start, end, _, _ in device:
            for m0, m1, sid in markers:
                if m0 <= start < m1:
                    per_step[sid].append((name, start, end))
                    break
    else:
        # stack entries: (end_ns, step id in scope or None, inside an op row)
        stack: list[tuple[int, int | None, bool]] = []
        loose: list[tuple[str, int, int]] = []
        thread = None
        for name, start, end, tid, _ in host:
            if tid != thread:
                stack, thread = [], tid
            while stack and stack[-1][0] <= start:
                stack.pop()
            step, inside = (stack[-1][1], stack[-1][2]) if stack else (None, False)
            if name.startswith(STEP_PREFIX):
                stack.append((end, int(name[len(STEP_PREFIX):]), False))
                continue
            op = _is_op(name)
            if step is not None and op and not inside:
                per_step[step].append((name, start, end))
            elif step is None and op_category(name) == "communication":
                loose.append((name, start, end))  # gloo runs collectives on its own thread
            stack.append((end, step, inside or op))
        for name, start, end in loose:
            for m0, m1, sid in markers:
                if m0 <= start < m1:
                    per_step[sid].append((name, start, end))
                    break
    rows: list[tuple] = []
    for _, _, sid in markers:
        ops = sorted(per_step[sid], key=lambda o: o[1])
        prev_end = None
        for name, start, end in ops:
            gap = None if prev_end is None else max(start - prev_end, 0) / 1e9
            rows.append((window, sid, replica, name, op_category(name), start + offset_ns, (end - start) / 1e9, gap))
            prev_end = end if prev_end is None else max(prev_end, end)
    return rows


class _StepRange:
    """Context of one profiled step: a ``record_function`` range, and the window bookkeeping."""

    def __init__(self, owner: "ProfilerWindows", step_id: int):
        self.owner = owner
        self.rf = torch.profiler.record_function(f"{STEP_PREFIX}{step_id}")

    def __enter__(self):
        self.rf.__enter__()
        return None

    def __exit__(self, *exc):
        self.rf.__exit__(*exc)
        self.owner._step_done()
        return False


class ProfilerWindows:
    """Opens a torch.profiler window of ``num_steps`` steps every ``every_steps`` steps (at most ``max_windows``).

    A window opens on the kind of step (one that carries prompt tokens, or decodes only) the earlier
    windows saw less of, waiting up to ``4 * every_steps`` steps for one (prompts arrive seconds
    apart): windows that saw only batch-1 decodes show every op at one size, where a fixed time per
    call and a common factor predict the same deltas (docs/diagnose.md §2.2); a prefill's ops are
    tens of times larger.
    """

    def __init__(self, trace_dir: Path, replica: int = 0, every_steps: int = 64, num_steps: int = 2,
                 max_windows: int = 4, on_window: Callable[[float], None] | None = None, first_step: int = 2):
        self.trace_dir = Path(trace_dir)
        self.replica = replica
        self.every_steps = max(every_steps, num_steps)
        self.num_steps = num_steps
        self.max_windows = max_windows
        self.on_window = on_window
        self.rows: list[tuple] = []
        self.num_windows = 0
        self._next_start = first_step
        self._prof = None
        self._in_window = 0
        self._first_step = 0
        self._last_step = 0
        self.kinds_seen = {True: 0, False: 0}  # windows opened on a step with prompt tokens / decodes only

    def warmup(self) -> None:
        """Start and stop an empty profile: the first one loads kineto and imports (seconds), which
        would otherwise land inside the first window's steps."""
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
            pass

    def step_context(self, step_id: int, scheduled=None):
        from layerscope.engine.recorder import NULL_CONTEXT

        if self._prof is None:
            if step_id < self._next_start or self.num_windows >= self.max_windows:
                return NULL_CONTEXT
            prefill = None if scheduled is None else any(s.is_prefill for s in scheduled)
            if prefill is not None:
                want = self._wanted_kind()
                if want is not None and prefill != want and step_id < self._next_start + 4 * self.every_steps:
                    return NULL_CONTEXT  # wait (a while) for the kind of step the windows lack
                self.kinds_seen[prefill] += 1
            self._open(step_id)
        self._last_step = step_id
        return _StepRange(self, step_id)

    def _wanted_kind(self) -> bool | None:
        """The step kind (True: carries prompt tokens) the windows have seen less of; None when even."""
        n_pre, n_dec = self.kinds_seen[True], self.kinds_seen[False]
        return None if n_pre == n_dec else n_pre < n_dec

    def _open(self, step_id: int) -> None:
        acts = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        self._prof = torch.profiler.profile(activities=acts)
        self._prof.start()
        self._in_window = 0
        self._first_step = step_id

    def _step_done(self) -> None:
        self._in_window += 1
        if self._in_window >= self.num_steps:
            self.close()

    def close(self) -> None:
        """Stop an open window; build its rows and write its Chrome trace."""
        prof, self._prof = self._prof, None
        if prof is None:
            return
        prof.stop()
        window = self.num_windows
        self.num_windows += 1
        self._next_start = self._first_step + self.every_steps
        try:
            # kineto times are epoch ns; map them onto the monotonic clock
            offset = time.monotonic_ns() - time.time_ns()
            rows = timeline_rows(kineto_events(prof), window, self.replica, offset)
            self.rows += rows
            name = f"profile-r{self.replica}-w{window}-steps{self._first_step}-{self._last_step}.json"
            self.trace_dir.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(self.trace_dir / name))
        except Exception:  # a broken window must not take the engine down
            logger.exception("profiler window %d could not be processed", window)
            return
        busy = sum(r[6] for r in rows)
        gaps = sum(r[7] or 0.0 for r in rows)
        if self.on_window is not None and busy + gaps > 0:
            self.on_window(gaps / (busy + gaps))
