"""The architecture registry: one entry per architecture, read by the loader, model create and the CLI."""

from __future__ import annotations

import subprocess
import sys

import pytest

from layerscope.engine.models import registry


def test_every_entry_is_loadable_and_named_once():
    assert registry.names() == ("llama", "qwen2", "qwen3")
    assert len(set(registry.hf_classes())) == len(registry.hf_classes())
    for a in registry.ARCHITECTURES:
        assert registry.get(a.name) is a
        for c in a.hf_classes:
            assert registry.for_hf_class(c) is a
        assert callable(a.model_cls())


def test_unknown_names_list_what_exists():
    with pytest.raises(registry.UnknownArchitecture, match="supported archs: llama, qwen2, qwen3"):
        registry.get("mistral")
    with pytest.raises(ValueError, match="Qwen2ForCausalLM"):
        registry.for_hf_class("MistralForCausalLM")


def test_native_decode_is_off_where_the_native_stack_lacks_a_feature():
    # decode_layers (kernels/csrc) has no q/k norm
    assert {a.name: a.native_decode for a in registry.ARCHITECTURES} == {"llama": True, "qwen2": True, "qwen3": False}
    assert all(not a.native_decode for a in registry.ARCHITECTURES if a.qk_norm)


def test_registry_import_is_torch_free():
    code = "import sys, layerscope.engine.models.registry; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_readers_take_the_registry(tmp_path):
    from layerscope.cli import build_parser
    from layerscope.engine.models.llama import ModelSpec

    # the spec takes qkv_bias/qk_norm from the entry, whatever config.json says
    cfg = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 8, "hidden_size": 8, "intermediate_size": 16,
           "num_hidden_layers": 1, "num_attention_heads": 2, "attention_bias": False}
    spec = ModelSpec.from_hf_config(cfg)
    assert spec.attention_bias and not spec.qk_norm
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        ModelSpec.from_hf_config({**cfg, "architectures": ["GPT2LMHeadModel"]})
    args = build_parser().parse_args(["model", "create", str(tmp_path), "--arch", "qwen3"])
    assert args.arch == "qwen3"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["model", "create", str(tmp_path), "--arch", "gpt2"])
