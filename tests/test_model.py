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
    for length in (1, 33):         # causal: a 33-token sequence's logits cover every shorter prefix's
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
    for arch in (["Qwen3MoeForCausalLM"], ["Qwen3ForSequenceClassification"]):   # model_type "qwen3", another head
        with pytest.raises(ValueError, match=f"architectures=\\['{arch[0]}'\\] is not supported"):
            ModelConfig.from_dict(_base(architectures=arch))
    assert ModelConfig.from_dict(_base(architectures=["Qwen3ForCausalLM"])).vocab_size == 10
    with pytest.raises(ValueError, match="'dynamic' is not supported"):
        ModelConfig.from_dict(_base(rope_scaling={"rope_type": "dynamic", "factor": 4.0}))
    with pytest.raises(ValueError, match="longrope"):
        ModelConfig.from_dict(_base(rope_parameters={"rope_type": "longrope", "rope_theta": 1e6}))
    # old-style (transformers 4) fields are read too
    c = ModelConfig.from_dict(_base(rope_theta=123.0, rope_scaling={"type": "linear", "factor": 2.0}))
    assert c.rope_theta == 123.0 and c.rope_scaling_factor == 2.0
    assert c.rope_scaling == {"rope_type": "linear", "factor": 2.0}       # issue 2's field name, HF's dict
    assert ModelConfig.from_dict(_base()).rope_scaling is None
    with pytest.raises(ValueError, match="num_key_value_heads=3"):
        ModelConfig.from_dict(_base(num_key_value_heads=3))
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        ModelConfig.from_dict(_base(hidden_act="gelu"))
    with pytest.raises(ValueError, match="quant_method='awq'.* not supported"):      # (not "lacks tensor ...")
        ModelConfig.from_dict(_base(quantization_config={"quant_method": "awq", "bits": 4}))
    kv_only = {"quant_method": "compressed-tensors", "config_groups": {}, "kv_cache_scheme": {"num_bits": 8}}
    assert ModelConfig.from_dict(_base(quantization_config=kv_only)).vocab_size == 10    # (weights plain: runs)
    with pytest.raises(ValueError, match="quant_method='compressed-tensors'"):
        ModelConfig.from_dict(_base(quantization_config={**kv_only, "config_groups": {"g0": {"targets": ["Linear"]}}}))
    # transformers' Qwen3 slides layers from max_window_layers on (or those layer_types names): none here, so it runs
    sliding = dict(use_sliding_window=True, sliding_window=8, num_hidden_layers=2)
    assert ModelConfig.from_dict(_base(**sliding, max_window_layers=2)).num_hidden_layers == 2
    assert ModelConfig.from_dict(_base(**sliding)).num_hidden_layers == 2          # (Qwen3Config's default: 28)
    for extra in (dict(max_window_layers=1), dict(layer_types=["full_attention", "sliding_attention"])):
        with pytest.raises(ValueError, match=r"sliding-window attention .* layers \[1\]"):
            ModelConfig.from_dict(_base(**sliding, **extra))
    # a sliding_window left out is Qwen3Config's default (4096), not null: those layers slide, so it is refused
    unset = dict(use_sliding_window=True, num_hidden_layers=2, max_window_layers=0)
    for extra in ({}, dict(layer_types=["sliding_attention"] * 2)):
        with pytest.raises(ValueError, match=r"sliding_window=4096, layers \[0, 1\]"):
            ModelConfig.from_dict(_base(**unset, **extra))
    assert ModelConfig.from_dict(_base(**unset, sliding_window=None)).num_hidden_layers == 2    # (null: full)
    with pytest.raises(ValueError, match="the checkpoint's dtype='int8'"):
        ModelConfig.from_dict(_base(torch_dtype="int8"))
    # fields config.json leaves out take transformers' Qwen3Config defaults (so vLLM's), not hidden / heads
    c = ModelConfig.from_dict({k: v for k, v in _base(hidden_act="silu").items() if k != "head_dim"})
    assert (c.head_dim, c.max_position_embeddings) == (128, 32768)


def test_yarn_fields_as_qwen3_documents_them():
    """Qwen3's model card: rope_scaling {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings":
    32768} for 131,072 tokens. The fields and defaults are transformers'; the longest context is vLLM's."""
    c = ModelConfig.from_dict(_base(max_position_embeddings=40960, rope_theta=1e6, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}))
    assert c.rope_scaling_factor == 4.0 and c.rope_theta == 1e6
    assert c.rope_yarn == (32768, 32.0, 1.0, pytest.approx(0.1 * np.log(4.0) + 1.0), True)
    assert ModelConfig.from_dict(_base(max_position_embeddings=40960, rope_scaling=c.rope_scaling, rope_theta=1e6)) == c
    assert c.max_length == 131072
    assert ModelConfig.from_dict(_base(max_position_embeddings=512)).max_length == 512
    assert ModelConfig.from_dict(_base(max_position_embeddings=512, rope_scaling={
        "type": "linear", "factor": 2.0})).max_length == 1024
    # transformers >= 5's form, with the optional fields given
    c = ModelConfig.from_dict(_base(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0,
                                                     "original_max_position_embeddings": 64, "beta_fast": 16,
                                                     "attention_factor": 1.5, "truncate": False}))
    assert c.rope_yarn == (64, 16.0, 1.0, 1.5, False)
    # a checkpoint written by transformers 5 (rope_parameters) with rope_scaling added by hand: rope_scaling wins
    c = ModelConfig.from_dict(_base(rope_theta=5e5, rope_parameters={"rope_type": "default", "rope_theta": 5e5},
                                    rope_scaling={"rope_type": "yarn", "factor": 2.0,
                                                  "original_max_position_embeddings": 64}))
    assert c.rope_yarn[0] == 64 and c.rope_scaling_factor == 2.0 and c.rope_theta == 5e5
    with pytest.raises(ValueError, match="rope_scaling_factor=0.0"):
        ModelConfig.from_dict(_base(rope_scaling={"rope_type": "linear", "factor": 0.0}))


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}


@pytest.mark.parametrize("rope", [{**YARN, "truncate": False, "beta_fast": 8.0}, {"rope_type": "linear",
                                                                                   "factor": 3.0}])
def test_scaled_rope_logits_match_transformers(tmp_path, rope):
    """YaRN and linear rope against transformers past the original length (32 tokens here), where the
    interpolated frequencies and YaRN's attention factor decide the logits."""
    from helpers import make_tiny_model
    path = make_tiny_model(str(tmp_path / "m"), max_position_embeddings=64, rope_parameters=rope)
    cfg = ModelConfig.from_pretrained(path)
    assert (cfg.rope_yarn != ()) == (rope["rope_type"] == "yarn")
    params = load_params(path, cfg, dtype=jnp.float32)
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, size=90).tolist()
    ours = np.asarray(dense_logits(cfg, params, jnp.array([ids])))[0]
    np.testing.assert_allclose(ours, hf_logits(hf_model(path), ids), atol=1e-4, rtol=1e-4)


def test_bad_rope_fields_name_the_value():
    yarn = {"rope_type": "yarn", "original_max_position_embeddings": 32}
    for rope, word in [({**yarn, "factor": 0}, "factor=0"), ({**yarn, "factor": 2.0,
                        "original_max_position_embeddings": 0}, "original_max_position_embeddings=0"),
                       ({**yarn, "factor": 2.0, "original_max_position_embeddings": -5}, "=-5"),
                       ({**yarn, "factor": 2.0, "original_max_position_embeddings": 32.5}, "=32.5"),
                       ("yarn", "must be a dict"), ([1], "must be a dict")]:
        with pytest.raises(ValueError, match=word):
            ModelConfig.from_dict(_base(max_position_embeddings=64, rope_scaling=rope))
    # attention_factor given as 0.0 is used (as transformers does), not replaced by the default
    c = ModelConfig.from_dict(_base(rope_scaling={**yarn, "factor": 2.0, "attention_factor": 0.0}))
    assert c.rope_yarn[3] == 0.0
    # a top-level original_max_position_embeddings wins over rope_scaling's, as in transformers
    c = ModelConfig.from_dict(_base(original_max_position_embeddings=16, rope_scaling={**yarn, "factor": 2.0}))
    assert c.rope_yarn[0] == 16 and c.max_length == 32
    # a whole number written as a float (64.0) is read as the int, as transformers reads it
    c = ModelConfig.from_dict(_base(rope_scaling={**yarn, "factor": 2.0, "original_max_position_embeddings": 64.0}))
    assert c.rope_yarn[0] == 64 and type(c.rope_yarn[0]) is int and c.max_length == 128
    for key, bad in (("num_hidden_layers", True), ("head_dim", 0)):
        with pytest.raises(ValueError, match=f"{key}={bad!r}"):
            ModelConfig.from_dict(_base(**{key: bad}))
