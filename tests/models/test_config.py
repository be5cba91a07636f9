"""Reading HF configs: transformers 4.x and 5.x shapes, config objects and dicts, bad values."""

from __future__ import annotations

import pytest
import transformers

from torch_kvq.models import tiny_gemma3_config, tiny_llama_config
from torch_kvq.models.config import RopeSpec, read_config


def _without(cfg: dict, *keys: str) -> dict:
    return {k: v for k, v in cfg.items() if k not in keys}


def test_gemma3_4x_and_5x_shapes_read_the_same():
    five = tiny_gemma3_config(
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        }
    )
    four = _without(tiny_gemma3_config(), "rope_parameters", "layer_types")
    four.update(
        sliding_window_pattern=3,
        rope_theta=1e6,
        rope_local_base_freq=1e4,
        rope_scaling={"type": "linear", "factor": 8.0},
    )
    a, b = read_config(five, "gemma3"), read_config(four, "gemma3")
    assert a == b
    assert a.rope == {"full_attention": RopeSpec(1e6, 8.0), "sliding_attention": RopeSpec(1e4)}
    assert a.layer_types == ("sliding_attention", "sliding_attention", "full_attention") * 2
    assert a.sm_scale == 48**-0.5 and a.sliding_window == 8 and a.tie_word_embeddings


def test_llama_4x_and_5x_shapes_read_the_same():
    five = tiny_llama_config(rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    four = _without(tiny_llama_config(), "rope_parameters")
    four["rope_theta"] = 5e5
    assert read_config(five, "llama") == read_config(four, "llama")
    assert read_config(five, "llama").rope == {"full_attention": RopeSpec(5e5)}


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_transformers_config_object_reads_like_its_dict(arch):
    d = tiny_llama_config() if arch == "llama" else tiny_gemma3_config()
    cls = transformers.LlamaConfig if arch == "llama" else transformers.Gemma3TextConfig
    assert read_config(cls(**d), arch) == read_config(d, arch)


@pytest.mark.parametrize(
    "arch, overrides, message",
    [
        ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "'yarn'"),
        ("llama", {"hidden_act": "relu"}, "'relu'"),
        ("llama", {"num_key_value_heads": 3}, "multiple of num_key_value_heads 3"),
        ("llama", {"hidden_size": 0}, "hidden_size must be a positive int"),
        ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ("gemma3", {"layer_types": ["full_attention"] * 5}, "must list 6 entries"),
        ("gemma3", {"layer_types": ["local"] * 6}, "must list 6 entries"),
        ("gemma3", {"sliding_window": None}, "sliding_window must be a positive int"),
        ("gemma3", {"final_logit_softcapping": -1.0}, "final_logit_softcapping"),
    ],
)
def test_bad_configs_name_the_value(arch, overrides, message):
    d = (tiny_llama_config if arch == "llama" else tiny_gemma3_config)(**overrides)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        read_config(d, arch)


def test_missing_key_and_unknown_arch():
    with pytest.raises(ValueError, match="no 'num_hidden_layers'"):
        read_config(_without(tiny_llama_config(), "num_hidden_layers"), "llama")
    with pytest.raises(ValueError, match="unknown arch 'mistral'"):
        read_config(tiny_llama_config(), "mistral")
