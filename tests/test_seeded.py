"""Seeded sampling: a request with a seed gets the same tokens whatever else the engine runs: alone or in a
crowded batch, queued behind others, with its prompt chunked, after a preemption, with sync or async
scheduling, on either backend. The noise of token i is a function of (seed, i) only."""
import numpy as np
import pytest

from helpers import TINY_ENGINE

from jaxinfer import LLM, SamplingParams

BASE = TINY_ENGINE


def _requests(n: int = 24):
    rng = np.random.default_rng(7)
    ps = [rng.integers(0, 512, int(rng.integers(3, 30))).tolist() for _ in range(n)]
    sps = [SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=100 + i, max_tokens=16, ignore_eos=True)
           for i in range(n)]
    return ps, sps


def _run(llm, ps, sps):
    outs = llm.generate(ps, sps, use_tqdm=False)
    st = llm.stats()
    assert st["kv_blocks_free"] == st["kv_blocks_total"], st
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def alone(tiny_dir):
    """Each request generated on its own, one at a time (sync scheduling, nothing else in the batch)."""
    ps, sps = _requests()
    llm = LLM(tiny_dir, **{**BASE, "async_scheduling": False})
    return [_run(llm, [p], [sp])[0] for p, sp in zip(ps, sps)]


# Each case crowds the requests differently: 24 requests behind max_num_seqs=8 (most queue), a prompt
# budget of 8 tokens (prompts chunked), a pool of 24 blocks (preemptions), and sync vs async scheduling.
CASES = {
    "queued_async": dict(async_scheduling=True),
    "queued_sync": dict(async_scheduling=False),
    "chunked_async": dict(max_num_batched_tokens=8, prefill_buckets=(8,), enable_prefix_caching=False),
    "preempted_async": dict(num_kvcache_blocks=24),
    "preempted_sync": dict(num_kvcache_blocks=24, async_scheduling=False),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_seeded_tokens_do_not_depend_on_the_batch(tiny_dir, alone, case):
    ps, sps = _requests()
    llm = LLM(tiny_dir, **{**BASE, **CASES[case]})
    assert _run(llm, ps, sps) == alone
    if case.startswith("preempted"):
        assert llm.stats()["preemptions"] > 0
    if case.startswith("chunked"):
        assert llm.stats()["prefill_steps"] > len(ps)


@pytest.mark.parametrize("scheduling", [True, False])
def test_seeded_tokens_pallas_backend(tiny_dir, scheduling):
    """The same check on the Pallas kernels (interpret mode), fewer requests to keep it short."""
    ps, sps = _requests(10)
    cfg = {**BASE, "attn_backend": "pallas", "block_size": 16, "num_kvcache_blocks": 64, "max_num_seqs": 4}
    llm = LLM(tiny_dir, **{**cfg, "async_scheduling": scheduling})
    crowded = _run(llm, ps, sps)
    assert [_run(llm, [p], [sp])[0] for p, sp in zip(ps[:3], sps[:3])] == crowded[:3]
    xla = LLM(tiny_dir, **{**BASE, "async_scheduling": False})
    assert _run(xla, ps, sps) == crowded          # and the backends draw the same tokens


def test_other_seed_gives_other_tokens(tiny_dir, alone):
    ps, sps = _requests(1)
    llm = LLM(tiny_dir, **BASE)
    other = SamplingParams(**{**sps[0].__dict__, "seed": 99})
    assert _run(llm, ps, [other])[0] != alone[0]


def test_the_samples_of_different_seeds_differ():
    """Sample i of n takes seed + i, as vLLM's; as the device takes them (31 bits, a hash past that), seeds whose
    difference is a multiple of 2^31 - 1 do not share samples, and a sum of -1 stays a seed (not "no seed")."""
    from jaxinfer.sampling import device_seed
    for a, b in [(0, 2**31 - 1), (-3, 2**31 - 4), (12345, 12345 + 2**31 - 1), (7, 2**40 + 7)]:
        sa, sb = SamplingParams(n=4, seed=a), SamplingParams(n=4, seed=b)
        derived = [device_seed(p.for_sample(i).seed) for p in (sa, sb) for i in range(1, 4)]
        assert len(set(derived)) == 6, (a, b, derived)
    assert [SamplingParams(n=3, seed=5).for_sample(i).seed for i in range(3)] == [5, 6, 7]
    assert SamplingParams(n=3, seed=-3).for_sample(2).seed == -1


def test_sample_i_of_n_is_the_request_with_seed_plus_i(tiny_dir):
    """vLLM's relation between requests: sample i of (n, seed) draws what one request with seed + i draws."""
    llm = LLM(tiny_dir, **BASE)
    sp = SamplingParams(n=3, seed=11, temperature=1.0, max_tokens=6, ignore_eos=True)
    got = [c.token_ids for c in llm.generate([[1, 2, 3]], sp, use_tqdm=False)[0].outputs]
    one = [llm.generate([[1, 2, 3]], SamplingParams(seed=11 + i, temperature=1.0, max_tokens=6, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids for i in range(3)]
    assert got == one and len({tuple(t) for t in got}) == 3
