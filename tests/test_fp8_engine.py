"""FP8 KV cache end to end on CPU (tiny fp32 checkpoints): kv_cache_dtype option, pool size, scales (checkpoint or
weight bound), logits and greedy tokens against the full-precision cache, both backends, every block returned."""
import argparse
import os

import numpy as np
import jax
import jax.numpy as jnp
import pytest
from helpers import TINY_ENGINE

from jaxinfer import LLM, SamplingParams
from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.engine.memory import kv_bytes_per_block, num_blocks_for_memory
from jaxinfer.model.kv_scales import bound_amax, calibrated_amax, kv_cache_dtype
from jaxinfer.model.loader import load_params
from jaxinfer.model.qwen3 import dense_logits
from jaxinfer.parallel.layout import map_params, to_tp
from pallas_kernels.quant import BYTES_DTYPE, FP8_DTYPE, PAIRS_DTYPE
from scripts.fp8_accuracy import compare, paged_logits

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
FP8 = {**TINY_ENGINE, "kv_cache_dtype": "fp8"}
PALLAS = {"attn_backend": "pallas", "block_size": 16, "num_kvcache_blocks": 64}


def prompts(vocab, lengths, seed=3):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


def tokens(llm, ps):
    outs = llm.generate(ps, GREEDY, use_tqdm=False)
    st = llm.stats()
    assert st["kv_blocks_free"] == st["kv_blocks_total"], "every KV block must return"
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def full(tiny_dir):
    ps = prompts(512, [4, 9, 17, 30, 41, 60])
    return ps, tokens(LLM(tiny_dir, **TINY_ENGINE), ps)


@pytest.fixture(scope="module")
def fp8_xla(tiny_dir, full):
    llm = LLM(tiny_dir, **FP8, attn_backend="xla")             # (named: a GPU's default is pallas)
    return llm, tokens(llm, full[0])


def test_fp8_cache_tokens_agree_but_at_near_ties(tiny_dir, fp8_xla, full):
    """Greedy tokens of the fp8 cache equal the fp32 cache's until a position where the fp32 logits nearly tie:
    there the token fp8 picked must be within 0.2 of the best fp32 logit (logit RMS ~0.8; the fp8 logit error
    is ~3% of it). Random tiny models have such near ties often (seen: flips at gaps 0.005-0.12), so agreement
    is measured on trained models by scripts/fp8_accuracy.py; this checks that every difference is a tie."""
    llm, got = fp8_xla
    st = llm.stats()
    assert st["kv_cache_dtype"] == "float8_e4m3fn" and st["kv_blocks_total"] > 0
    k_cache, v_cache = llm.engine.runner.kv_caches[0]
    assert k_cache.dtype == v_cache.dtype == (BYTES_DTYPE if llm.engine.runner.interpret else FP8_DTYPE)  # (CPU: bytes)
    config = ModelConfig.from_pretrained(tiny_dir)
    params = load_params(tiny_dir, config, jnp.float32)
    logits_of = jax.jit(lambda ids: dense_logits(config, params, ids))      # one shape: causal, so padding after
    (ps, ref), same = full, 0                                                 # the prefix changes nothing
    for p, a, b in zip(ps, ref, got):
        i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if i is None:
            same += 1
            continue
        prefix = p + a[:i]
        logits = np.asarray(logits_of(jnp.asarray([prefix + [0] * (80 - len(prefix))])))[0, len(prefix) - 1]
        assert logits[a[i]] == logits.max() and logits.max() - logits[b[i]] < 0.2, (i, logits.max() - logits[b[i]])
    assert same or any(a[:2] == b[:2] for a, b in zip(ref, got)), "no request agrees at all"


def test_pallas_fp8_equals_xla_fp8(tiny_dir, fp8_xla, full):
    """Both backends quantise the same values the same way: the Pallas kernels (prefill, and the decode kernel
    that quantises the new token itself) give the xla backend's greedy tokens on the fp8 cache."""
    llm = LLM(tiny_dir, **{**FP8, **PALLAS})
    assert llm.stats()["kv_cache_dtype"] == "float8_e4m3fn"
    k_cache, v_cache = llm.engine.runner.kv_caches[0]       # V pages in pairs: the same bytes as fp8 [..., D]
    assert k_cache.dtype == FP8_DTYPE and v_cache.dtype == PAIRS_DTYPE and v_cache.shape[-1] * 2 == k_cache.shape[-1]
    assert tokens(llm, full[0][:4]) == fp8_xla[1][:4]


def test_plain_and_paired_v_pages_do_not_share_executables(tiny_dir, monkeypatch):
    """The shared executable cache keys on the cache arrays' layout: an engine with plain fp8 V pages (the
    A/B's switch) after one with pairs, in one process, compiles its own steps and gives the same tokens."""
    import jaxinfer.model.attention as attention
    ps = prompts(512, [9, 20], seed=1)
    paired = tokens(LLM(tiny_dir, **{**FP8, **PALLAS}), ps)
    monkeypatch.setattr(attention, "PAIRS_MIN_HEAD_DIM", 10**6)       # no pairs at any head_dim
    llm = LLM(tiny_dir, **{**FP8, **PALLAS})
    assert llm.engine.runner.kv_caches[0][1].dtype == FP8_DTYPE
    assert tokens(llm, ps) == paired


@pytest.mark.parametrize("name", ["gqa4_wide_head"])
def test_fp8_logits_within_bound(tiny_dirs, name):
    """Teacher-forced logits through the paged fp8 cache (chunked prefill, scales from the weight bound) against
    the fp32 cache: mean |error| under 8% of the logits' RMS (seen: 2-4%), mean KL under 5e-3 (seen ~1e-3)."""
    config = ModelConfig.from_pretrained(tiny_dirs[name])
    params = load_params(tiny_dirs[name], config, jnp.float32)
    ids = np.random.default_rng(0).integers(0, config.vocab_size, 80).astype(np.int32)
    ref = paged_logits(config, params, ids, jnp.float32, "xla", chunk=32)
    got = paged_logits(config, params, ids, FP8_DTYPE, "xla", chunk=32)
    r = compare(ref, got, ids)
    assert 0 < r["rel_mean_err"] < 0.08 and r["mean_kl"] < 5e-3, r
    assert r["top1_agreement"] >= 0.85 and abs(r["ppl_rel_diff"]) < 0.02, r


@pytest.mark.parametrize("name", ["gqa2"])
def test_weight_bound_holds_and_survives_tensor_parallel_layout(tiny_dirs, name):
    """No k or v the model computes exceeds the bound (so nothing is clipped), and the bound read from the
    tensor-parallel layout (qkv columns regrouped per device, kv heads replicated when tp > K) is the same."""
    config = ModelConfig.from_pretrained(tiny_dirs[name])
    params = load_params(tiny_dirs[name], config, jnp.float32)
    k_b, v_b = (np.asarray(a) for a in bound_amax(config, params))
    k_a, v_a = calibrated_amax(config, params, np.random.default_rng(1).integers(0, config.vocab_size, (2, 48)))
    assert (k_a <= k_b).all() and (v_a <= v_b).all()
    assert (k_b < 20 * k_a).all() and (v_b < 20 * v_a).all(), "the bound should not be absurdly loose here"
    for tp in (2, 4):
        laid = map_params(lambda n, w: to_tp(n, w, config, tp, jnp), params)
        for a, b in zip(bound_amax(config, laid, tp), (k_b, v_b)):
            np.testing.assert_allclose(np.asarray(a), b, rtol=1e-6)


def test_the_key_bound_counts_yarns_attention_factor(tiny_dirs):
    """YaRN multiplies RoPE's cos / sin by its attention_factor, so keys can grow by it: the bound does too."""
    import dataclasses
    config = ModelConfig.from_pretrained(tiny_dirs["gqa2"])
    params = load_params(tiny_dirs["gqa2"], config, jnp.float32)
    yarn = dataclasses.replace(config, rope_yarn=(32, 32.0, 1.0, 1.25, True))
    (k0, v0), (k1, v1) = (bound_amax(c, params) for c in (config, yarn))
    np.testing.assert_allclose(np.asarray(k1), 1.25 * np.asarray(k0), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(v1), np.asarray(v0), rtol=1e-6)


def _with_scale_tensors(src, dst, layers, which=("k", "v"), value=None, name="self_attn.{w}_scale", shape=()):
    """A copy of checkpoint `src` carrying vLLM-style k_scale / v_scale tensors (`which` of them) for the first
    `layers` layers; `value`: that scale for all of them instead of 0.01 (k) / 0.02 (v) x (l + 1); `name`: the
    tensor's name in the layer ({w}: k or v), `shape`: its shape."""
    import shutil
    from safetensors.numpy import load_file, save_file
    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    t = load_file(path)
    for l in range(layers):
        for w, unit in (("k", 0.01), ("v", 0.02)):
            if w in which:
                t[f"model.layers.{l}." + name.format(w=w)] = np.full(shape, unit * (l + 1) if value is None else value,
                                                                     np.float32)
    save_file(t, path)
    return dst


def test_checkpoint_scales_are_used(tiny_dir, tmp_path):
    path = _with_scale_tensors(tiny_dir, str(tmp_path / "scaled"), 2)
    llm = LLM(path, **FP8)
    p = llm.engine.runner.params
    np.testing.assert_allclose(np.asarray(p["k_scale"])[:, 0], [0.01, 0.02], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(p["v_scale"])[:, 0], [0.02, 0.04], rtol=1e-6)
    assert len(tokens(llm, [[1, 2, 3]])[0]) == GREEDY.max_tokens
    assert "k_scale" not in LLM(path, **TINY_ENGINE).engine.runner.params, "a full-precision cache needs no scales"
    with pytest.raises(ValueError, match="layers.1.self_attn.k_scale"):
        LLM(_with_scale_tensors(tiny_dir, str(tmp_path / "partial"), 1), **FP8)
    with pytest.raises(ValueError, match="layers.0.self_attn.k_scale"):         # v_scale alone is a gap too
        LLM(_with_scale_tensors(tiny_dir, str(tmp_path / "v_only"), 2, which=("v",)), **FP8)
    # an "auto" cache ignores the checkpoint's scales, even unusable ones (as vLLM); fp8 names the bad tensor
    bad = _with_scale_tensors(tiny_dir, str(tmp_path / "zero"), 2, value=0.0)
    assert tokens(LLM(bad, **TINY_ENGINE), [[1, 2, 3]]) == tokens(LLM(tiny_dir, **TINY_ENGINE), [[1, 2, 3]])
    with pytest.raises(ValueError, match="self_attn.k_scale' must be one positive scale"):
        LLM(bad, **FP8)


def test_calculate_kv_scales_computes_them_even_over_the_checkpoints(tiny_dir, tmp_path):
    """vLLM's `calculate_kv_scales=True` (its fp8 KV cache example): the scales are computed (the weights' bound)
    even where the checkpoint has some; also a CLI flag. A non-bool is a ValueError naming it."""
    path = _with_scale_tensors(tiny_dir, str(tmp_path / "scaled"), 2)
    p = LLM(path, **FP8, calculate_kv_scales=True).engine.runner.params
    want = LLM(tiny_dir, **FP8).engine.runner.params                  # (no scales in it: the bound)
    for w in ("k_scale", "v_scale"):
        np.testing.assert_allclose(np.asarray(p[w]), np.asarray(want[w]), rtol=1e-6)
    assert not np.allclose(np.asarray(p["k_scale"])[:, 0], [0.01, 0.02])
    with pytest.raises(ValueError, match="calculate_kv_scales='yes' must be True or False"):
        LLM(tiny_dir, **FP8, calculate_kv_scales="yes")
    from jaxinfer.cli import build_parser, engine_kwargs
    a = build_parser().parse_args(["generate", "--kv-cache-dtype", "fp8", "--calculate-kv-scales"])
    assert engine_kwargs(a)["calculate_kv_scales"] is True


@pytest.mark.parametrize("name, shape", [("self_attn.attn.{w}_scale", (1,)), ("self_attn.{w}_proj.{w}_scale", ()),
                                         ("self_attn.qkv_proj.{w}_scale", (1,)),
                                         ("self_attn.{w}_proj.output_scale", (1,)), ("self_attn.kv_scale", ())])
def test_checkpoint_scales_under_every_name_vllm_reads(tiny_dir, tmp_path, name, shape):
    """The other names vLLM loads a layer's scales under (its own with attn., ModelOpt's k_proj.k_scale,
    compressed-tensors' k_proj.output_scale, and the old kv_scale, which holds for k and v): all used (before,
    all but the first were skipped without a word and the weight bound used instead)."""
    path = _with_scale_tensors(tiny_dir, str(tmp_path / "scaled"), 2, name=name, shape=shape)
    p = LLM(path, **FP8).engine.runner.params
    np.testing.assert_allclose(np.asarray(p["k_scale"])[:, 0], [0.01, 0.02] if "{w}" in name else [0.02, 0.04])
    np.testing.assert_allclose(np.asarray(p["v_scale"])[:, 0], [0.02, 0.04], rtol=1e-6)


class _FakeGPU:
    platform = "gpu"

    def memory_stats(self):
        return {"bytes_limit": 16 * 2**30, "bytes_in_use": 2 * 2**30}


def test_fp8_pool_holds_twice_the_blocks(tiny_dir):
    model = ModelConfig.from_pretrained(tiny_dir)
    engine = EngineConfig(dtype="bfloat16", max_model_len=128).resolve("gpu", model)
    assert kv_bytes_per_block(model, 16, kv_cache_dtype("fp8", "bfloat16")) * 2 == kv_bytes_per_block(
        model, 16, jnp.bfloat16)
    bf16 = num_blocks_for_memory(model, engine, kv_cache_dtype("auto", engine.dtype), device=_FakeGPU())
    fp8 = num_blocks_for_memory(model, engine, kv_cache_dtype("fp8_e4m3", engine.dtype), device=_FakeGPU())
    assert abs(fp8 - 2 * bf16) <= 1 and bf16 > 0
    # on a CPU the pool is the memory max_num_seqs full sequences take in the model's dtype: fp8 gets more blocks
    cpu = EngineConfig(dtype="bfloat16", max_model_len=128).resolve("cpu", model)
    assert num_blocks_for_memory(model, cpu, kv_cache_dtype("fp8", "bfloat16")) == \
        2 * num_blocks_for_memory(model, cpu, kv_cache_dtype("auto", "bfloat16")) == 2 * 8 * 128 // 16
    totals = [LLM(tiny_dir, max_model_len=128, kv_cache_dtype=d).stats()["kv_blocks_total"] for d in ("auto", "fp8")]
    assert totals[1] == 4 * totals[0]            # float32 on a CPU: four fp8 blocks in one float32 block's bytes


def test_kv_cache_dtype_option(tiny_dir):
    with pytest.raises(ValueError, match="kv_cache_dtype='int8'"):
        EngineConfig(kv_cache_dtype="int8")
    # vLLM's names of a full-precision cache: the model's dtype here ("auto"), another one refused naming both
    llm = LLM(tiny_dir, kv_cache_dtype="float16", dtype="float16", max_model_len=64)
    assert llm.config.kv_cache_dtype == "auto" and llm.stats()["kv_cache_dtype"] == "float16"
    with pytest.raises(ValueError, match="kv_cache_dtype='bfloat16' differs from dtype='float32'"):
        LLM(tiny_dir, kv_cache_dtype="bfloat16", max_model_len=64)                  # (a CPU's default: float32)
    assert EngineConfig().kv_cache_dtype == "auto"
    from jaxinfer.cli import add_engine_args, engine_kwargs
    p = argparse.ArgumentParser()
    add_engine_args(p, with_model=False)
    assert engine_kwargs(p.parse_args(["--kv-cache-dtype", "fp8"])) == {"kv_cache_dtype": "fp8"}
    with pytest.raises(SystemExit):
        p.parse_args(["--kv-cache-dtype", "int4"])
    assert kv_cache_dtype("auto", "float32") == jnp.float32 and kv_cache_dtype("fp8", "bfloat16") == FP8_DTYPE


_TP_SCRIPT = """
import json, sys
import jax
import jax.numpy as jnp
import numpy as np
sys.path.insert(0, "tests")
from helpers import TINY_ENGINE
from jaxinfer import LLM, SamplingParams
path, out = sys.argv[1], {}
sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
ps = [[1, 2, 3, 4, 5], list(range(7, 40))]
for backend, extra in (("pallas", dict(block_size=16, num_kvcache_blocks=64)),):
    for tp in (1, 2):
        llm = LLM(path, **{**TINY_ENGINE, **extra}, attn_backend=backend, kv_cache_dtype="fp8",
                  tensor_parallel_size=tp)
        out[f"{backend}_tp{tp}"] = [o.token_ids for o in llm.generate(ps, sp, use_tqdm=False)]
        st = llm.stats()
        assert st["kv_blocks_free"] == st["kv_blocks_total"] and st["kv_cache_dtype"] == "float8_e4m3fn"
caches = {}        # bf16 model: the fp8 bytes written must not depend on where XLA ends a fusion (quant.quantize)
for tp in (1, 2):
    llm = LLM(path, **{**TINY_ENGINE, "block_size": 16, "num_kvcache_blocks": 64, "dtype": "bfloat16"},
              attn_backend="pallas", kv_cache_dtype="fp8", tensor_parallel_size=tp)
    llm.generate(ps, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    caches[tp] = [np.asarray(jax.lax.bitcast_convert_type(c, jnp.uint8)) for c in llm.engine.runner.kv_caches[0]]
out["bf16_cache_bytes_differ"] = [int((a != b).sum()) for a, b in zip(caches[1], caches[2])]
out["dp2_blocks"] = [LLM(path, max_model_len=128, kv_cache_dtype=d, data_parallel_size=2).stats()["replicas"][0][
    "kv_blocks_total"] for d in ("auto", "fp8")]       # a replica's pool sized from memory: fp8 holds more blocks
llm = LLM(path, **TINY_ENGINE, kv_cache_dtype="fp8", data_parallel_size=2)
out["xla_dp2"] = [o.token_ids for o in llm.generate(ps, sp, use_tqdm=False)]
assert llm.stats()["kv_cache_dtype"] == "float8_e4m3fn"
print("RESULT" + json.dumps(out))
"""


def test_fp8_cache_under_tensor_parallelism(tiny_dir):
    """tp=2 on two CPU devices (own process): the per-layer scales are replicated (the Pallas kernels get them
    inside shard_map with the step's metadata): tokens equal tp=1's on the fp8 cache; and two data-parallel
    replicas (xla) give them too. (The xla backend under tp is plain jnp partitioned by XLA.) With a bf16 model the
    cache bytes after a prefill are the same at tp=2 as at tp=1."""
    import json
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": root,
           "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()}
    proc = subprocess.run([sys.executable, "-c", _TP_SCRIPT, tiny_dir], cwd=root, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    out = json.loads(proc.stdout.split("RESULT")[-1])
    assert out["pallas_tp2"] == out["pallas_tp1"] == out["xla_dp2"], out
    assert out["bf16_cache_bytes_differ"] == [0, 0], out
    assert out["dp2_blocks"][1] == 4 * out["dp2_blocks"][0], out     # float32 on a CPU, as with one replica


def test_multistep_decode_on_fp8_cache(tiny_dir, fp8_xla, full):
    """K decode steps per call (multistep.py) read and write the fp8 cache as single steps do."""
    llm = LLM(tiny_dir, **{**FP8, "num_scheduler_steps": 4})
    assert tokens(llm, full[0]) == fp8_xla[1]
