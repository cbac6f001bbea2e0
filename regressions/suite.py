"""Regression suites: what ``layerscope regress`` runs for every version, read from TOML.

A suite names the model, the workloads, the engine/gateway configs (named sets of ``--set``
overrides), the repetitions, the SLOs for goodput and the gate (per metric, the largest
regression in percent tolerated before CI fails). Everything is validated here, before any run
starts or any file is written, so a bad suite costs nothing. Relative paths are relative to the
suite file. The format, with an example: docs/regress.md, "Suites".
"""

from __future__ import annotations

import hashlib
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from layerscope.engine.models import registry

SUITES_DIR = Path(__file__).parent / "suites"

# Gated metrics: diagnose's comparison metrics (same names, same significance rule).
METRICS: dict[str, str] = {
    "ttft_p50_s": "TTFT p50",
    "ttft_p99_s": "TTFT p99",
    "tpot_p50_s": "TPOT p50",
    "tpot_p99_s": "TPOT p99",
    "e2e_p50_s": "E2E p50",
    "output_tokens_per_s": "output tokens/s",
    "goodput_requests_per_s": "goodput req/s",
}
HIGHER_IS_BETTER = frozenset({"output_tokens_per_s", "goodput_requests_per_s"})
SLO_KEYS = ("ttft_s", "tpot_s", "e2e_s")
# ``layerscope model create`` choices (DESIGN.md), from the torch-free architecture registry
# (engine.models.create costs torch's import: validation stays instant, test_suite.py checks)
ARCHS = registry.names()
PRESETS = ("tiny", "small", "100m")
PROBE_LEVELS = ("off", "default", "full")

_TOP_KEYS = {"name", "description", "repetitions", "versions", "model", "workloads", "configs", "run", "slo",
             "thresholds"}
_MODEL_KEYS = {"arch", "preset", "seed", "path"}
_WORKLOAD_KEYS = {"name", "workload", "seed", "params"}
_RUN_KEYS = {"probes", "replicas", "timeout_s"}


class SuiteError(ValueError):
    """A suite file is missing, malformed, or names something that does not exist."""


@dataclass(frozen=True)
class ModelSpec:
    """A checkpoint directory, or a preset that ``layerscope model create`` makes."""

    path: Path | None = None
    arch: str = "llama"
    preset: str = "tiny"
    seed: int = 0

    @property
    def label(self) -> str:
        return self.path.name if self.path else f"{self.arch}-{self.preset}-seed{self.seed}"


@dataclass(frozen=True)
class SuiteWorkload:
    name: str  # label: unique within the suite
    workload: str  # built-in name, or the absolute path of a workload file
    seed: int = 0
    params: dict[str, Any] = field(default_factory=dict)

    def spec_data(self, slo: dict[str, float]) -> dict[str, Any]:
        """What ``layerscope run --workload FILE.json`` reads: the built-in as ``base`` (or
        the file's own fields), the seed, the overrides and the suite's SLOs. Only the
        fields the suite names, so an older version's WorkloadSpec reads it too."""
        from layerscope.regressions.load.workloads import BUILTIN

        if self.workload in BUILTIN:
            data: dict[str, Any] = {"base": self.workload}
        else:
            data = _read_workload_file(Path(self.workload))
        data.update(name=self.name, seed=self.seed, **self.params)
        for key, value in slo.items():
            data[f"slo_{key}"] = value
        return data


@dataclass(frozen=True)
class RunOptions:
    probes: str = "default"
    replicas: int = 1
    timeout_s: float = 300.0


@dataclass(frozen=True)
class Suite:
    name: str
    path: Path
    model: ModelSpec
    workloads: tuple[SuiteWorkload, ...]
    configs: dict[str, dict[str, Any]]  # name -> overrides (flat keys, gateway.x for gateway keys)
    repetitions: int = 2
    versions: tuple[str, ...] = ()
    run: RunOptions = RunOptions()
    slo: dict[str, float] = field(default_factory=dict)
    thresholds: dict[str, float] = field(default_factory=dict)  # metric -> max regression %
    description: str = ""
    text: str = ""  # the file as read, kept with every session's results

    @property
    def digest(self) -> str:
        """Short hash of the suite text: history rows of an edited suite are told apart."""
        return hashlib.sha256(self.text.encode()).hexdigest()[:12]


def resolve_suite_path(name_or_path: str | Path) -> Path:
    """A suite file path, or the name of a shipped suite (``smoke``, ``full``)."""
    p = Path(name_or_path)
    if p.is_file():
        return p
    shipped = SUITES_DIR / f"{name_or_path}.toml"
    if p.suffix == "" and shipped.is_file():
        return shipped
    known = ", ".join(sorted(f.stem for f in SUITES_DIR.glob("*.toml")))
    raise SuiteError(f"{p}: no such suite file (shipped suites: {known})")


def load_suite(name_or_path: str | Path) -> Suite:
    """Read and validate a suite. Raises SuiteError naming the file and the bad key."""
    path = resolve_suite_path(name_or_path).resolve()
    text = path.read_text()
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise SuiteError(f"{path}: not valid TOML ({e})") from None
    where = str(path)
    _known(data, _TOP_KEYS, where)
    base = path.parent

    name = _typed(data.get("name", path.stem), str, f"{where}: name")
    repetitions = _typed(data.get("repetitions", 2), int, f"{where}: repetitions")
    if repetitions < 1:
        raise SuiteError(f"{where}: repetitions must be >= 1, got {repetitions}")
    versions = data.get("versions", [])
    if not isinstance(versions, list) or not all(isinstance(v, str) for v in versions):
        raise SuiteError(f"{where}: versions must be a list of strings")

    suite = Suite(
        name=name,
        path=path,
        model=_model(data.get("model", {}), base, where),
        workloads=_workloads(data.get("workloads"), base, where),
        configs=_configs(data.get("configs", {}), where),
        repetitions=repetitions,
        versions=tuple(versions),
        run=_run(data.get("run", {}), where),
        slo=_slo(data.get("slo", {}), where),
        thresholds=_thresholds(data.get("thresholds", {}), where),
        description=str(data.get("description", "")),
        text=text,
    )
    for w in suite.workloads:  # every workload must build with the suite's overrides
        _check_workload(w, suite.slo, where)
    return suite


# ---- sections ------------------------------------------------------------------------------
def _model(d: Any, base: Path, where: str) -> ModelSpec:
    d = _table(d, f"{where}: [model]")
    _known(d, _MODEL_KEYS, f"{where}: [model]")
    if "path" in d:
        if set(d) - {"path"}:
            raise SuiteError(f"{where}: [model] takes either path or arch/preset/seed, not both")
        p = (base / _typed(d["path"], str, f"{where}: model.path")).resolve()
        if not (p / "config.json").is_file():
            raise SuiteError(f"{where}: model.path {p} is not a checkpoint directory (no config.json)")
        return ModelSpec(path=p)
    arch = _typed(d.get("arch", "llama"), str, f"{where}: model.arch")
    preset = _typed(d.get("preset", "tiny"), str, f"{where}: model.preset")
    seed = _typed(d.get("seed", 0), int, f"{where}: model.seed")
    presets = (registry.get(arch).presets or PRESETS) if arch in ARCHS else PRESETS
    if arch not in ARCHS or preset not in presets:
        raise SuiteError(f"{where}: unknown model {arch}/{preset}; archs: {', '.join(ARCHS)}; "
                         f"presets: {', '.join(presets)}")
    return ModelSpec(arch=arch, preset=preset, seed=seed)


def _workloads(items: Any, base: Path, where: str) -> tuple[SuiteWorkload, ...]:
    from layerscope.regressions.load.workloads import BUILTIN

    if not isinstance(items, list) or not items:
        raise SuiteError(f"{where}: needs at least one [[workloads]] entry")
    out: list[SuiteWorkload] = []
    for i, d in enumerate(items):
        at = f"{where}: workloads[{i}]"
        d = _table(d, at)
        _known(d, _WORKLOAD_KEYS, at)
        if "workload" not in d:
            raise SuiteError(f"{at}: missing key 'workload' (a built-in: {', '.join(BUILTIN)}, or a file)")
        wl = _typed(d["workload"], str, f"{at}.workload")
        if wl not in BUILTIN:
            p = (base / wl).resolve()
            if not p.is_file():
                raise SuiteError(f"{at}: workload file {p} does not exist (built-in workloads: {', '.join(BUILTIN)})")
            if p.suffix.lower() not in (".toml", ".json"):
                raise SuiteError(f"{at}: workload file {p} must be .toml or .json")
            wl = str(p)
        name = _typed(d.get("name", Path(wl).stem if wl not in BUILTIN else wl), str, f"{at}.name")
        if not _is_label(name):
            raise SuiteError(f"{at}: name {name!r} may hold letters, digits, '.', '_' and '-' only")
        if any(w.name == name for w in out):
            raise SuiteError(f"{at}: duplicate workload name {name!r} (give each a distinct name)")
        params = _table(d.get("params", {}), f"{at}.params")
        out.append(SuiteWorkload(name, wl, _typed(d.get("seed", 0), int, f"{at}.seed"), dict(params)))
    return tuple(out)


def _configs(d: Any, where: str) -> dict[str, dict[str, Any]]:
    from layerscope.engine.config import ConfigError, EngineConfig, flatten_config

    d = _table(d, f"{where}: [configs]")
    if not d:
        return {"default": {}}
    out: dict[str, dict[str, Any]] = {}
    for name, overrides in d.items():
        at = f"{where}: configs.{name}"
        if not _is_label(name):
            raise SuiteError(f"{at}: config names may hold letters, digits, '.', '_' and '-' only")
        flat = flatten_config(_table(overrides, at))
        if "model" in flat:
            raise SuiteError(f"{at}: the model is set in [model], not in a config")
        try:
            EngineConfig.from_overrides(**flat)
        except ConfigError as e:
            raise SuiteError(f"{at}: {e}") from None
        out[name] = flat
    return out


def _run(d: Any, where: str) -> RunOptions:
    d = _table(d, f"{where}: [run]")
    _known(d, _RUN_KEYS, f"{where}: [run]")
    probes = _typed(d.get("probes", "default"), str, f"{where}: run.probes")
    if probes not in PROBE_LEVELS:
        raise SuiteError(f"{where}: run.probes must be one of {', '.join(PROBE_LEVELS)}, got {probes!r}")
    replicas = _typed(d.get("replicas", 1), int, f"{where}: run.replicas")
    timeout_s = float(_typed(d.get("timeout_s", 300.0), (int, float), f"{where}: run.timeout_s"))
    if replicas < 1 or timeout_s <= 0:
        raise SuiteError(f"{where}: run.replicas must be >= 1 and run.timeout_s > 0")
    return RunOptions(probes, replicas, timeout_s)


def _slo(d: Any, where: str) -> dict[str, float]:
    return _numbers(d, SLO_KEYS, where, "slo", lambda v: v > 0, "must be > 0 seconds")


def _thresholds(d: Any, where: str) -> dict[str, float]:
    return _numbers(d, METRICS, where, "thresholds", lambda v: v >= 0, "is a percentage >= 0")


def _numbers(d: Any, keys, where: str, section: str, ok: Callable[[float], bool], rule: str) -> dict[str, float]:
    """The ``[section]`` table of ``keys`` -> numbers, each checked by ``ok`` (else: ``section.key rule``)."""
    d = _table(d, f"{where}: [{section}]")
    _known(d, set(keys), f"{where}: [{section}]")
    out = {}
    for k, v in d.items():
        v = float(_typed(v, (int, float), f"{where}: {section}.{k}"))
        if not ok(v):
            raise SuiteError(f"{where}: {section}.{k} {rule}, got {v}")
        out[k] = v
    return out


def _check_workload(w: SuiteWorkload, slo: dict[str, float], where: str) -> None:
    from layerscope.regressions.load.workloads import WorkloadError, load_workload

    overrides = {"seed": w.seed, **w.params, **{f"slo_{k}": v for k, v in slo.items()}}
    try:
        load_workload(w.workload, **overrides)
    except (WorkloadError, TypeError, ValueError) as e:
        raise SuiteError(f"{where}: workload {w.name!r}: {e}") from None


# ---- helpers -------------------------------------------------------------------------------
def _read_workload_file(p: Path) -> dict[str, Any]:
    raw = p.read_bytes()
    try:
        data = tomllib.loads(raw.decode()) if p.suffix.lower() == ".toml" else json.loads(raw)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SuiteError(f"{p}: not a valid workload file ({e})") from None
    if not isinstance(data, dict):
        raise SuiteError(f"{p}: a workload file holds one table")
    return data


def _known(d: dict, known: set[str], where: str) -> None:
    unknown = sorted(set(d) - known)
    if unknown:
        raise SuiteError(f"{where}: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
                         f"known: {', '.join(sorted(known))}")


def _table(d: Any, where: str) -> dict:
    if not isinstance(d, dict):
        raise SuiteError(f"{where}: expected a table, got {type(d).__name__}")
    return d


def _typed(v: Any, typ: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(v, typ) or (isinstance(v, bool) and typ is not bool):
        names = typ.__name__ if isinstance(typ, type) else " or ".join(t.__name__ for t in typ)
        raise SuiteError(f"{where}: expected {names}, got {v!r}")
    return v


def _is_label(s: str) -> bool:
    return bool(s) and all(c.isalnum() or c in "._-" for c in s)
