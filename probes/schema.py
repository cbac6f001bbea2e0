"""The run bundle's schema: table names, columns, types and units (a contract).

Everything downstream (diagnose, TUI, regressions, dashboards tests) reads bundles
through these names. Units are in the column names: ``_ns`` timestamps on the host's
monotonic clock (``time.monotonic_ns()``, shared by every process on one host),
``_s`` durations in seconds, ``num_`` counts. A missing timestamp is null.

Bump SCHEMA_VERSION on any incompatible change; readers refuse versions they don't know.
Layer ids, statuses and the metric formulas are ``layerscope.contract``'s.
"""

from __future__ import annotations

import pyarrow as pa

from layerscope.contract import BREAKDOWN_LAYERS, LAYERS, component_column  # noqa: F401  (LAYERS: re-export)

SCHEMA_VERSION = 3  # 2: requests carry every per-request component (E2E_COMPONENTS.., DECODE_COLUMNS);
# 3: steps carry the step loop thread's CPU time and run-queue wait (WORK_COLUMNS), requests their
# prompt_block_hashes (the replay's prefix structure)
BUNDLE_FORMAT = "layerscope.bundle"

# TTFT components, in request order; their sum plus ttft_residual_s equals ttft_s.
TTFT_COMPONENTS = tuple((layer, component_column("ttft", layer)) for layer in BREAKDOWN_LAYERS)
# Version 2: the E2E and TPOT components and the decode phase's composition, as the writer computed
# them with probes/breakdown.request_breakdown (diagnose reads them instead of re-deriving them from
# the steps' memberships; null in a bundle whose writer did not compute them: diagnose derives them).
E2E_COMPONENTS = tuple((layer, component_column("e2e", layer)) for layer in BREAKDOWN_LAYERS)
TPOT_COMPONENTS = tuple((layer, component_column("tpot", layer)) for layer in BREAKDOWN_LAYERS)
DECODE_COLUMNS = (
    "num_decode_steps",  # decode steps (one token each, after the first token) it took part in
    "num_mixed_steps",  # of which also carried prefill chunks
    "mean_batch_seqs",  # mean sequences per decode step
    "tpot_step_s",  # its decode steps' time per output token after the first
    "tpot_prefill_interference_s",  # the prefill-token share of that time
)
STORED_COMPONENT_COLUMNS = (
    *[c for _, c in TTFT_COMPONENTS], "ttft_residual_s",
    *[c for _, c in E2E_COMPONENTS], "e2e_residual_s",
    *[c for _, c in TPOT_COMPONENTS], "tpot_residual_s",
    *DECODE_COLUMNS,
)

PREFIX_HASH_TOKENS = 16  # tokens per chunk of requests.prompt_block_hashes

_ts = pa.int64()
_s = pa.float64()
_n = pa.int64()
_str = pa.string()

REQUESTS = pa.schema(
    [
        ("request_id", _str),
        ("replica", _n),  # engine replica that served it (0 offline)
        ("status", _str),  # finished_stopped | finished_length | finished_aborted | rejected | error
        ("finish_reason", _str),  # stop | length | abort | null
        ("error", _str),  # message when status is rejected/error
        ("http_status", _n),  # served over HTTP: the status code; null offline
        ("num_prompt_tokens", _n),
        ("num_cached_tokens", _n),  # prompt tokens served from the prefix cache
        ("num_output_tokens", _n),
        ("num_preemptions", _n),
        ("num_recomputed_tokens", _n),
        ("num_steps", _n),  # engine steps it took part in
        ("num_prefill_chunks", _n),
        # lifecycle timestamps (ns, monotonic); null where a layer does not exist (offline: no gateway/client)
        ("client_send_ns", _ts),
        ("gateway_arrival_ns", _ts),
        ("gateway_admitted_ns", _ts),
        ("gateway_routed_ns", _ts),  # handed to the replica's IPC
        ("engine_arrival_ns", _ts),
        ("engine_scheduled_ns", _ts),  # first scheduled
        ("engine_first_token_ns", _ts),
        ("engine_finished_ns", _ts),
        ("gateway_first_token_ns", _ts),  # first token written to the HTTP stream
        ("gateway_finished_ns", _ts),
        ("client_first_token_ns", _ts),
        ("client_done_ns", _ts),
        # server-side metrics (from gateway arrival; offline: from engine arrival)
        ("ttft_s", _s),
        ("tpot_s", _s),  # (e2e - ttft) / (output_tokens - 1); null when < 2 tokens
        ("e2e_s", _s),
        ("itl_mean_s", _s),  # per-token gaps (server side)
        ("itl_max_s", _s),
        # client-side metrics (null when no client)
        ("client_ttft_s", _s),
        ("client_tpot_s", _s),
        ("client_e2e_s", _s),
        # TTFT decomposition (see TTFT_COMPONENTS) + what none of them explains
        *[(col, _s) for _, col in TTFT_COMPONENTS],
        ("ttft_residual_s", _s),
        # version 2: the other stored components (see STORED_COMPONENT_COLUMNS)
        *[(col, _s) for _, col in E2E_COMPONENTS],
        ("e2e_residual_s", _s),
        *[(col, _s) for _, col in TPOT_COMPONENTS],
        ("tpot_residual_s", _s),
        *[(c, _n if c.startswith("num_") else _s) for c in DECODE_COLUMNS],
        # time spent preempted over the whole life (engine.kv), and queue time
        ("preempted_s", _s),
        ("trace_id", _str),  # OpenTelemetry trace id (hex) of this request
        # version 3: the prompt's prefix structure for a replay (layerscope.replay): a chained hash per full
        # PREFIX_HASH_TOKENS-token chunk of the prompt (two requests share a prefix exactly as far as these agree)
        ("prompt_block_hashes", pa.list_(_n)),
    ]
)

STEPS = pa.schema(
    [
        ("step_id", _n),
        ("replica", _n),
        ("start_ns", _ts),
        ("end_ns", _ts),
        ("schedule_s", _s),
        ("prepare_s", _s),
        ("forward_s", _s),
        ("sample_s", _s),
        ("output_s", _s),
        ("step_s", _s),
        ("num_prefill_seqs", _n),
        ("num_prefill_tokens", _n),
        ("num_decode_seqs", _n),
        ("num_decode_tokens", _n),
        ("num_batched_tokens", _n),
        ("num_running", _n),
        ("num_waiting", _n),
        ("num_kv_blocks_free", _n),
        ("num_kv_blocks_total", _n),
        ("num_preemptions", _n),
        ("num_prefix_queries", _n),  # tokens
        ("num_prefix_hits", _n),  # tokens
        ("collective_s", _s),  # TP collective time inside this step's forward (rank 0)
        ("request_ids", pa.list_(_str)),  # requests computed in this step
        ("request_num_tokens", pa.list_(_n)),  # their tokens in this step
        # version 3, the step loop thread's (null where not measured): wall = cpu + wait + off-CPU not
        # runnable (sleeps, barriers, I/O), so wall - wait is the step's own time, wait what a busy machine took
        ("cpu_ns", _n),  # CPU time over the step (time.thread_time_ns delta)
        ("wait_ns", _n),  # run-queue wait over the step (/proc/<tid>/schedstat 2nd field delta)
        ("forward_cpu_ns", _n),  # the same two over the model's execution (prepare + forward + sample)
        ("forward_wait_ns", _n),
    ]
)
WORK_COLUMNS = ("cpu_ns", "wait_ns", "forward_cpu_ns", "forward_wait_ns")  # StepRecord's fields, same names

LAYER_TIMES = pa.schema(
    [
        ("step_id", _n),
        ("replica", _n),
        ("name", _str),  # embed | layers.{i}.attn | layers.{i}.mlp | norm | lm_head | sampler
        ("duration_s", _s),
    ]
)

KERNELS = pa.schema(
    [
        ("window", _n),  # profiler window index
        ("step_id", _n),  # engine step the event belongs to (null if outside a step)
        ("replica", _n),
        ("name", _str),
        ("category", _str),  # compute | communication | memory
        ("start_ns", _ts),  # profiler clock, comparable within a window
        ("duration_s", _s),
        ("gap_before_s", _s),  # idle since the previous op ended, within the same forward; null for the first
    ]
)

COLLECTIVES = pa.schema(
    [
        ("step_id", _n),
        ("replica", _n),
        ("rank", _n),
        ("op", _str),  # all_reduce | all_gather | broadcast
        ("name", _str),  # issuing layer row
        ("num_bytes", _n),
        ("start_ns", _ts),
        ("duration_s", _s),
        ("wait_s", _s),  # waiting for the slowest rank
    ]
)

SPANS = pa.schema(
    [
        ("trace_id", _str),
        ("span_id", _str),
        ("parent_span_id", _str),
        ("name", _str),
        ("layer", _str),  # one of LAYERS
        ("request_id", _str),
        ("start_ns", _ts),
        ("end_ns", _ts),
        ("attributes", _str),  # JSON object
    ]
)

# machine.parquet (optional: probes/machine.py; absent from older bundles and from bench):
# what the rest of the machine did while the run was recorded, one row per sample interval.
# *_cores = CPU-seconds per second (1.0 = one core fully busy); NaN where not readable.
MACHINE = pa.schema(
    [
        ("t_ns", _ts),  # end of the interval
        ("interval_s", pa.float64()),
        ("cpu_busy_cores", pa.float64()),  # every process on the machine (steal excluded)
        ("run_cpu_cores", pa.float64()),  # the run's own process tree
        ("outside_cpu_cores", pa.float64()),  # busy - run: other processes
        ("run_wait_cores", pa.float64()),  # the run's threads runnable but waiting for a CPU (schedstat)
        ("front_cpu_cores", pa.float64()),  # of run_cpu_cores, the root process's (gateway + client in a run)
        ("front_wait_cores", pa.float64()),  # of run_wait_cores, the root process's
        ("steal_cores", pa.float64()),  # hypervisor steal (other VMs)
        ("load_1m", pa.float64()),
        ("cpu_freq_mhz", pa.float64()),
        ("gpu_util_pct", pa.float64()),  # NVML, max over GPUs
        ("gpu_other_procs", pa.float64()),  # processes on the GPUs that are not the run's
        ("gpu_other_memory_bytes", pa.float64()),
    ]
)
OPTIONAL_TABLES: dict[str, pa.Schema] = {"machine": MACHINE}  # not required by readers
# columns added after version 1, with the version that added them (an older bundle reads them as null)
ADDED: dict[str, int] = {**{c: 2 for c in STORED_COMPONENT_COLUMNS[len(TTFT_COMPONENTS) + 1:]},
                         **{c: 3 for c in WORK_COLUMNS}, "prompt_block_hashes": 3}

TABLES: dict[str, pa.Schema] = {
    "requests": REQUESTS,
    "steps": STEPS,
    "layers": LAYER_TIMES,
    "kernels": KERNELS,
    "collectives": COLLECTIVES,
    "spans": SPANS,
}

# manifest.json top-level keys (all required)
MANIFEST_KEYS = (
    "format",  # BUNDLE_FORMAT
    "schema_version",
    "run_id",
    "command",  # argv list
    "config",  # EngineConfig.to_dict(): every key, defaults included
    "resolved",  # ResolvedConfig.to_dict() (per replica: list, or one dict)
    "workload",  # spec dict incl. name and seed ({} for offline API runs without one)
    "faults",  # Faults.to_dict(); diagnose must never read this
    "versions",  # layerscope, git_rev, python, torch, triton, transformers
    "hardware",  # cpu model, cores, memory_bytes, gpu (or null)
    "probes",  # off | default | full
    "start_ns",
    "end_ns",
    "start_time",  # ISO wall clock, informational
    "summary",  # requests, duration_s, output_tokens_per_s, ttft/tpot/e2e p50/p90/p99 (+ counts)
)
