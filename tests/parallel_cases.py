"""Tensor / data parallelism on 8 CPU devices. Run by tests/test_parallel.py in its own process with
XLA_FLAGS=--xla_force_host_platform_device_count=8 (the device count is fixed when JAX starts), so the rest of
the suite keeps one device. Tiny fp32 checkpoints; reference = HF transformers."""
import re

import jax
import numpy as np
import pytest
from helpers import Interrupt, hf_greedy, hf_model, interrupt_at_call, make_tiny_model

from jaxinfer import LLM, SamplingParams
from jaxinfer.config import ModelConfig
from jaxinfer.model.loader import load_params, read_params
from jaxinfer.parallel import make_placements
from jaxinfer.parallel.layout import to_tp

BASE = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=64, prefill_buckets=(64,), max_model_len=64,
            block_size=8, num_kvcache_blocks=64, warmup=False)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
# GQA with a prime vocabulary (no tp size divides it: padded), MQA (1 kv head: replicated for tp > 1), MHA
CONFIGS = {
    "gqa_v509": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_size=64, vocab_size=509),
    "mqa": dict(num_attention_heads=4, num_key_value_heads=1, head_dim=16, hidden_size=64),
    "mha_tied": dict(num_attention_heads=4, num_key_value_heads=4, head_dim=16, hidden_size=64,
                     tie_word_embeddings=True),
}


def test_sees_eight_devices():
    assert len(jax.devices()) == 8, "run through tests/test_parallel.py (XLA_FLAGS device count)"


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("par")
    return {name: make_tiny_model(str(root / name), **kw) for name, kw in CONFIGS.items()}


@pytest.fixture(scope="session")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(0, 500, n).tolist() for n in (3, 13, 30)]


def run(llm, ps, sp=GREEDY):
    outs = llm.generate(ps, sp, use_tqdm=False)
    st = llm.stats()
    assert st["kv_blocks_free"] == st["kv_blocks_total"], st        # every KV block returned
    assert st["running"] == st["waiting"] == 0
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("tp", [2, 4])
def test_greedy_equals_transformers(ckpts, prompts, name, tp):
    ref = hf_model(ckpts[name])
    want = [hf_greedy(ref, p, 8) for p in prompts]
    assert run(LLM(ckpts[name], tensor_parallel_size=tp, **BASE), prompts) == want


def test_pallas_interpret_tp2_equals_transformers(ckpts, prompts):
    """The Pallas kernels (interpret mode) per device inside shard_map: prefill and the fused decode kernel."""
    ref = hf_model(ckpts["mqa"])
    want = [hf_greedy(ref, p, 4) for p in prompts[:2]]
    llm = LLM(ckpts["mqa"], tensor_parallel_size=2, attn_backend="pallas", **BASE)
    assert run(llm, prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)) == want


def test_top_k_only_step_tp2_equals_tp1_resample(ckpts, prompts, monkeypatch):
    """The large decode buckets' "top_k_only" step (here every bucket's) at tp=2 draws on gathered candidates:
    Qwen3-style seeded rows beside a greedy one get tp=1's tokens from the step + resample path."""
    from jaxinfer.engine import runner as runner_mod
    sp = [SamplingParams(temperature=t, top_k=20, top_p=0.95, seed=s, max_tokens=6, ignore_eos=True)
          for t, s in ((0.8, 1), (1.5, 2))] + [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)]
    kw = dict(BASE, attn_backend="pallas", num_scheduler_steps=1)
    want = run(LLM(ckpts["mqa"], **kw), prompts, sp)
    monkeypatch.setattr(runner_mod, "TOP_K_STEP_MIN_ROWS", 1)
    llm = LLM(ckpts["mqa"], tensor_parallel_size=2, **kw)
    assert run(llm, prompts, sp) == want
    assert any(k[0] == "decode" and k[4] == "top_k_only" for k in llm.engine.runner.compiled)


@pytest.fixture(scope="session")
def tp1(ckpts):
    return LLM(ckpts["gqa_v509"], **BASE)


@pytest.fixture(scope="session")
def tp2(ckpts):
    return LLM(ckpts["gqa_v509"], tensor_parallel_size=2, **BASE)


def seeded(filtered: bool):
    kw = dict(top_k=20, top_p=0.9) if filtered else {}
    return [SamplingParams(temperature=t, max_tokens=10, ignore_eos=True, seed=s, **kw)
            for t, s in ((0.8, 1), (1.5, 2), (1.0, 3))]


@pytest.mark.parametrize("filtered", [False, True], ids=["plain", "top_k_top_p"])
def test_seeded_sampling_tp2_equals_tp1(tp1, tp2, prompts, filtered):
    sp = seeded(filtered)
    a, b = run(tp1, prompts, sp), run(tp2, prompts, sp)
    assert a == b
    assert a != run(tp1, prompts, [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)] * 3)


def test_penalties_and_logprobs_tp2_equal_tp1(tp1, tp2, prompts):
    """The extras step variant (engine/extras.py) on vocabulary-split logits: same tokens and logprobs."""
    sp = [SamplingParams(temperature=0.8, seed=1, max_tokens=6, logprobs=3, prompt_logprobs=2, presence_penalty=1.0,
                         ignore_eos=True), SamplingParams(temperature=0, max_tokens=6, repetition_penalty=1.5)]
    a, b = (tp.generate(prompts[:2], sp, use_tqdm=False) for tp in (tp1, tp2))
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    flat = lambda lps: [(t, e.rank, e.logprob) for d in lps[1:] for t, e in d.items()]   # noqa: E731
    for x, y in ((a[0].outputs[0].logprobs, b[0].outputs[0].logprobs), (a[0].prompt_logprobs, b[0].prompt_logprobs)):
        fx, fy = flat(x), flat(y)
        assert [f[:2] for f in fx] == [f[:2] for f in fy]
        np.testing.assert_allclose([f[2] for f in fx], [f[2] for f in fy], atol=1e-4)


def test_logit_bias_and_allowed_ids_tp2_equal_tp1(tp1, tp2, prompts):
    """logit_bias / allowed_token_ids on the vocabulary-split logits (509 ids, padded): the same tokens as tp=1,
    the last real id reachable, the padding never."""
    sp = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={508: 30.0, 3: -4.0}),
          SamplingParams(temperature=0.9, seed=4, max_tokens=6, ignore_eos=True, allowed_token_ids=[2, 508, 100],
                         logit_bias={100: 1.5}),
          SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)]
    a, b = (run(tp, prompts, sp) for tp in (tp1, tp2))
    assert a == b and a[0] == [508] * 6 and set(a[1]) <= {2, 508, 100}


def test_bad_words_and_structured_choice_tp2_equal_tp1(tp1, tp2, prompts):
    """bad_words and structured outputs' choice and regex on the vocabulary-split logits (509 ids, padded), in one
    batch with a plain row: the same tokens as tp=1, the banned word's token not sampled, each constrained answer a
    choice or a match of the regex."""
    tok = tp1.get_tokenizer()
    plain = run(tp1, prompts[:1], [GREEDY])[0]
    word = next(w for t in plain if (w := tok.decode([t])).strip() and not w[0].isspace() and
                tok.encode(w, add_special_tokens=False) == [t])
    choices = ["yes", "no", "maybe so"]
    sp = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, bad_words=[word]), GREEDY,
          *(SamplingParams(temperature=t, seed=2, max_tokens=8, structured_outputs={"choice": choices})
            for t in (0, 1.5)),
          *(SamplingParams(temperature=t, seed=3, max_tokens=12, structured_outputs={"regex": "[a-z]{1,4} [0-9]{1,2}"})
            for t in (0, 1.5))]
    a, b = (run(tp, prompts[:1] * 2 + prompts[1:3] + prompts[:2], sp) for tp in (tp1, tp2))
    assert a == b and a[0] != plain and tok.encode(word, add_special_tokens=False)[0] not in a[0]
    assert all(tok.decode(ids, skip_special_tokens=True) in choices for ids in a[2:4])
    assert all(re.fullmatch("[a-z]{1,4} [0-9]{1,2}", tok.decode(ids, skip_special_tokens=True)) for ids in a[4:]), a[4:]
    taken = {t for c in choices for t in tok.encode(c, add_special_tokens=False)}
    dead = SamplingParams(temperature=0, max_tokens=4, allowed_token_ids=[i for i in (10, 20, 30) if i not in taken],
                          structured_outputs={"choice": choices})      # (the masks together leave no token)
    eos = tp1.model_config.eos_token_id[0]
    assert run(tp1, prompts[:1], dead) == run(tp2, prompts[:1], dead) == [[eos]]      # ends with EOS, never id 0


@pytest.fixture(scope="session")
def tp4(ckpts):
    return LLM(ckpts["gqa_v509"], tensor_parallel_size=4, **BASE)


def big_gathers(llm, V):
    """(program key, shape) of every all-gather in the engine's extras programs with a dimension of V or more."""
    found = []
    for key, exe in llm.engine.extras.compiled.items():
        for shape in re.findall(r"\S+\[([\d,]+)\]\S* all-gather(?:-start)?\(", exe.as_text()):
            if max(int(d) for d in shape.split(",")) >= V:
                found.append((key, shape))
    return found


@pytest.mark.parametrize("tp", [2, 4])
def test_extras_steps_keep_logits_split_and_equal_tp1(tp1, tp2, tp4, prompts, tp):
    """The extras step at tp = 2, 4 (509 ids: padded) edits, counts and draws on the vocabulary-split logits: logprobs
    with top-n, prompt logprobs, the penalties, logit_bias / allowed_token_ids, min_tokens' bans, bad_words, choice
    and regex give tp=1's tokens, ids and ranks, and its logprobs to fp32 rounding (the sum of exp is added in another
    order); the padding ids are never drawn or listed. No extras program all-gathers [B, V] (the sorted top-p draw,
    which needs whole rows, gets B / tp of them by an all-to-all); the penalty counts are split by vocabulary too."""
    llm = {2: tp2, 4: tp4}[tp]
    V = llm.model_config.vocab_size
    tok = tp1.get_tokenizer()
    word = next(w for t in run(tp1, prompts[:1], [GREEDY])[0] if (w := tok.decode([t])).strip() and
                not w[0].isspace() and tok.encode(w, add_special_tokens=False) == [t])
    edits = [SamplingParams(temperature=0.8, seed=1, max_tokens=6, logprobs=5, prompt_logprobs=3, presence_penalty=1.0,
                            frequency_penalty=0.5, repetition_penalty=1.3, logit_bias={508: 2.0, 3: -4.0},
                            min_tokens=4, stop_token_ids=[508]),
             SamplingParams(temperature=0, max_tokens=6, logprobs=20, bad_words=[word], ignore_eos=True),
             SamplingParams(temperature=1.2, seed=5, max_tokens=6, logprobs=2, allowed_token_ids=[2, 508, 100, 7],
                            logit_bias={100: 1.5}, ignore_eos=True),
             SamplingParams(temperature=1.0, seed=7, top_k=20, top_p=0.9, max_tokens=6, logprobs=1,
                            frequency_penalty=1.0, ignore_eos=True)]
    shapes = ({"choice": ["yes", "no", "maybe so"]}, {"regex": "[a-z]{1,4} [0-9]{1,2}"})
    structured = [SamplingParams(temperature=t, seed=2, max_tokens=8, logprobs=3, structured_outputs=s)
                  for t in (0, 1.5) for s in shapes]
    batches = [(prompts + prompts[:1], edits), (prompts[:2] * 2, structured)]
    flat = lambda lps: [(t, e.rank, e.logprob) for d in lps or [] if d for t, e in d.items()]   # noqa: E731
    compared = 0
    for ps, sp in batches:
        a, b = (x.generate(ps, sp, use_tqdm=False) for x in (tp1, llm))
        assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
        for x, y in zip(a, b):
            for lx, ly in ((x.outputs[0].logprobs, y.outputs[0].logprobs), (x.prompt_logprobs, y.prompt_logprobs)):
                fx, fy = flat(lx), flat(ly)
                assert [f[:2] for f in fx] == [f[:2] for f in fy] and all(f[0] < V for f in fy)
                np.testing.assert_allclose([f[2] for f in fx], [f[2] for f in fy], rtol=0, atol=1e-5)
                compared += len(fx)
    assert compared > 6 * 20 + 3 * 2                        # (the top-20 rows and the prompt logprobs among them)
    keys = [k for k, _ in llm.engine.extras.compiled]
    assert {k[0] for k in keys} == {"prefill", "decode"} and any(k[-1].grammar for k in keys)
    assert big_gathers(llm, V) == []
    for counts in llm.engine.extras.counts:
        assert {s.data.shape for s in counts.addressable_shards} == {(counts.shape[0], -(-V // tp))}
    sorted_draw = [SamplingParams(temperature=t, seed=9, top_p=0.8, min_p=m, max_tokens=4, logprobs=3,
                                  ignore_eos=True) for t, m in ((1.0, 0), (1.5, 0.05), (0, 0))]
    assert run(tp1, prompts, sorted_draw) == run(llm, prompts, sorted_draw)
    assert big_gathers(llm, V) == []
    assert any(k[4] is True and "all-to-all" in exe.as_text() for (k, _), exe in llm.engine.extras.compiled.items())


def test_weights_and_cache_really_split(tp2):
    runner, tp = tp2.engine.runner, 2
    assert {d.id for d in runner.placement.devices} == {0, 1}
    assert (tp2.stats()["tensor_parallel_size"], tp2.stats()["data_parallel_size"]) == (2, 1)
    layers = runner.params["layers"]
    qkv = layers[0]["qkv_proj"] if isinstance(layers, tuple) else layers["qkv_proj"]
    E, X = qkv.shape[-2:]
    assert [s.data.shape[-2:] for s in qkv.addressable_shards] == [(E, X // tp)] * tp
    assert len({s.device for s in qkv.addressable_shards}) == tp
    o = layers[0]["o_proj"] if isinstance(layers, tuple) else layers["o_proj"]
    assert [s.data.shape[-2] for s in o.addressable_shards] == [o.shape[-2] // tp] * tp
    emb = runner.params["embed_tokens"]
    assert emb.shape[0] == 510                                          # 509 padded to a multiple of 2
    assert [s.data.shape for s in emb.addressable_shards] == [(255, emb.shape[1])] * tp
    k_cache = runner.kv_caches[0][0]                                    # [P, bs, K', D], K' = 2
    assert [s.data.shape[2] for s in k_cache.addressable_shards] == [1, 1]
    assert not qkv.sharding.is_fully_replicated and not k_cache.sharding.is_fully_replicated


def test_loader_gives_each_device_only_its_slices(ckpts):
    path = ckpts["mqa"]
    cfg = ModelConfig.from_pretrained(path)
    (p4,) = make_placements(4, 1)
    params = load_params(path, cfg, np.float32, placement=p4)
    host = read_params(path, cfg, np.float32)
    want = to_tp("qkv_proj", host["layers"]["qkv_proj"], cfg, 4, np)   # [L, E, 4 * (1 + 2) * D]: kv head x4
    got = params["layers"]["qkv_proj"]
    assert got.shape == want.shape == (2, 64, 4 * 3 * 16)
    for s in got.addressable_shards:
        np.testing.assert_array_equal(np.asarray(s.data), want[s.index])
        assert s.data.shape == (2, 64, 3 * 16)
    # each device's slice holds [q heads | the shared kv head | its v]: the kv head is replicated to all 4
    k_cols = [np.asarray(s.data)[..., 16:32] for s in got.addressable_shards]
    for k in k_cols[1:]:
        np.testing.assert_array_equal(k, k_cols[0])


def test_preset_random_weights_copy_replicated_kv_heads():
    """A preset's random weights at tp > num_key_value_heads: the replicated kv heads are exact copies (the MQA
    model its config describes) and tp = 1, 2 and 4 run the same model (same greedy tokens, drawn once per layer in
    the checkpoint layout)."""
    tiny = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=1, head_dim=16, vocab_size=301)
    one = LLM("qwen3-0.6b", hf_overrides=tiny, **BASE)
    outs, embed = [run(one, [[1, 2, 3], list(range(5, 30))])], np.asarray(one.engine.runner.params["embed_tokens"])
    for tp in (2, 4):
        llm = LLM("qwen3-0.6b", hf_overrides=tiny, tensor_parallel_size=tp, **BASE)
        qkv = np.asarray(llm.engine.runner.params["layers"]["qkv_proj"]).reshape(2, 64, tp, 4 // tp + 2, 16)
        for i in range(1, tp):
            np.testing.assert_array_equal(qkv[:, :, i, -2:], qkv[:, :, 0, -2:])      # its k and v heads
        np.testing.assert_array_equal(np.asarray(llm.engine.runner.params["embed_tokens"])[:301], embed)
        outs.append(run(llm, [[1, 2, 3], list(range(5, 30))]))
    assert outs[0] == outs[1] == outs[2]


def test_step_collectives_are_small(tp2):
    """The decode step of L layers: 2 all-reduces per layer + 1 for the embedding, and one all-gather (the
    sampler's [tp, 2, B] maxima); no gather of logits, weights or KV cache. (The xla backend, CPU's default, scans
    its layers: the loop body's 2 are in the program text once.)"""
    runner = tp2.engine.runner
    exe = runner.compile(("decode", 8, 8, runner.widths[-1], False))
    hlo = exe.as_text()
    L = 1 if len(runner.kv_caches) == 1 else tp2.model_config.num_hidden_layers
    assert len(re.findall(r"all-reduce(?:-start)?\(", hlo)) == 2 * L + 1
    gathers = re.findall(r"(\S+) all-gather(?:-start)?\(", hlo)
    assert len(gathers) == 1 and "[2,2,8]" in gathers[0], gathers


def test_unseeded_requests_draw_one_replicas_seeds(ckpts, prompts):
    """Requests without a seed take their seeds from one draw sequence in submission order (the engine seed's), so
    dp replicas sample one replica's tokens (n samples too), as tp does."""
    sp = [SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True), SamplingParams(n=2, max_tokens=4)]
    def samples(llm):
        outs = llm.generate(prompts * 2, sp * 3, use_tqdm=False)
        return [[c.token_ids for c in o.outputs] for o in outs]
    want = samples(LLM(ckpts["gqa_v509"], **BASE))
    assert samples(LLM(ckpts["gqa_v509"], data_parallel_size=2, **BASE)) == want
    assert samples(LLM(ckpts["gqa_v509"], data_parallel_size=3, **BASE)) == want


def test_filtered_draws_gather_no_weights(ckpts, prompts):
    """A tied model at tp=2: Qwen3's top_k / top_p draw gathers each shard's top candidates, not [B, V], a top_p
    alone all-to-all's whole rows, and the extras step (logprobs) gathers per-shard statistics: no program gathers the
    logits or the vocabulary-split [V, E] embedding (XLA would rather replicate the tied weight than the logits,
    unless told)."""
    llm = LLM(ckpts["mha_tied"], tensor_parallel_size=2, num_scheduler_steps=1, **BASE)
    one = LLM(ckpts["mha_tied"], num_scheduler_steps=1, **BASE)
    top_p = [SamplingParams(temperature=1.0, top_p=0.7, seed=s, max_tokens=4, ignore_eos=True) for s in (1, 2, 3)]
    for sp in (seeded(True), top_p):
        assert run(llm, prompts, sp) == run(one, prompts, sp)
    run(llm, prompts, SamplingParams(temperature=0.6, max_tokens=3, seed=1, logprobs=1))
    V = llm.model_config.vocab_size
    programs = [*llm.engine.runner.compiled.items(), *llm.engine.extras.compiled.items()]
    assert {k[4] for k, _ in programs if k[0] == "resample"} == {"top_k", True}
    for key, exe in programs:
        for shape in re.findall(r"\S+\[([\d,]+)\]\S* all-gather(?:-start)?\(", exe.as_text()):
            dims = [int(d) for d in shape.split(",")]
            assert max(dims) < V, (key, shape)              # candidates, not logits, never the embedding


def test_data_parallel_equals_one_replica(ckpts, tp1, prompts):
    ps = prompts * 3                                         # enough requests for both replicas
    # every other request filters (top_p): both replicas run their resample programs
    sp = [SamplingParams(temperature=0.9, max_tokens=6, ignore_eos=True, seed=i, top_p=0.8 if i % 2 else 1.0)
          for i in range(len(ps))]
    want = run(tp1, ps, sp)
    dp = LLM(ckpts["gqa_v509"], data_parallel_size=2, **{**BASE, "seed": None})    # seed None: random engine seeds
    assert dp.stats()["compilations"] == 0          # (warmup=False: nothing compiled for a request yet)
    assert run(dp, ps, sp) == want
    st = dp.stats()
    assert st["data_parallel_size"] == 2 and len(st["replicas"]) == 2 and st["tensor_parallel_size"] == 1
    assert all(r["generated_tokens"] > 0 for r in st["replicas"]), "both replicas got requests"
    assert st["generated_tokens"] == sum(r["generated_tokens"] for r in st["replicas"]) == 6 * len(ps)
    devices = [{d.id for d in r.runner.placement.devices} for r in dp.engine.replicas]
    assert devices == [{0}, {1}]
    # stream and abort work through the same interface
    first = next(iter(dp.stream(ps[:2], GREEDY)))
    assert first.token_ids
    assert dp.stats()["kv_blocks_free"] == dp.stats()["kv_blocks_total"]
    bm = dp.llm_engine.block_manager           # the same through the block manager: both replicas' pools
    assert bm.num_free_blocks == bm.num_blocks == 2 * bm.blocks_per_replica == dp.stats()["kv_blocks_total"]
    # n samples: the same tokens, and a request's samples stay on one replica (they reuse sample 0's cached
    # prompt there: as many prefix-cache hits as on one engine)
    nsp = SamplingParams(n=3, temperature=0.9, max_tokens=4, ignore_eos=True, seed=7)
    hits = []
    for llm in (tp1, dp):
        llm.reset_prefix_cache()                     # the hits counted are then the samples' own
        before = llm.stats()["prefix_cache_hit_tokens"]
        outs = llm.generate(ps[1:3], nsp, use_tqdm=False)
        hits.append((llm.stats()["prefix_cache_hit_tokens"] - before, [[c.token_ids for c in o.outputs] for o in outs]))
    assert hits[0] == hits[1] and hits[0][0] > 0
    rx = [SamplingParams(temperature=1.2, seed=i, max_tokens=12, structured_outputs={"regex": "[a-z]{1,4} [0-9]{1,2}"})
          for i in range(4)]                          # (json / regex rows: each replica reads its step first)
    assert run(dp, ps[:4], rx) == run(tp1, ps[:4], rx)


def test_a_replica_launch_that_fails_is_raised_and_loses_nothing(ckpts, tp1, prompts, monkeypatch):
    """Replicas launch their device calls from threads at once (DPEngine._launch_all): when replica 1's launch
    raises, LLM.generate raises that error, every KV block returns, and the next generate gives the tokens."""
    dp = LLM(ckpts["gqa_v509"], data_parallel_size=2, num_scheduler_steps=1, **BASE)   # a launch per token
    r1 = dp.engine.replicas[1].runner
    calls = {"n": 0}
    real = r1.run

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("launch failed on replica 1")
        return real(*a, **k)
    monkeypatch.setattr(r1, "run", flaky)
    ps = prompts * 2
    with pytest.raises(RuntimeError, match="launch failed on replica 1"):
        dp.generate(ps, GREEDY, use_tqdm=False)
    st = dp.stats()
    assert st["kv_blocks_free"] == st["kv_blocks_total"] and st["running"] == st["waiting"] == 0, st
    assert run(dp, ps) == run(tp1, ps)


def interrupting(real, calls: list, n: int):
    """`real`, each call listed in `calls`: the n-th raises KeyboardInterrupt instead (a Ctrl-C landing there)."""
    def call(*args):
        calls.append(args)
        if len(calls) == n:
            raise KeyboardInterrupt
        return real(*args)
    return call


def slowed(real, ended: list):
    """A replica's launch taking 0.3 s longer (as if still running in its pool thread), its end time listed."""
    import time

    def launch(plan):
        time.sleep(0.3)
        real(plan)
        ended.append(time.perf_counter())
    return launch


def interrupted_then_same(dp, tp1, ps, monkeypatch, ended: list) -> None:
    """dp.generate(ps) raises the KeyboardInterrupt only once the slowed launch ended (`ended`: its end times);
    then, unpatched, it gives tp1's tokens."""
    import time
    with pytest.raises(KeyboardInterrupt):
        dp.generate(ps, GREEDY, use_tqdm=False)
    left = time.perf_counter()
    assert ended and ended[-1] <= left
    monkeypatch.undo()
    assert run(dp, ps) == run(tp1, ps)


def test_a_ctrl_c_between_the_launch_submits_waits_for_those_queued(ckpts, tp1, prompts, monkeypatch):
    """dp=3: a Ctrl-C landing between the submits of replicas 1's and 2's launches left step() while replica 1's
    still ran (its future was not listed yet); it is now waited for, and nothing is lost after."""
    dp = LLM(ckpts["gqa_v509"], data_parallel_size=3, num_scheduler_steps=1, **BASE)
    ps = prompts * 3
    assert run(dp, ps) == run(tp1, ps)                  # (and the launch pool is made)
    r1, pool, calls, ended = dp.engine.replicas[1], dp.engine._pool, [], []
    monkeypatch.setattr(r1, "launch", slowed(r1.launch, ended))
    monkeypatch.setattr(pool, "submit", interrupting(pool.submit, calls, 4))     # (the second step's second submit)
    interrupted_then_same(dp, tp1, ps, monkeypatch, ended)
    assert len(calls) == 4 and len(ended) == 2


def test_a_ctrl_c_inside_submit_after_the_launch_was_queued(ckpts, tp1, prompts, monkeypatch):
    """A Ctrl-C landing inside `submit` once replica 1's launch is queued (as in the first dp step's Thread.start),
    before step() lists its future: step() left while that launch could still run or start later. Now each launch
    the step queued either ends before step() is left or never runs."""
    import time
    dp = LLM(ckpts["gqa_v509"], data_parallel_size=2, num_scheduler_steps=1, **BASE)
    ps = prompts * 2
    assert run(dp, ps) == run(tp1, ps)                  # (and the launch pool is made)
    r1, pool, started, ended = dp.engine.replicas[1], dp.engine._pool, [], []
    real_submit, real_launch, submits = pool.submit, r1.launch, []

    def launch(plan):
        started.append(time.perf_counter())
        slowed(real_launch, ended)(plan)

    def submit(*args):
        submits.append(real_submit(*args))
        if len(submits) == 2:             # (the second step's: its launch is queued, then the Ctrl-C lands)
            raise KeyboardInterrupt
        return submits[-1]
    monkeypatch.setattr(r1, "launch", launch)
    monkeypatch.setattr(pool, "submit", submit)
    with pytest.raises(KeyboardInterrupt):
        dp.generate(ps, GREEDY, use_tqdm=False)
    left = time.perf_counter()
    submits[-1].result(timeout=5)                       # (done, or skipped when it had not begun)
    assert len(ended) == len(started) in (1, 2) and all(t <= left for t in ended)
    monkeypatch.undo()
    assert run(dp, ps) == run(tp1, ps)


def test_a_ctrl_c_in_the_first_launch_waits_for_the_other_replicas(ckpts, tp1, prompts, monkeypatch):
    """Ctrl-C during replica 0's launch (this thread) while replica 1's launch (a pool thread) still runs: the
    interrupt leaves step() only once that launch is done (before, it left at once, and a launch still writing
    its grammar masks raced the recovery's guide resets: a json row broke its schema). Nothing is lost after."""
    dp = LLM(ckpts["gqa_v509"], data_parallel_size=2, num_scheduler_steps=1, **BASE)
    (r0, r1), calls, ended = dp.engine.replicas, [], []
    monkeypatch.setattr(r0, "launch", interrupting(r0.launch, calls, 3))
    monkeypatch.setattr(r1, "launch", slowed(r1.launch, ended))
    ps = prompts * 2
    interrupted_then_same(dp, tp1, ps, monkeypatch, ended)
    assert len(calls) == 3 and len(ended) == 3


@pytest.mark.parametrize("at_call", [1, 4])
def test_an_interrupt_inside_a_replica_call_leaves_the_engine_usable(ckpts, tp1, prompts, at_call):
    """Ctrl-C after a tensor-parallel replica's step call consumed its donated (sharded) KV pages and ids, before
    its outputs were kept: the next generate allocates them again, recomputes, and gives the same tokens."""
    kw = {**BASE, "max_model_len": 48}     # programs of its own (other tests count the shared ones they compile)
    llm = LLM(ckpts["gqa_v509"], data_parallel_size=2, tensor_parallel_size=2, **kw)
    ps = prompts * 2
    want = run(llm, ps)
    runner = llm.engine.replicas[1].runner
    old = runner.kv_caches[0][0]
    interrupt_at_call([runner], at_call)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(ps, GREEDY, use_tqdm=False)
    del runner.compile
    assert old.is_deleted() and not runner.kv_caches[0][0].is_deleted()   # (taken by a call; made again by recover)
    assert run(llm, ps) == want == run(tp1, ps)          # (run checks that every block returned)


def test_async_engine_runs_a_request_on_its_data_parallel_rank(ckpts, tp1, prompts):
    """AsyncLLMEngine.generate(..., data_parallel_rank=r) runs the request (all its samples) on replica r, as vLLM's,
    with the tokens one replica gives; a rank out of range is a ValueError naming it, and the engine goes on."""
    import asyncio

    from jaxinfer import AsyncLLMEngine
    sp = SamplingParams(temperature=0.9, seed=3, n=2, max_tokens=5, ignore_eos=True)
    want = [c.token_ids for c in tp1.generate(prompts[1:2], sp, use_tqdm=False)[0].outputs]
    dp = LLM(ckpts["gqa_v509"], data_parallel_size=2, **BASE)
    engine = AsyncLLMEngine(dp)

    async def one(rid, rank):
        async for out in engine.generate(prompts[1], sp, rid, data_parallel_rank=rank):
            pass
        return [c.token_ids for c in out.outputs]
    try:
        for i, rank in enumerate((1, 1, 0)):       # (replica 1 busier after the first: least-loaded would pick 0)
            before = [r["generated_tokens"] for r in dp.stats()["replicas"]]
            assert asyncio.run(asyncio.wait_for(one(f"r{i}", rank), 120)) == want
            after = [r["generated_tokens"] for r in dp.stats()["replicas"]]
            assert after[rank] - before[rank] == 10 and after[1 - rank] == before[1 - rank], (rank, before, after)
        for bad in (2, -1, True, 1.0):
            with pytest.raises(ValueError, match=re.escape(f"data_parallel_rank={bad!r} is out of range [0, 2)")):
                asyncio.run(one("bad", bad))
        assert asyncio.run(asyncio.wait_for(one("after", None), 120)) == want
    finally:
        engine.shutdown()
    st = dp.stats()
    assert st["kv_blocks_free"] == st["kv_blocks_total"] and st["running"] == st["waiting"] == 0, st


def test_preemption_chunking_and_queueing_on_parallel_replicas(ckpts, tp1):
    """More requests than rows, prompts longer than a prefill chunk, and a KV pool that cannot hold two of them
    at once: replicas that are themselves tensor-parallel (vocabulary 509: padded) preempt, chunk and queue, and
    still give the plain engine's greedy tokens; every block returns (run() checks)."""
    rng = np.random.default_rng(1)
    ps = [rng.integers(0, 500, n).tolist() for n in (40, 9, 33, 20, 5, 27, 12, 38)]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = run(tp1, ps, sp)
    tight = {**BASE, "max_num_seqs": 2, "max_num_batched_tokens": 16, "prefill_buckets": (16,),
             "num_kvcache_blocks": 10}         # 80 tokens a replica; the longest request needs 52
    llm = LLM(ckpts["gqa_v509"], data_parallel_size=2, tensor_parallel_size=2, **tight)
    assert run(llm, ps, sp) == want
    st = llm.stats()
    assert st["preemptions"] > 0 and all(r["prefill_steps"] > 4 for r in st["replicas"]), st


def test_data_and_tensor_parallel_together(ckpts, prompts):
    ref = hf_model(ckpts["mha_tied"])
    want = [hf_greedy(ref, p, 8) for p in prompts]
    llm = LLM(ckpts["mha_tied"], data_parallel_size=2, tensor_parallel_size=2, **BASE)
    assert run(llm, prompts, GREEDY) == want
    devices = [{d.id for d in r.runner.placement.devices} for r in llm.engine.replicas]
    assert devices == [{0, 1}, {2, 3}]


def test_server_over_tensor_parallel_replicas(ckpts, tp1):
    """`jaxinfer serve -tp 2 -dp 2`'s path: the engine core (a spawned process, which sees the same 8 devices)
    runs two tensor-parallel replicas; concurrent completions get the plain engine's greedy text; vLLM's
    X-data-parallel-rank header runs a request on that replica, a bad one is a 400 naming it."""
    uvicorn = pytest.importorskip("uvicorn")
    import socket
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from jaxinfer.server import CoreProcess, build_app
    core = CoreProcess(ckpts["gqa_v509"], {**BASE, "data_parallel_size": 2, "tensor_parallel_size": 2})
    app = build_app(core.info, "tiny", alive=core.alive)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            assert thread.is_alive(), "server failed to start"
            time.sleep(0.05)
        rng = np.random.default_rng(2)
        ps = [rng.integers(0, 500, n).tolist() for n in (7, 19, 4, 26, 11, 15)]
        want = [o.outputs[0].text for o in tp1.generate(ps, GREEDY, use_tqdm=False)]

        def complete(p):
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                           json=dict(model="tiny", prompt=p, max_tokens=8, temperature=0, ignore_eos=True))
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]
        with ThreadPoolExecutor(len(ps)) as pool:
            assert list(pool.map(complete, ps)) == want
        url = f"http://127.0.0.1:{port}"
        for rank in (1, 1, 0):                  # vLLM's X-data-parallel-rank header: that replica runs it
            before = [r["generated_tokens"] for r in httpx.get(url + "/stats").json()["replicas"]]
            r = httpx.post(url + "/v1/chat/completions" if rank else url + "/v1/completions", timeout=120,
                           headers={"X-data-parallel-rank": str(rank)},
                           json=dict(model="tiny", max_tokens=8, temperature=0, ignore_eos=True,
                                     **({"messages": [{"role": "user", "content": "hi"}]} if rank else
                                        {"prompt": ps[0]})))
            assert r.status_code == 200, r.text
            after = [r["generated_tokens"] for r in httpx.get(url + "/stats").json()["replicas"]]
            assert after[rank] - before[rank] == 8 and after[1 - rank] == before[1 - rank], (rank, before, after)
        for bad in ("2", "-1", "one"):
            r = httpx.post(url + "/v1/completions", headers={"X-data-parallel-rank": bad},
                           json=dict(model="tiny", prompt=ps[0], max_tokens=2))
            assert r.status_code == 400 and "X-data-parallel-rank" in r.json()["error"]["message"], r.text
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        assert core.shutdown() == 0, "the engine core did not exit cleanly"


def test_replicas_load_replica_zeros_compiled_steps(ckpts, tp1, prompts, monkeypatch):
    """Warm-up compiles each step once: the second replica (devices 2, 3) loads replica 0's executables
    (devices 0, 1) onto its own devices instead of compiling them again, and they compute the same tokens."""
    import jaxinfer.engine.executables as executables
    loaded, real = [], executables.relocate

    def counting(exe, src, dst):
        out = real(exe, src, dst)
        loaded.append((tuple(d.id for d in src), tuple(d.id for d in dst), out is not None))
        return out
    monkeypatch.setattr(executables, "relocate", counting)
    kw = {**BASE, "max_num_seqs": 3, "warmup": True, "num_scheduler_steps": 1}    # programs no other test made
    llm = LLM(ckpts["gqa_v509"], data_parallel_size=2, tensor_parallel_size=2, **kw)
    assert len(loaded) == len(llm.engine.replicas[1].runner.compiled) > 0
    assert all(src == (0, 1) and dst == (2, 3) for src, dst, _ in loaded), loaded
    # (XLA CPU cannot serialize some programs, e.g. a sort's comparator: those are compiled, as before)
    assert sum(ok for _, _, ok in loaded) >= len(loaded) // 2, loaded
    sp = [SamplingParams(temperature=0.9, max_tokens=6, ignore_eos=True, seed=i) for i in range(6)]
    got = run(llm, prompts * 2, sp)
    assert llm.stats()["compilations"] == 0
    assert got == run(tp1, prompts * 2, sp)


@pytest.mark.parametrize("kw, words", [
    (dict(tensor_parallel_size=0), ["tensor_parallel_size=0"]),
    (dict(data_parallel_size=-1), ["data_parallel_size=-1"]),
    (dict(tensor_parallel_size=4, data_parallel_size=4), ["16", "8 are available (cpu); on a CPU, XLA_FLAGS="]),
    (dict(tensor_parallel_size=3), ["tensor_parallel_size=3", "num_attention_heads=4"]),
    (dict(tensor_parallel_size=8), ["tensor_parallel_size=8", "num_attention_heads=4"]),
])
def test_bad_sizes_are_refused(ckpts, kw, words):
    with pytest.raises(ValueError) as e:
        LLM(ckpts["gqa_v509"], **{**BASE, **kw})
    assert all(w in str(e.value) for w in words), str(e.value)


def test_jax_default_device_places_a_one_device_engine(ckpts, tp1, prompts):
    """LLM() on one device goes where the user's jax.default_device says (else the first device)."""
    want = run(tp1, prompts)
    with jax.default_device(jax.devices()[3]):
        llm = LLM(ckpts["gqa_v509"], **BASE)
    assert [d.id for d in llm.engine.runner.placement.devices] == [3]
    assert {d.id for leaf in jax.tree.leaves(llm.engine.runner.params) for d in leaf.devices()} == {3}
    assert run(llm, prompts) == want


def test_kv_heads_neither_dividing_is_refused(tmp_path):
    path = make_tiny_model(str(tmp_path / "h6k3"), num_attention_heads=6, num_key_value_heads=3, head_dim=16,
                           hidden_size=96)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 and num_key_value_heads=3"):
        LLM(path, tensor_parallel_size=2, **BASE)


def test_no_compilation_after_warmup_with_replicas(ckpts):
    """Replicas warm up concurrently; a replica's compilations must not count as another's after warm-up."""
    llm = LLM(ckpts["mqa"], **{**BASE, "max_model_len": 16, "warmup": True, "num_scheduler_steps": 1},
              data_parallel_size=2)     # K-step variants have their own warm-up test (test_multistep.py)
    ps = [[1, 2, 3], [4, 5, 6, 7, 8], [9] * 12, [10, 11]]
    run(llm, ps, [SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                  SamplingParams(temperature=0.7, top_k=5, max_tokens=3, ignore_eos=True, seed=1)] * 2)
    st = llm.stats()
    assert st["compilations"] == 0 and all(r["compilations"] == 0 for r in st["replicas"]), st
    assert st["compiled_buckets"] == len(llm.engine.runner.buckets())


def test_lazy_replicas_compile_a_step_once(ckpts):
    """Compiling lazily (the CPU default), replicas that first need the same step in the same engine step (their
    launches run from threads at once) compile it once: one builds it, the other loads it onto its devices."""
    kw = {**BASE, "max_num_seqs": 2, "max_num_batched_tokens": 24, "prefill_buckets": (24,)}   # programs of its own
    llm = LLM(ckpts["mqa"], data_parallel_size=2, **kw)
    run(llm, [[1, 2, 3], [4, 5, 6, 7]], SamplingParams(temperature=0, max_tokens=3))
    per = [r["compilations"] for r in llm.stats()["replicas"]]
    programs = len(llm.engine.replicas[0].runner.compiled)
    assert programs == len(llm.engine.replicas[1].runner.compiled) > 0
    assert sum(per) == programs, per          # each program compiled by one replica, loaded by the other
    assert llm.stats()["compilations"] == sum(per)                   # the replicas' counts add up


def test_stop_string_cut_is_charged_to_its_replica(ckpts):
    """A stop string matched inside a K-step call, in the call where the request finishes: the tokens read back
    after the match are removed from the counts of the replica that ran the request, not another's."""
    kw = {**BASE, "num_scheduler_steps": 4}
    ref = LLM(ckpts["gqa_v509"], **kw)
    tok = ref.get_tokenizer()
    o = ref.generate(["Hello world"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                     use_tqdm=False)[0].outputs[0]
    stop = tok.decode([o.token_ids[5]])
    assert stop and stop not in tok.decode(o.token_ids[:5]), "pick a token whose text first appears at position 6"
    llm = LLM(ckpts["gqa_v509"], data_parallel_size=2, **kw)
    outs = llm.generate([list(range(1, 40)), "Hello world"],
                        [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                         SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=[stop])], use_tqdm=False)
    n = [len(x.outputs[0].token_ids) for x in outs]
    st = llm.stats()
    assert st["generated_tokens"] == sum(n)
    assert sorted(r["generated_tokens"] for r in st["replicas"]) == sorted(n), (n, st["replicas"])


def api_run(llm, tag, ps, interrupt=None):
    """ps through the engine API (cumulative outputs); `interrupt(api)` is called at the third step instead of it."""
    api, got, k = llm.llm_engine, {}, 0
    for i, p in enumerate(ps):
        api.add_request(f"{tag}{i}", p, GREEDY)
    while api.has_unfinished_requests():
        k += 1
        outs = interrupt(api) if interrupt is not None and k == 3 else api.step()
        for out in outs or []:
            got[out.request_id] = list(out.outputs[0].token_ids)
    return [got[f"{tag}{i}"] for i in range(len(ps))]


@pytest.mark.parametrize("where", ["a replica's call", "finish_dispatch", "_apply"])
def test_engine_api_requests_outlive_an_interrupted_step_on_replicas(ckpts, tp1, prompts, where):
    """Ctrl-C inside the engine API's step() (replica 1's device call ran but its outputs were dropped, or the
    step's bookkeeping was half done): its requests go on after it (they compute their KV again) with the plain
    engine's tokens, and every block returns. Before, they got wrong tokens or every later step raised."""
    kw = {**BASE, "max_model_len": 56}     # programs of its own (other tests count the shared ones they compile)
    llm = LLM(ckpts["gqa_v509"], data_parallel_size=2, **kw)
    ps = prompts * 2
    want = run(tp1, ps)

    def interrupt(api):
        if where == "a replica's call":
            interrupt_at_call([llm.engine.replicas[1].runner], 1)
            try:
                with pytest.raises(KeyboardInterrupt):
                    api.step()
            finally:
                del llm.engine.replicas[1].runner.compile
        else:
            assert Interrupt(3, where).run(api.step) is not None
    assert api_run(llm, "a", ps, interrupt) == want
    assert run(llm, ps) == want


@pytest.mark.parametrize("where", ["finish_dispatch", "_apply"])
def test_data_parallel_engine_step_itself_recovers_from_an_interrupt(ckpts, tp1, prompts, where):
    """Ctrl-C in a replica's bookkeeping after the device calls of a decode step ran, through `llm.engine.step()`
    itself (no LLM or engine API around it): DPEngine.step recovers, so the requests go on with the plain
    engine's tokens (before: a wrong replay of that step)."""
    llm = LLM(ckpts["gqa_v509"], data_parallel_size=2, **BASE)
    ps = prompts * 2
    eng = llm.engine
    seqs = [eng.add_request(p, GREEDY) for p in ps]
    for _ in range(3):
        eng.step()
    caught = Interrupt(3, where).run(eng.step) is not None
    while eng.has_unfinished():
        eng.step()
    assert caught and [s.output_token_ids for s in seqs] == run(tp1, ps)
    assert run(llm, ps) == run(tp1, ps)


def test_replicas_route_requests_without_rescanning_their_queues(ckpts, monkeypatch):
    """Each add counted every queued sequence of every replica (N adds: O(N^2)); the loads are now counted once a
    step. A request that ends on a stop string leaves no entry in the replica map behind."""
    import jaxinfer.engine.dp_engine as dp_engine
    llm = LLM(ckpts["gqa_v509"], data_parallel_size=2, **BASE)
    counted = []
    real = dp_engine.outstanding_tokens
    monkeypatch.setattr(dp_engine, "outstanding_tokens", lambda r: counted.append(r) or real(r))
    outs = llm.generate([[i % 400 + 1, 5, 6] for i in range(40)], SamplingParams(temperature=0, max_tokens=2,
                        ignore_eos=True), use_tqdm=False)
    assert len(counted) == 2 and len(outs) == 40
    st = llm.stats()
    assert min(r["generated_tokens"] for r in st["replicas"]) == 40          # an even split: 20 requests each
    tok = llm.get_tokenizer()
    for _ in range(3):
        o = llm.generate(["Hello world"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0]
        stop = tok.decode(o.token_ids[1:3])
        llm.generate(["Hello world"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=[stop]),
                     use_tqdm=False)
    assert len(llm.engine._owner) <= 1
