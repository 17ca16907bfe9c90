"""The dense Flax forward equals HF transformers' Qwen3ForCausalLM (fp32, CPU)."""
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TINY_CONFIGS, hf_logits, hf_model

from jaxinfer.config import ModelConfig
from jaxinfer.model.loader import load_params
from jaxinfer.model.qwen3 import dense_logits


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_logits_match_transformers(tiny_dirs, name):
    path = tiny_dirs[name]
    cfg = ModelConfig.from_pretrained(path)
    assert cfg.head_dim == TINY_CONFIGS[name]["head_dim"]
    params = load_params(path, cfg, dtype=jnp.float32)
    ref = hf_model(path)
    rng = np.random.default_rng(0)
    for length in (1, 7, 33):
        ids = rng.integers(0, cfg.vocab_size, size=length).tolist()
        ours = np.asarray(dense_logits(cfg, params, jnp.array([ids])))[0]
        np.testing.assert_allclose(ours, hf_logits(ref, ids), atol=1e-4, rtol=1e-4)


def test_config_reads_fields(tiny_dirs):
    cfg = ModelConfig.from_pretrained(tiny_dirs["gqa4_wide_head"])
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (8, 2, 24)
    assert cfg.hidden_size == 48 and cfg.rope_theta == 500.0 and cfg.num_hidden_layers == 3
    assert not cfg.tie_word_embeddings and cfg.torch_dtype == "float32"
    assert ModelConfig.from_pretrained(tiny_dirs["gqa1_tied"]).tie_word_embeddings


def _base(**kw):
    d = dict(model_type="qwen3", vocab_size=10, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
             num_attention_heads=2, num_key_value_heads=1, head_dim=4)
    d.update(kw)
    return d


def test_config_refuses_other_models_and_rope_kinds():
    with pytest.raises(ValueError, match="llama"):
        ModelConfig.from_dict(_base(model_type="llama"))
    with pytest.raises(ValueError, match="yarn"):
        ModelConfig.from_dict(_base(rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    with pytest.raises(ValueError, match="yarn"):
        ModelConfig.from_dict(_base(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6}))
    # old-style (transformers 4) fields are read too
    c = ModelConfig.from_dict(_base(rope_theta=123.0, rope_scaling={"type": "linear", "factor": 2.0}))
    assert c.rope_theta == 123.0 and c.rope_scaling_factor == 2.0
    with pytest.raises(ValueError, match="num_key_value_heads=3"):
        ModelConfig.from_dict(_base(num_key_value_heads=3))
