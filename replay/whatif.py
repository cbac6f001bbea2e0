"""What if: the run replayed with a changed config, arrival rate or KV pool, and (``--verify``) the
changed config run for real on the same workload, predicted against measured.

The prediction is calibrated on the run itself: each figure of the changed replay times the run's
measured / replayed-as-is ratio for that figure (the replay's own bias on this run taken out).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

from layerscope.contract import CONFIG_KEYS, flatten_config
from layerscope.replay.inputs import Inputs, load_inputs
from layerscope.replay.metrics import mean_figures
from layerscope.replay.sim import replay

VERIFY_TOLERANCE = 0.15  # predicted p50s within 15 % of the measured (docs/replay.md)
REPORTED = (("ttft_s", "p50"), ("ttft_s", "p90"), ("tpot_s", "p50"), ("tpot_s", "p90"), ("e2e_s", "p50"))


def parse_rate(text: str | None) -> float:
    """``x2``, ``2x`` or ``2``: the arrival rate times 2."""
    if text is None:
        return 1.0
    t = text.strip().lower().removeprefix("x").removesuffix("x")
    try:
        f = float(t)
    except ValueError:
        raise ValueError(f"--rate takes a factor such as x2 or x0.5, got {text!r}") from None
    if not f > 0:
        raise ValueError(f"--rate takes a factor > 0, got {text!r}")
    return f


def scenarios(sets: list[str] | None, kv_blocks: int | None) -> list[dict[str, Any]]:
    """The --set changes, one dict per point: a key given as ``K=a,b,c`` is a sweep (one key only)."""
    fixed: dict[str, Any] = {}
    sweep: tuple[str, list[str]] | None = None
    for item in sets or []:
        if "=" not in item:
            raise ValueError(f"--set takes KEY=VALUE, got {item!r}")
        k, v = (x.strip() for x in item.split("=", 1))
        if "," in v:
            if sweep is not None:
                raise ValueError(f"sweep one key at a time ({sweep[0]} and {k} both have lists)")
            sweep = (k, [x.strip() for x in v.split(",") if x.strip()])
        else:
            fixed[k] = v
    if kv_blocks is not None:
        fixed["num_kv_blocks"] = kv_blocks
    if sweep is None:
        return [fixed]
    return [{**fixed, sweep[0]: v} for v in sweep[1]]


def apply(inp: Inputs, change: dict[str, Any]) -> tuple:
    """(settings, num_kv_blocks) with ``change`` applied (an unknown key names the replayable ones)."""
    s, kv = inp.settings, inp.num_kv_blocks
    for k, v in change.items():
        if k == "num_kv_blocks":
            kv = int(v)
            if kv < 1:
                raise ValueError(f"num_kv_blocks must be >= 1, got {v}")
        else:
            s = s.set(k, v)
    return s, kv


def predict(inp: Inputs, change: dict[str, Any], rate: float = 1.0, seeds: tuple[int, ...] = (0, 1, 2),
            shared: dict | None = None) -> dict:
    """Replayed as-is and changed, with the calibrated prediction, for one scenario. ``shared``: kept
    by the caller across the scenarios of one run (a sweep): the as-is replay and the block hashes."""
    s, kv = apply(inp, change)
    wl = inp.workload.scaled(rate) if rate != 1.0 else inp.workload
    shared = {} if shared is None else shared
    memo = shared.setdefault("hash_memo", {})  # every replay here has the same prompts: their block hashes once
    if shared.get("base_seeds") != seeds:
        shared["base_seeds"] = seeds
        shared["base"] = mean_figures([replay(inp.workload, inp.settings, inp.num_kv_blocks, inp.front, inp.cost,
                                              seed=k, hash_memo=memo).figures for k in seeds])
    base = shared["base"]
    new = mean_figures([replay(wl, s, kv, inp.front, inp.cost, seed=k, hash_memo=memo).figures for k in seeds])
    pred = {}
    for m, p in REPORTED:
        meas, rb, rn = inp.measured[m][p], base[m][p], new[m][p]
        pred[f"{m}:{p}"] = rn * meas / rb if rb > 0 and np.isfinite(meas) else rn
    return {"change": change, "rate": rate, "measured": {f"{m}:{p}": inp.measured[m][p] for m, p in REPORTED},
            "replayed": {f"{m}:{p}": base[m][p] for m, p in REPORTED},
            "changed": {f"{m}:{p}": new[m][p] for m, p in REPORTED}, "predicted": pred,
            "extra": {k: new[k] for k in ("waiting_mean", "preemptions", "prefix_hit_rate", "rejected")}}


def verify_command(manifest: dict[str, Any], change: dict[str, Any], rate: float, out: Path,
                   workload_file: Path) -> list[str]:
    """The ``layerscope run`` that runs ``change`` for real on the run's own workload (rate scaled)."""
    wl = dict(manifest.get("workload") or {})
    if not wl:
        raise ValueError("the run's manifest has no workload spec: --verify cannot re-run it")
    if rate != 1.0:
        if wl.get("kind") == "burst":
            wl["burst_interval_s"] = wl.get("burst_interval_s", 1.5) / rate
        else:
            wl["rate"] = wl.get("rate", 0.0) * rate
    workload_file.write_text(json.dumps(wl))
    cfg = flatten_config(manifest.get("config") or {})
    model = cfg.pop("model", None)
    if not model:
        raise ValueError("the run's manifest names no model: --verify cannot re-run it")
    sets = {k: v for k, v in cfg.items() if k in CONFIG_KEYS and CONFIG_KEYS[k][1] != v}
    sets.update({k: v for k, v in change.items()})
    cmd = [sys.executable, "-m", "layerscope", "run", "--model", str(model), "--workload", str(workload_file),
           "--out", str(out), "--overwrite", "--no-progress"]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={str(v).lower() if isinstance(v, bool) else v}"]
    return cmd


def verify(path: str, manifest: dict[str, Any], point: dict, out: Path) -> dict:
    """Run the point's change for real; its measured figures beside the prediction."""
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = verify_command(manifest, point["change"], point["rate"], out, out.with_suffix(".workload.json"))
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the verify run failed ({' '.join(cmd)}):\n{proc.stderr[-2000:]}")
    got = load_inputs(str(out)).measured
    rows = []
    for m, p in REPORTED:
        k = f"{m}:{p}"
        meas, pr = got[m][p], point["predicted"][k]
        err = (pr - meas) / meas if meas else float("nan")
        rows.append({"metric": m, "pct": p, "predicted": pr, "measured": meas, "rel_err": err,
                     "ok": bool(abs(err) <= VERIFY_TOLERANCE) if p == "p50" else None})
    return {"out": str(out), "command": cmd, "rows": rows,
            "ok": all(r["ok"] for r in rows if r["ok"] is not None)}
