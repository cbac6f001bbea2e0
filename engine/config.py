"""Engine and gateway configuration: one frozen, typed record, validated on construction.

Every key carries a docstring (the ``doc`` metadata) and the layer of DESIGN.md's
taxonomy it acts on (``layer`` metadata), so a config diff can say which layer a
change can move. Each key's layer and default come from ``layerscope.contract.CONFIG_KEYS``,
the one table diagnose reads as well (diagnose never imports the engine). Values derived at start-up (KV blocks that fit, head dims) live in
``ResolvedConfig``, never in ``EngineConfig``.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from layerscope.contract import CONFIG_KEYS, flatten_config  # noqa: F401  (flatten_config: re-exported)


class ConfigError(ValueError):
    """A configuration key or value is invalid."""


def _f(key: str, doc: str) -> Any:
    """A config field whose default and layer come from ``layerscope.contract.CONFIG_KEYS`` (one
    table: diagnose reads the same one, and never imports the engine)."""
    layer, default = CONFIG_KEYS[key]
    return field(default=default, metadata={"layer": layer, "doc": doc})


@dataclass(frozen=True)
class GatewayConfig:
    max_concurrency: int = _f("gateway.max_concurrency", "Requests admitted to the engines at once; the rest wait in the admission queue.")
    max_queue: int = _f("gateway.max_queue", "Requests allowed to wait for admission; beyond it the gateway answers 429.")
    retry_after_s: int = _f("gateway.retry_after_s", "Value of the Retry-After header on 429 answers, in seconds.")
    request_timeout_s: float = _f("gateway.request_timeout_s", "Upper bound on one request's life at the gateway, in seconds.")

    def validate(self) -> None:
        _positive(self, "max_concurrency", prefix="gateway.")
        if self.max_queue < 0:
            raise ConfigError(f"gateway.max_queue must be >= 0, got {self.max_queue}")
        if self.request_timeout_s <= 0:
            raise ConfigError(f"gateway.request_timeout_s must be > 0, got {self.request_timeout_s}")


@dataclass(frozen=True)
class EngineConfig:
    """The whole engine + gateway configuration. Immutable after construction."""

    model: str = _f("model", "Path to a Hugging Face-format checkpoint directory.")
    dtype: str = _f("dtype", "Weights and activations dtype: auto (checkpoint's), float32, bfloat16, float16.")
    max_model_len: int = _f("max_model_len", "Longest prompt + output in tokens; 0 means the model's max_position_embeddings.")
    max_num_seqs: int = _f("max_num_seqs", "Most requests running (scheduled) at once.")
    max_num_batched_tokens: int = _f("max_num_batched_tokens", "Token budget of one engine step (prefill chunks + decodes).")
    enable_chunked_prefill: bool = _f("enable_chunked_prefill", "Split long prefills into chunks that share steps with decodes.")
    enable_prefix_caching: bool = _f("enable_prefix_caching", "Reuse KV blocks of identical prompt prefixes (chained block hashes).")
    block_size: int = _f("block_size", "Tokens per KV-cache block.")
    num_kv_blocks: int = _f("num_kv_blocks", "KV-cache blocks in the pool; 0 means derive from kv_cache_memory_bytes.")
    kv_cache_memory_bytes: int = _f("kv_cache_memory_bytes", "Memory budget for the KV cache when num_kv_blocks is 0, in bytes.")
    preemption_mode: str = _f("preemption_mode", "What preemption does to a victim's KV: recompute (free blocks, prefill again later).")
    kernel_backend: str = _f("kernel_backend", "Kernel implementation: auto (triton on CUDA; on CPU cpu when a C compiler is present, else torch; in bf16/fp16 each linear and attention op then takes the fastest of native, oneDNN/AMX and torch as measured at load, cached per machine: resolved.kernels), torch (reference ops), triton, cpu (native C kernels, CPU only).")
    enforce_eager: bool = _f("enforce_eager", "Run every step op by op from Python. Off: on the cpu kernel backend (bfloat16, one rank) decode-only steps run the decoder layers in one native call (the same kernels, bit-identical outputs, without the host work between them); timed, profiled and fault-injected steps always run op by op.")
    weight_prepack: bool = _f("weight_prepack", "CPU, bfloat16/float16: pack linear weights once into oneDNN's blocked layout at load (same outputs, faster small-batch GEMMs, a second copy of those weights).")
    device: str = _f("device", "Device: auto (cuda when available), cpu, cuda.")
    tp_size: int = _f("tp_size", "Tensor-parallel ranks.")
    tp_timeout_s: float = _f("tp_timeout_s", "A TP worker that does not answer within this many seconds is an error.")
    seed: int = _f("seed", "Seed of the engine's default random generator (per-request seeds override it).")
    num_threads: int = _f("num_threads", "torch intra-op threads on CPU; 0 leaves torch's default.")
    layer_timing_interval: int = _f("layer_timing_interval", "Time each layer's forward on every Nth step (probes); 0 disables.")
    router_policy: str = _f("router_policy", "Replica choice: round_robin, least_loaded, prefix_affinity.")
    gateway: GatewayConfig = field(default_factory=GatewayConfig, metadata={"layer": "gateway.queue", "doc": "Gateway settings."})

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "tp_size"):
            _positive(self, name)
        for name in ("max_model_len", "num_kv_blocks", "kv_cache_memory_bytes", "num_threads", "layer_timing_interval", "seed"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        _choice(self, "dtype", ("auto", "float32", "bfloat16", "float16"))
        _choice(self, "preemption_mode", ("recompute",))
        _choice(self, "kernel_backend", ("auto", "torch", "triton", "cpu"))
        _choice(self, "device", ("auto", "cpu", "cuda"))
        _choice(self, "router_policy", ("round_robin", "least_loaded", "prefix_affinity"))
        if self.tp_timeout_s <= 0:
            raise ConfigError(f"tp_timeout_s must be > 0, got {self.tp_timeout_s}")
        if self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if not isinstance(self.gateway, GatewayConfig):
            raise ConfigError("gateway must be a GatewayConfig")
        self.gateway.validate()

    # ---- construction from typed overrides / command-line text ------------------------------
    @classmethod
    def from_overrides(cls, base: "EngineConfig | None" = None, **overrides: Any) -> "EngineConfig":
        """Return a config with ``overrides`` applied (keys may be ``gateway.x``), values typed as the
        fields are (``parse_set_args`` turns command-line text into them).

        An unknown key, or a value of the wrong type, raises ConfigError naming the known keys or the type.
        """
        base = base or cls()
        top: dict[str, Any] = {}
        gw: dict[str, Any] = {}
        for key, value in overrides.items():
            f = _field(key)
            _check_type(f, value, key)
            (gw if key.startswith("gateway.") else top)[f.name] = value
        if gw:
            top["gateway"] = dataclasses.replace(base.gateway, **gw)
        return dataclasses.replace(base, **top)

    @classmethod
    def parse_overrides(cls, text: Mapping[str, str]) -> dict[str, Any]:
        """``key -> value text`` (``--set``) as ``key -> typed value``, each parsed to its field's type."""
        return {key: _parse(_field(key), value, key) for key, value in text.items()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "EngineConfig":
        flat = dict(data)
        gw = flat.pop("gateway", {}) or {}
        flat.update({f"gateway.{k}": v for k, v in gw.items()})
        return cls.from_overrides(**flat)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def parse_set_args(items: list[str] | None) -> dict[str, Any]:
    """``--set KEY=VALUE`` items as typed overrides, checked by the config where the command line is
    read: each key one of its fields, each value parsed to that field's type, and the config they
    make valid (bounds, choices). Later hops (``api.run``, ``build_gateway``, ``LLM``) take them typed."""
    text: dict[str, str] = {}
    for item in items or []:
        if "=" not in item:
            raise ConfigError(f"--set expects KEY=VALUE, got {item!r}; keys: {', '.join(sorted(config_keys()))}")
        k, v = item.split("=", 1)
        text[k.strip()] = v.strip()
    overrides = EngineConfig.parse_overrides(text)
    EngineConfig.from_overrides(**overrides)  # bounds and choices, before anything is built
    return overrides


def config_keys() -> dict[str, dict[str, str]]:
    """Every config key (``gateway.x`` for gateway keys) with its layer and doc."""
    out: dict[str, dict[str, str]] = {}
    for f in fields(EngineConfig):
        if f.name == "gateway":
            continue
        out[f.name] = {"layer": f.metadata["layer"], "doc": f.metadata["doc"]}
    for f in fields(GatewayConfig):
        out[f"gateway.{f.name}"] = {"layer": f.metadata["layer"], "doc": f.metadata["doc"]}
    return out


@dataclass(frozen=True)
class ResolvedConfig:
    """Values the engine derives at start-up; recorded beside the config in the manifest."""

    architecture: str
    dtype: str
    device: str
    kernel_backend: str
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    kv_cache_bytes: int
    num_parameters: int
    # kernel_backend=auto on CPU: each op's measured choice and timings (kernels/choose.py), taken
    # from the model the engine built just before this (its build records it)
    kernels: dict[str, Any] = dataclasses.field(default_factory=lambda: _kernel_record())

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---- helpers ------------------------------------------------------------------------------
def _kernel_record() -> dict[str, Any]:
    from layerscope.kernels.choose import latest

    return latest()


def _unknown_key(key: str) -> str:
    keys = sorted(config_keys())
    close = difflib.get_close_matches(key, keys, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return f"unknown config key {key!r}{hint}; known: {', '.join(keys)}"


def _positive(obj: Any, name: str, prefix: str = "") -> None:
    value = getattr(obj, name)
    if value <= 0:
        raise ConfigError(f"{prefix}{name} must be > 0, got {value}")


def _choice(obj: Any, name: str, choices: tuple[str, ...]) -> None:
    value = getattr(obj, name)
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def _field(key: str) -> dataclasses.Field:
    """The dataclass field of config key ``key`` (``gateway.x``: GatewayConfig's ``x``)."""
    owner, name = (GatewayConfig, key.split(".", 1)[1]) if key.startswith("gateway.") else (EngineConfig, key)
    for f in fields(owner):
        if f.name == name and f.name != "gateway":
            return f
    raise ConfigError(_unknown_key(key))


_TYPES: dict[str, tuple[type, ...]] = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,)}


def _check_type(f: dataclasses.Field, value: Any, key: str) -> None:
    expected = _TYPES[f.type]
    if not isinstance(value, expected) or (isinstance(value, bool) and bool not in expected):
        hint = "; command-line text goes through parse_set_args" if isinstance(value, str) else ""
        raise ConfigError(f"config key {key!r} expects {f.type}, got {value!r} ({type(value).__name__}){hint}")


def _parse(f: dataclasses.Field, text: str, key: str) -> Any:
    """``text`` as the type of field ``f``; ConfigError says what the key expects."""
    if f.type == "bool":
        low = text.lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"config key {key!r} expects bool (true/false, 1/0, yes/no, on/off), got {text!r}")
    try:
        return {"int": int, "float": float, "str": str}[f.type](text)
    except ValueError:
        raise ConfigError(f"config key {key!r} expects {f.type}, got {text!r} ({f.metadata['doc']})") from None
