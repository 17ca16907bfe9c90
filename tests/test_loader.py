"""Loader: sharded and bf16 checkpoints, clear errors for broken files; presets without allocation."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import make_tiny_model

from jaxinfer.config import ModelConfig
from jaxinfer.model.loader import load_params
from jaxinfer.model.presets import PRESETS, preset
from jaxinfer.model.qwen3 import init_params


def _leaves(p):
    return {jax.tree_util.keystr(k): np.asarray(v, np.float32) for k, v in jax.tree_util.tree_leaves_with_path(p)}


def test_sharded_and_bf16_load_same_params(tmp_path):
    single = make_tiny_model(str(tmp_path / "single"), seed=3)
    sharded = make_tiny_model(str(tmp_path / "sharded"), seed=3, max_shard_size="100KB")
    bf16 = make_tiny_model(str(tmp_path / "bf16"), seed=3, dtype="bfloat16")
    assert os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
    a = _leaves(load_params(single, dtype=jnp.float32))
    b = _leaves(load_params(sharded, dtype=jnp.float32))
    c = _leaves(load_params(bf16, dtype=jnp.float32))
    d = load_params(single, dtype=jnp.bfloat16)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(d))
    assert a.keys() == b.keys() == c.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
        np.testing.assert_allclose(a[k], c[k], rtol=1e-2, atol=1e-2, err_msg=k)


def test_float64_checkpoint_runs_as_float32(tmp_path):
    """A float64 checkpoint (config dtype "float64") loads: "auto" runs it as float32, its weights cast."""
    from safetensors.numpy import load_file
    f64 = make_tiny_model(str(tmp_path / "f64"), seed=3, dtype="float64")
    assert ModelConfig.from_pretrained(f64).torch_dtype == "float32"
    stored = load_file(os.path.join(f64, "model.safetensors"))["model.embed_tokens.weight"]
    assert stored.dtype == np.float64
    np.testing.assert_array_equal(load_params(f64, dtype=jnp.float32)["embed_tokens"], stored.astype(np.float32))
    from jaxinfer import LLM, SamplingParams
    llm = LLM(f64, max_model_len=64, warmup=False)
    assert llm.engine.config.dtype == "float32"
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.fixture
def ckpt(tmp_path):
    return make_tiny_model(str(tmp_path / "m"))


def test_missing_config(ckpt):
    os.remove(os.path.join(ckpt, "config.json"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_pretrained(ckpt)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ModelConfig.from_pretrained(ckpt + "-nope")


def test_generation_config_eos_ids_end_generation(ckpt):
    """generation_config.json's eos_token_id replace config.json's (as in HF's generate and vLLM, which read
    config.json's only without one): Qwen3 lists <|endoftext|> only there. A broken one is a ValueError naming it at
    LLM() (not with generation_config="vllm")."""
    from helpers import TINY_ENGINE

    from jaxinfer import LLM, SamplingParams
    free = LLM(ckpt, **TINY_ENGINE).generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                             use_tqdm=False)[0].token_ids
    own = ModelConfig.from_pretrained(ckpt).eos_token_id
    with open(os.path.join(ckpt, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [free[3], *own]}, f)
    eos = ModelConfig.from_pretrained(ckpt).eos_token_id
    assert eos == tuple(dict.fromkeys([free[3], *own]))
    with open(os.path.join(ckpt, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": free[3]}, f)
    assert ModelConfig.from_pretrained(ckpt).eos_token_id == (free[3],)                   # config.json's: not used
    assert ModelConfig.from_pretrained(ckpt, {"eos_token_id": 9}).eos_token_id == (9, free[3])   # an override's: kept
    with open(os.path.join(ckpt, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [free[3], *own]}, f)
    out = LLM(ckpt, **TINY_ENGINE).generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=12),
                                            use_tqdm=False)[0]
    end = next(i for i, t in enumerate(free) if t in eos)
    assert out.token_ids == free[:end + 1] and out.finish_reason == "stop"
    with open(os.path.join(ckpt, "generation_config.json"), "w") as f:
        f.write("{not json")
    assert ModelConfig.from_pretrained(ckpt).eos_token_id == own          # (its EOS ids lost, nothing else)
    with pytest.raises(ValueError, match="generation_config.json"):       # LLM's sampling defaults name it
        LLM(ckpt, **TINY_ENGINE)


def test_the_tokenizers_eos_ends_generation_beside_the_configs(ckpt):
    """As vLLM: the tokenizer's EOS ends a request (stop_reason None) even when config.json names other EOS ids
    (a fine-tune without generation_config.json; LLM(..., tokenizer=OTHER)), and those end it too, with their
    id as stop_reason (vLLM adds them as stop ids)."""
    from helpers import TINY_ENGINE
    from transformers import AutoTokenizer

    from jaxinfer import LLM, SamplingParams
    greedy = dict(temperature=0, max_tokens=12)
    free = LLM(ckpt, **TINY_ENGINE).generate([[5, 6, 7]], SamplingParams(**greedy, ignore_eos=True),
                                             use_tqdm=False)[0].token_ids
    tok = AutoTokenizer.from_pretrained(ckpt)
    a, b = free[3], next(t for t in free[5:] if t not in free[:4])
    tok.eos_token = tok.convert_ids_to_tokens(a)
    tok.save_pretrained(ckpt)
    os.remove(os.path.join(ckpt, "generation_config.json"))
    with open(os.path.join(ckpt, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(ckpt, "config.json"), "w") as f:
        json.dump({**cfg, "eos_token_id": b}, f)
    llm = LLM(ckpt, **TINY_ENGINE)
    assert llm.get_tokenizer().eos_token_id == a
    out = llm.generate([[5, 6, 7]], SamplingParams(**greedy), use_tqdm=False)[0].outputs[0]
    assert (out.token_ids, out.finish_reason, out.stop_reason) == (free[:free.index(a) + 1], "stop", None)
    later = free.index(a) + 1                  # from just after the tokenizer's EOS: the config's id ends it
    out = llm.generate([[5, 6, 7] + free[:later]], SamplingParams(**greedy), use_tqdm=False)[0].outputs[0]
    rest = free[later:]
    assert b in rest and a not in rest[:rest.index(b)]
    assert (out.token_ids, out.finish_reason, out.stop_reason) == (rest[:rest.index(b) + 1], "stop", b)


def test_missing_weights_file(ckpt):
    os.remove(os.path.join(ckpt, "model.safetensors"))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_params(ckpt)
    open(os.path.join(ckpt, "pytorch_model.bin"), "wb").close()        # (vLLM reads these; the message says why not)
    with pytest.raises(FileNotFoundError, match="found pytorch_model.bin: jaxinfer reads safetensors only"):
        load_params(ckpt)


def test_missing_shard(tmp_path):
    path = make_tiny_model(str(tmp_path / "s"), max_shard_size="100KB")
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        shard = sorted(set(json.load(f)["weight_map"].values()))[-1]
    os.remove(os.path.join(path, shard))
    with pytest.raises(FileNotFoundError, match=shard):
        load_params(path)


def _rewrite(path, mutate):
    """Rewrite model.safetensors after `mutate(header_dict, tensors_bytes)`."""
    from jaxinfer.model.loader import SafetensorsFile
    f = os.path.join(path, "model.safetensors")
    st = SafetensorsFile(f)
    header = dict(st.header)
    with open(f, "rb") as fh:
        fh.seek(st.data_start)
        data = fh.read()
    header, data = mutate(header, data)
    raw = json.dumps(header).encode()
    with open(f, "wb") as fh:
        fh.write(len(raw).to_bytes(8, "little") + raw + data)


def test_broken_index(tmp_path):
    """A sharded checkpoint's index that is not JSON, has no weight_map, or names the wrong shard for a tensor:
    ValueErrors naming the file and the tensor."""
    path = make_tiny_model(str(tmp_path / "s"), max_shard_size="100KB")
    index = os.path.join(path, "model.safetensors.index.json")
    with open(index) as f:
        good = json.load(f)
    shards = sorted(set(good["weight_map"].values()))
    wrong = {**good, "weight_map": {**good["weight_map"], "model.norm.weight": next(
        s for s in shards if s != good["weight_map"]["model.norm.weight"])}}
    for content, match in (("{not json", "not valid JSON"), (json.dumps({"metadata": {}}), "no 'weight_map'"),
                           (json.dumps(wrong), "'model.norm.weight' is not in"),
                           (json.dumps({"weight_map": {"model.norm.weight": 5}}), "no 'weight_map'")):
        with open(index, "w") as f:
            f.write(content)
        with pytest.raises(ValueError, match=match):
            load_params(path, dtype=jnp.float32)


def test_missing_tensor(ckpt):
    name = "model.layers.1.mlp.up_proj.weight"
    _rewrite(ckpt, lambda h, d: ({k: v for k, v in h.items() if k != name}, d))
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        load_params(ckpt)


def test_wrong_shape(ckpt):
    cfg = json.load(open(os.path.join(ckpt, "config.json")))
    cfg["head_dim"] = 16   # q_proj in the file is [4*32, 64]; config now says [4*16, 64]
    json.dump(cfg, open(os.path.join(ckpt, "config.json"), "w"))
    with pytest.raises(ValueError, match=r"q_proj.weight.*shape \(128, 64\), expected \(64, 64\)"):
        load_params(ckpt)


def test_truncated_file(ckpt):
    f = os.path.join(ckpt, "model.safetensors")
    size = os.path.getsize(f)
    with open(f, "r+b") as fh:
        fh.truncate(size - 1000)
    with pytest.raises(ValueError, match="truncated"):
        load_params(ckpt)


def test_corrupt_header(ckpt):
    f = os.path.join(ckpt, "model.safetensors")
    with open(f, "r+b") as fh:
        fh.seek(8)
        fh.write(b"\xff\xfe garbage")
    with pytest.raises(ValueError, match="corrupt"):
        load_params(ckpt)
    with open(f, "wb") as fh:
        fh.write(b"abc")
    with pytest.raises(ValueError, match="truncated or not a safetensors"):
        load_params(ckpt)


def test_preset_parameter_counts_without_allocating():
    cfg = preset("qwen3-0.6b")
    shapes = jax.eval_shape(lambda: init_params(cfg, jnp.bfloat16))
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))
    assert n == cfg.num_params()
    assert 0.59e9 < n < 0.60e9             # Qwen3-0.6B: 0.596B with tied embeddings
    assert "lm_head" not in shapes
    assert 8.1e9 < preset("Qwen/Qwen3-8B").num_params() < 8.3e9
    assert len(PRESETS) == 6
    with pytest.raises(ValueError, match="qwen3-7b"):
        preset("qwen3-7b")


def test_random_init_is_finite_in_bf16():
    from jaxinfer.model.qwen3 import dense_logits
    cfg = preset("qwen3-0.6b")
    small = ModelConfig(**{**cfg.__dict__, "num_hidden_layers": 2, "vocab_size": 1000})
    from jaxinfer.model.loader import random_params             # (a preset's weights, as LLM() draws them)
    logits_of = jax.jit(lambda params: dense_logits(small, params, jnp.arange(16)[None]))   # (one compile)
    for params in (init_params(small, jnp.bfloat16), random_params(small, jnp.bfloat16)):
        logits = logits_of(params)
        assert bool(jnp.all(jnp.isfinite(logits))) and float(jnp.abs(logits).max()) < 100


BAD_HEADERS = [{"w": {"dtype": "F32", "shape": [4]}}, {"w": {"dtype": "F32", "data_offsets": [0, 16]}},
               {"w": [0, 16]}, [{"w": {}}]]


@pytest.mark.parametrize("header", BAD_HEADERS)
def test_malformed_safetensors_header_is_a_value_error(tmp_path, header):
    """A header whose entries lack shape / data_offsets, or that is not an object of objects: a ValueError naming
    the file, not a KeyError / AttributeError from inside the loader."""
    import json
    import struct

    from jaxinfer.model.loader import SafetensorsFile
    path, h = tmp_path / "model.safetensors", json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"\0" * 256)
    with pytest.raises(ValueError, match="corrupt"):
        SafetensorsFile(str(path)).get("w")
