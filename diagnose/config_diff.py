"""Config, version and environment diff between two runs (or two config files).

Every key of the resolved engine + gateway config that differs is listed with both
values, whether each side set it or took the version's default, and the layer it
acts on. Keys, layers and defaults come from ``layerscope.contract.CONFIG_KEYS``, the
table the engine's config is built from (diagnose must not import the engine). A bundle
whose manifest carries a ``config_layers`` map (key -> layer, as the engine that ran
registered it) is read from that map first.
"""

from __future__ import annotations

import json
import math
import tomllib
from pathlib import Path
from typing import Any, Iterable, Mapping

import pandas as pd

from layerscope.contract import CONFIG_DEFAULTS, CONFIG_KEYS, CONFIG_LAYERS, flatten_config

# values the engine derives at start-up (manifest "resolved")
RESOLVED_LAYERS: dict[str, str] = {
    "dtype": "kernel.compute",
    "device": "hardware",
    "kernel_backend": "kernel.compute",
    "max_model_len": "engine.queue",
    "num_kv_blocks": "engine.kv",
    "block_size": "engine.kv",
    "kv_cache_bytes": "engine.kv",
}
RESOLVED_DEFAULT_LAYER = "model.forward"  # architecture, sizes, parameter counts

# a change acting on one layer can move the time measured in these layers
CAN_MOVE: dict[str, frozenset[str]] = {
    "gateway.queue": frozenset({"gateway.queue"}),
    "gateway.route": frozenset({"gateway.route", "engine.queue"}),
    "engine.queue": frozenset({"engine.queue", "engine.kv", "engine.schedule", "model.forward"}),
    "engine.schedule": frozenset({"engine.schedule", "engine.queue", "model.forward"}),
    "engine.kv": frozenset({"engine.kv", "engine.queue", "model.forward"}),
    "model.forward": frozenset({"model.forward", "kernel.compute", "kernel.launch_gap", "parallel.collective"}),
    "parallel.collective": frozenset({"parallel.collective", "model.forward"}),
    "kernel.compute": frozenset({"kernel.compute", "kernel.launch_gap", "model.forward", "hardware"}),
    "kernel.launch_gap": frozenset({"kernel.launch_gap", "model.forward"}),
    "engine.output": frozenset({"engine.output"}),
    "hardware": frozenset({"hardware", "kernel.compute", "kernel.launch_gap", "model.forward",
                           "engine.schedule", "parallel.collective", "engine.output"}),
}
VERSION_LAYERS = {"torch": "kernel.compute", "triton": "kernel.compute", "transformers": "model.forward"}

DIFF_COLUMNS = ["kind", "key", "baseline", "candidate", "layer", "baseline_source", "candidate_source", "consistent"]


def set_keys_from_command(argv: Iterable[str] | None) -> set[str]:
    """Config keys a run's command line set explicitly (``--set K=V``, ``--tp``, ``--model``)."""
    keys: set[str] = set()
    args = list(argv or [])
    for i, a in enumerate(args):
        val = None
        if a == "--set" and i + 1 < len(args):
            val = args[i + 1]
        elif a.startswith("--set="):
            val = a[len("--set="):]
        if val and "=" in val:
            keys.add(val.split("=", 1)[0].strip())
        if a in ("--tp",) or a.startswith("--tp="):
            keys.add("tp_size")
        if a in ("--model",) or a.startswith("--model="):
            keys.add("model")
    return keys


def config_source(obj: Any) -> dict[str, Any]:
    """Normalize a Run, a bundle directory, a manifest, or a config JSON/TOML file into
    ``{name, config, resolved, versions, hardware, set_keys}`` (config flat, defaults filled)."""
    from layerscope.diagnose.load import Run, RunError, load_run

    if isinstance(obj, (str, Path)):
        p = Path(obj)
        if p.is_dir():
            obj = load_run(p)
        elif not p.exists():
            raise RunError(f"{p}: no such run bundle or config file")
        else:
            try:
                text = p.read_text()
                data = tomllib.loads(text) if p.suffix == ".toml" else json.loads(text)
            except (json.JSONDecodeError, tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
                raise RunError(f"{p}: not a config JSON/TOML file ({e})") from None
            if not isinstance(data, dict):
                raise RunError(f"{p}: a config file holds one object")
            if "config" in data and "format" in data:  # a manifest.json
                data.pop("faults", None)
                return _from_manifest(data, str(p))
            flat = flatten_config(data)
            unknown = sorted(set(flat) - set(CONFIG_KEYS))
            if unknown:
                raise RunError(f"{p}: unknown config keys {', '.join(unknown)}")
            return {"name": str(p), "config": {**CONFIG_DEFAULTS, **flat}, "resolved": {}, "versions": {},
                    "hardware": {}, "set_keys": set(flat), "layers": {}}
    if isinstance(obj, Run):
        return _from_manifest(obj.manifest, obj.name)
    if isinstance(obj, Mapping):
        return _from_manifest(obj, str(obj.get("run_id", "")))
    raise TypeError(f"cannot read a config from {type(obj).__name__}")


def _kernel_measurement(key: str) -> bool:
    """The load-time kernel timings (resolved.kernels: *_us, the cache key, the CPU it ran on) vary
    run to run; only the choices they led to are configuration."""
    parts = key.split(".")
    if "kernels" not in parts:
        return False
    rest = parts[parts.index("kernels") + 1:]
    return any(p.endswith("_us") for p in rest) or rest[:1] in (["key"], ["cpu"])


def _from_manifest(m: Mapping[str, Any], name: str) -> dict[str, Any]:
    resolved = m.get("resolved") or {}
    if isinstance(resolved, list):  # per replica
        flat_r: dict[str, Any] = {}
        for i, r in enumerate(resolved):
            for k, v in flatten_config(r).items():
                flat_r[k if len(resolved) == 1 else f"replica{i}.{k}"] = v
        resolved = flat_r
    else:
        resolved = flatten_config(resolved)
    resolved = {k: v for k, v in resolved.items() if not _kernel_measurement(k)}
    return {
        "name": name,
        "config": {**CONFIG_DEFAULTS, **flatten_config(m.get("config") or {})},
        "resolved": resolved,
        "versions": dict(m.get("versions") or {}),
        "hardware": flatten_config(m.get("hardware") or {}),
        "set_keys": set_keys_from_command(m.get("command")),
        # key -> layer as the engine that ran registered it, when the bundle records it
        "layers": dict(m.get("config_layers") or {}),
    }


def config_diff(a: Any, b: Any, changed_layers: Iterable[str] | None = None) -> pd.DataFrame:
    """Every config/resolved/version/hardware value that differs between ``a`` and ``b``.

    Columns: kind (config | resolved | version | hardware), key, baseline, candidate,
    layer (the layer it acts on), baseline_source / candidate_source (set | default;
    config keys only), consistent (True/False whether a measured change sits in a
    layer this key can move; None when ``changed_layers`` is None or empty).
    """
    sa, sb = config_source(a), config_source(b)
    rows: list[dict[str, Any]] = []
    for kind in ("config", "resolved", "versions", "hardware"):
        da, db = sa[kind], sb[kind]
        for key in sorted(set(da) | set(db), key=_key_order):
            va, vb = da.get(key), db.get(key)
            if _same(va, vb):
                continue
            if kind == "config":
                layer = sb["layers"].get(key) or sa["layers"].get(key) or CONFIG_LAYERS.get(key, "model.forward")
                src_a = "set" if key in sa["set_keys"] else "default"
                src_b = "set" if key in sb["set_keys"] else "default"
            else:
                src_a = src_b = None
                if kind == "resolved":
                    layer = ("kernel.compute" if "kernels" in key.split(".")
                             else RESOLVED_LAYERS.get(key.split(".")[-1], RESOLVED_DEFAULT_LAYER))
                elif kind == "versions":
                    layer = VERSION_LAYERS.get(key)  # None: a version change can move any layer
                else:
                    layer = "hardware"
            rows.append({"kind": kind.rstrip("s") if kind == "versions" else kind, "key": key, "baseline": va,
                         "candidate": vb, "layer": layer, "baseline_source": src_a, "candidate_source": src_b,
                         "consistent": None})
    df = pd.DataFrame(rows, columns=DIFF_COLUMNS)
    if changed_layers is not None:
        df = mark_consistency(df, changed_layers)
    return df


def same_software(a: Mapping[str, Any], b: Mapping[str, Any], diff: pd.DataFrame) -> str | None:
    """Why two runs' software is known to be the same, or None when it is not (or not known).

    ``a``/``b``: the runs' manifests; ``diff``: their ``config_diff``. Only for runs of this project's
    engine (a resolved config, no ``external`` capture: an external engine's or a client-only bundle
    records layerscope's own checkout, not the server's software). The same: one git commit,
    both work trees clean or holding the same uncommitted change (``git_diff_sha``; a dirty bundle
    written before it was recorded is not known to be the same), no config, resolved or version
    row in the diff, the same injected faults (``load``'s ``injected_digest``: whether, never which) and
    probe level. Hardware may differ: that is the machine.
    What the bundle does not record (environment variables outside the config, a checkpoint
    rewritten at the same path) is not seen."""
    if a.get("external") or b.get("external") or not a.get("resolved") or not b.get("resolved"):
        return None  # an engine that is not ours (vLLM, SGLang), or a client's view: its software is not here
    # the versions' keys (git_rev, git_dirty, git_diff_sha, packages) are compared by ``diff``: here
    # only whether the checkout is known at all (a dirty one only by its change's hash)
    v = a.get("versions") or {}
    dirty = v.get("git_dirty")
    if not v.get("git_rev") or dirty is None or (dirty and not v.get("git_diff_sha")):
        return None
    if len(diff) and diff["kind"].isin(["config", "resolved", "version"]).any():
        return None
    if a.get("injected_digest") != b.get("injected_digest") or a.get("probes") != b.get("probes"):
        return None
    state = f"the same uncommitted change {v['git_diff_sha'][:12]}" if dirty else "clean"
    return (f"the software is the same in both runs: commit {v['git_rev'][:10]} ({state}), the same config, faults, "
            "probes and package versions")


def mark_consistency(diff: pd.DataFrame, changed_layers: Iterable[str]) -> pd.DataFrame:
    """Set ``consistent``: does any measured change sit in a layer this entry can move?"""
    changed = set(changed_layers)
    out = diff.copy()
    if not changed:
        out["consistent"] = None
        return out
    out["consistent"] = [can_move(layer, changed) for layer in out["layer"]]
    return out


def can_move(layer: str | None, changed: set[str]) -> bool:
    if layer is None:  # a version change: anything
        return True
    return bool(CAN_MOVE.get(layer, frozenset({layer})) & changed)


def source_text(baseline_source: Any, candidate_source: Any) -> str:
    """Where a config key's two values came from: ``default changed`` (both defaults: the default
    itself moved), ``set -> default``; "" for keys without a source (resolved, version, hardware)."""
    sa, sb = (None if s is None or (isinstance(s, float) and math.isnan(s)) else s
              for s in (baseline_source, candidate_source))
    if sa is None and sb is None:
        return ""
    return "default changed" if sa == sb == "default" else f"{sa} -> {sb}"


def change_text(row: Mapping[str, Any]) -> str:
    """One entry of a config diff in words: ``max_num_seqs 64 -> 2 (default changed)``,
    ``num_kv_blocks 32 -> 4`` (no source: a resolved value)."""
    src = source_text(row.get("baseline_source"), row.get("candidate_source"))
    return f"{row['key']} {row['baseline']} -> {row['candidate']}" + (f" ({src})" if src else "")


def diff_records(diff: pd.DataFrame) -> list[dict[str, Any]]:
    """The diff as JSON-ready dicts (DESIGN.md's ``config_diff`` list)."""
    return [{k: _jsonable(v) for k, v in row.items()} for row in diff.to_dict("records")]


def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and v != v:
        return None
    if hasattr(v, "item"):
        return v.item()
    return v


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return float(a) == float(b)
    return a == b


def _key_order(key: str) -> tuple[int, str]:
    order = list(CONFIG_KEYS)
    return (order.index(key), key) if key in order else (len(order), key)
