"""On-device sampling: greedy equivalences, seeds, and sampled frequencies vs the softmax."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.sampling import sample
from jaxinfer.sampling_params import SamplingParams


def run(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seeds=None, counters=None):
    B = logits.shape[0]
    full = lambda v, dt: jnp.full((B,), v, dt)
    seeds = jnp.arange(B, dtype=jnp.int32) if seeds is None else seeds
    counters = jnp.zeros(B, jnp.int32) if counters is None else counters
    filtered = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p).needs_filter
    f = jax.jit(sample, static_argnames="filtered")
    return np.asarray(f(logits, full(temperature, jnp.float32), full(top_k, jnp.int32), full(top_p, jnp.float32),
                        full(min_p, jnp.float32), seeds, counters, filtered=filtered))


@pytest.fixture
def logits():
    return jax.random.normal(jax.random.PRNGKey(0), (64, 50)) * 3


def test_greedy_variants_equal_argmax(logits):
    greedy = np.asarray(jnp.argmax(logits, -1))
    assert (run(logits, temperature=0.0) == greedy).all()
    assert (run(logits, temperature=1.0, top_k=1) == greedy).all()
    assert (run(logits, temperature=1.0, top_p=1e-6) == greedy).all()
    assert (run(logits, temperature=1.0, min_p=1.0) == greedy).all()


def test_same_seed_same_tokens_other_seed_differs(logits):
    a = run(logits, seeds=jnp.full(64, 7, jnp.int32))
    b = run(logits, seeds=jnp.full(64, 7, jnp.int32))
    c = run(logits, seeds=jnp.full(64, 8, jnp.int32))
    assert (a == b).all() and (a != c).any()


def test_filters_do_not_change_unfiltered_draw(logits):
    # top_k=V through the sorted path must give the same draw as the plain path (same noise per token)
    plain = run(logits)
    via_sort = run(logits, top_k=50)
    assert (plain == via_sort).all()


def test_plain_variant_ignores_filters_and_matches_sorted_for_unfiltered_rows(logits):
    B = logits.shape[0]
    args = (jnp.ones(B), jnp.zeros(B, jnp.int32), jnp.ones(B), jnp.zeros(B), jnp.arange(B), jnp.zeros(B, jnp.int32))
    a = sample(logits, *args, filtered=False)
    b = sample(logits, *args, filtered=True)
    assert (np.asarray(a) == np.asarray(b)).all()


def test_ties_keep_the_lowest_ids_as_a_stable_sort():
    """Equal logits: top-k keeps the first k ids (a stable descending sort's order), so top_k=1 always draws id 0
    and top_k=3 only ids 0-2; top_p keeps the lowest ids whose exclusive mass is below it (20 equal tokens, top_p
    0.12: ids 0-2). `gumbel_at` gives the noise of ids in any order, equal to `gumbel_noise`'s entries."""
    from jaxinfer.sampling import gumbel_at, gumbel_noise
    flat = jnp.zeros((64, 20))
    assert (run(flat, temperature=1.0, top_k=1) == 0).all()
    assert set(run(flat, temperature=1.0, top_k=3).tolist()) == {0, 1, 2}
    assert set(run(flat, temperature=1.0, top_p=0.12).tolist()) == {0, 1, 2}
    seeds, counters = jnp.arange(4), jnp.arange(4) + 9
    ids = jnp.asarray(np.random.default_rng(0).permutation(20)[None, :].repeat(4, 0))
    np.testing.assert_array_equal(np.asarray(gumbel_at(seeds, counters, ids)),
                                  np.take_along_axis(np.asarray(gumbel_noise(seeds, counters, 20)), np.asarray(ids), 1))


def test_noise_is_uniform_gumbel_and_row_local():
    from jaxinfer.sampling import gumbel_noise
    g = np.asarray(gumbel_noise(jnp.arange(4), jnp.arange(4), 50000))
    u = np.exp(-np.exp(-g))                                   # back to the uniforms
    assert np.isfinite(g).all()
    hist = np.histogram(u, bins=20, range=(0, 1))[0] / u.size
    assert np.abs(hist - 0.05).max() < 0.002, hist
    assert abs(np.corrcoef(u[0], u[1])[0, 1]) < 0.02
    one = np.asarray(gumbel_noise(jnp.array([2]), jnp.array([2]), 50000))[0]
    np.testing.assert_array_equal(one, g[2])                  # a row does not depend on its neighbours


# (seed, token id) pairs whose hash at counter 0 is among the largest 2^8 of 2^32: with a 24-bit uniform, u = 1.0
EXTREME_DRAWS = [(21686, 31), (35500, 390), (50416, 511), (71781, 294)]


def test_no_token_gets_infinite_noise_and_the_filters_hold():
    """A uniform of 1.0 once made an id's Gumbel noise +inf: it won the draw whatever its logit, the temperature or
    the filters (masked logits plus inf), one id in 2^24, ~0.9% of draws at Qwen3's 151,936 ids."""
    from jaxinfer.sampling import exponential, gumbel_at
    e = np.asarray(exponential(jnp.array([0, 1, 0xFFFFFF7F, 0xFFFFFFFF], jnp.uint32)))
    assert np.isfinite(e).all() and (e > 0).all() and e[0] < e[1] < e[2] <= e[3], e
    seeds = jnp.array([s for s, _ in EXTREME_DRAWS], jnp.int32)
    ids = jnp.array([[t] for _, t in EXTREME_DRAWS], jnp.uint32)
    assert np.isfinite(np.asarray(gumbel_at(seeds, jnp.zeros(len(EXTREME_DRAWS), jnp.int32), ids))).all()
    logits = jnp.asarray(np.tile(np.linspace(5.0, -5.0, 512, dtype=np.float32), (len(EXTREME_DRAWS), 1)))
    peaked = logits.at[:, 0].set(10.0)
    assert (run(peaked, temperature=0.01, seeds=seeds) == 0).all()            # the extreme id is far below id 0
    assert (run(logits, temperature=1.0, top_k=3, seeds=seeds) < 3).all()
    assert (run(logits, temperature=1.0, min_p=0.5, seeds=seeds) < 36).all()  # logits within ln 2 of the top


def test_the_noise_tail_is_gumbels_far_out():
    """P(noise > x) over all 2^32 hash values (the noise falls as the hash grows: bisect for the count) against
    Gumbel's 1 - exp(-e^-x): a token x logits below the top keeps its odds. A uniform of 23 or 24 bits stopped
    the noise at 16.6, so tokens ~19.4 or more below the top of a 151,936-token row were never drawn."""
    from jaxinfer.sampling import exponential
    noise = jax.jit(lambda b: -jnp.log(exponential(b)))
    for x in (5.0, 12.0, 16.0, 18.0, 19.5, 21.0):
        lo, hi = 0, 2**32 - 1                                    # the first hash value whose noise is <= x
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if float(noise(jnp.uint32(mid))) <= x else (mid + 1, hi)
        want = -np.expm1(-np.exp(-x)) * 2**32
        assert abs(lo - want) <= 0.05 * want + 1, (x, lo, want)


def test_top_p_one_keeps_every_token_in_the_sorted_draw():
    """top_p = 1 keeps all (vLLM): the fp32 running sum of a 151,936-token row reaches 1.0 before its end, which
    dropped the smallest tokens when a batch ran the sorted draw (a row's token then depended on its neighbours)."""
    from jaxinfer.sampling import _keep_sorted
    row = np.sort(np.random.default_rng(0).normal(0, 4, 151_936).astype(np.float32))[::-1]
    keep = np.asarray(_keep_sorted(jnp.asarray(row[None]), jnp.array([0]), jnp.array([1.0]), jnp.array([0.0])))
    assert keep.all()
    keep = np.asarray(_keep_sorted(jnp.asarray(row[None]), jnp.array([100]), jnp.array([1.0]), jnp.array([0.0])))
    assert keep.sum() == 100


def _freqs(row, n=4000, **kw):
    logits = jnp.broadcast_to(row, (n, row.shape[0]))
    ids = run(logits, seeds=jnp.arange(n, dtype=jnp.int32), **kw)
    return np.bincount(ids, minlength=row.shape[0]) / n


def test_frequencies_match_softmax():
    row = jnp.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    for t in (1.0, 0.5):
        expect = np.asarray(jax.nn.softmax(row / t))
        got = _freqs(row, temperature=t)
        assert np.abs(got - expect).max() < 0.03, (t, got, expect)


def test_top_k_top_p_min_p_restrict_support():
    row = jnp.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    p = np.asarray(jax.nn.softmax(row))
    got = _freqs(row, top_k=2)
    assert got[2:].sum() == 0 and abs(got[0] - p[0] / p[:2].sum()) < 0.03
    got = _freqs(row, top_p=0.7)            # 0.53 + 0.19 crosses 0.7 after two tokens
    assert got[2:].sum() == 0
    got = _freqs(row, min_p=0.2)            # keeps p >= 0.2 * p_max = 0.106: tokens 0, 1, 2
    assert got[3:].sum() == 0 and got[2] > 0


def test_tiny_temperature_and_seed_minus_one_as_vllm():
    assert SamplingParams(temperature=1e-37).temperature == 0.01 and SamplingParams(temperature=0).greedy
    assert SamplingParams(seed=-1).seed is None and SamplingParams(seed=-2).seed == -2
    row = jnp.array([40.0, 50.0, 0.0])          # 1e-37 would give inf, inf: a tie the argmax breaks to token 0
    assert _freqs(row, n=8, temperature=SamplingParams(temperature=1e-37).temperature)[1] == 1
    huge = SamplingParams(temperature=1e300).temperature                  # float32 keeps it finite: uniform draws
    freqs = _freqs(jnp.array([40.0, 50.0, -jnp.inf]), n=64, temperature=huge)  # (-inf: a padded vocabulary)
    assert np.isfinite(np.float32(huge)) and (freqs[:2] > 0.2).all() and freqs[2] == 0


def test_top_p_applies_to_what_top_k_and_min_p_leave():
    """vLLM's order: min-p, top-k, then top-p over the survivors renormalised. probs 0.5, 0.3, 0.1, 0.1: after
    top_k=2 (or min_p=0.3) token 0 alone holds 0.625 >= top_p=0.6 of what is left, so it alone is drawn."""
    row = jnp.log(jnp.array([0.5, 0.3, 0.1, 0.1]))
    for kw in (dict(top_k=2), dict(min_p=0.3)):
        assert _freqs(row, n=500, top_p=0.6, **kw)[1:].sum() == 0, kw
        got = _freqs(row, n=2000, top_p=0.7, **kw)            # 0.625 < 0.7: tokens 0 and 1, renormalised
        assert got[2:].sum() == 0 and abs(got[0] - 0.625) < 0.04, (kw, got)


@pytest.mark.parametrize("kw, name", [
    (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(min_p=1.5), "min_p"), (dict(min_p=-0.1), "min_p"),
    (dict(max_tokens=0), "max_tokens"), (dict(stop=[""]), "stop"), (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(stop=5), "stop=5"), (dict(stop_token_ids=5), "stop_token_ids=5"), (dict(temperature=True), "temperature"),
    (dict(temperature=float("inf")), "temperature"), (dict(top_p=True), "top_p"), (dict(max_tokens=2.0), "max_tokens"),
])
def test_bad_sampling_params(kw, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kw)


@pytest.mark.parametrize("V, n", [(151936 // 64, 5), (1000, 20), (509, 5), (300, 3), (40, 5)])
def test_top_n_of_equals_lax_top_k(V, n):
    """The chunked top-n of the logprob variant gives lax.top_k's values and ids, ties included."""
    import jax
    from jaxinfer.sampling import top_n_of
    rng = np.random.default_rng(V)
    x = rng.standard_normal((7, V)).astype(np.float32)
    x[0, :] = 1.0                                      # all tied: the lowest ids
    x[1, ::37] = 9.0                                   # ties across chunks
    x[2, -3:] = 50.0                                   # the best ones in the padded last chunk
    vals, ids = jax.jit(top_n_of, static_argnums=1)(x, n)
    ref_vals, ref_ids = jax.lax.top_k(x, n)
    np.testing.assert_array_equal(np.asarray(vals), np.asarray(ref_vals))
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(ref_ids))


def test_request_seeds_past_31_bits_are_hashed_not_masked():
    from jaxinfer.sampling import device_seed
    assert [device_seed(s) for s in (0, 5, 2**31 - 1)] == [0, 5, 2**31 - 1]      # seeds that fit: themselves
    big = [device_seed(s) for s in (2**32, 2**40, -2**32, 2**31, -1 - 2**70)]
    assert len(set(big + [0])) == len(big) + 1 and all(0 <= s < 2**31 for s in big)   # no longer all 0
    assert device_seed(2**40) == device_seed(2**40)


def test_sampling_params_set_after_construction_are_checked_as_vllm_allows():
    """vLLM's SamplingParams can be changed after construction; here a change is validated (and normalised) like
    a new one, and clone() / from_optional() are vLLM's."""
    sp = SamplingParams(temperature=0.5)
    sp.max_tokens, sp.stop = 5, "x"
    assert sp == SamplingParams(temperature=0.5, max_tokens=5, stop=["x"]) and sp.stop == ["x"]
    with pytest.raises(ValueError, match="SamplingParams.top_p=0"):
        sp.top_p = 0
    with pytest.raises(AttributeError, match="no field 'max_new_tokens'"):
        sp.max_new_tokens = 3
    assert sp.top_p == 1.0 and SamplingParams(**{**sp.__dict__, "seed": 3}).seed == 3
    c = sp.clone()
    c.max_tokens = 9
    assert sp.max_tokens == 5
    # fields edited one at a time may pass through a state valid for neither (vLLM checks none of them): a value
    # valid alone is taken, the whole is checked again when a request uses it (the engine clones it)
    sp = SamplingParams(max_tokens=64, min_tokens=32)
    sp.max_tokens = 8
    with pytest.raises(ValueError, match="min_tokens=32 must be an integer in"):
        sp.clone()
    sp.min_tokens = 4
    assert sp == SamplingParams(max_tokens=8, min_tokens=4)
    with pytest.raises(ValueError, match="max_tokens='x'"):
        sp.max_tokens = "x"
    for start, edits in ((dict(max_tokens=8), dict(min_tokens=10, max_tokens=32)),   # either order of each pair
                         (dict(temperature=0), dict(n=3, temperature=1.0)),
                         (dict(stop=["x"]), dict(detokenize=False, stop=None)),
                         (dict(min_tokens=2), dict(stop_token_ids=list(range(20)), min_tokens=0))):
        for order in (list(edits), list(edits)[::-1]):
            sp = SamplingParams(**start)
            for name in order:
                setattr(sp, name, edits[name])
            assert sp.clone() == SamplingParams(**{**start, **edits}), (start, order)
    sp = SamplingParams(n=3)
    sp.temperature = 0
    sp.stop_token_ids = iter([5, 6])           # (a one-shot iterator, taken once whatever the state)
    sp.n = 1
    assert sp.clone().stop_token_ids == [5, 6]
    with pytest.raises(ValueError, match=r"min_tokens=-1 must be an integer in \[0, max_tokens=16\]"):
        SamplingParams().min_tokens = -1       # (invalid alone: refused with the present state's words)
    assert SamplingParams.from_optional(temperature=None, top_k=None, max_tokens=3) == SamplingParams(max_tokens=3)


def test_detokenize_and_truncate_prompt_tokens_are_checked():
    assert SamplingParams(detokenize=False, truncate_prompt_tokens=-1).truncate_prompt_tokens == -1
    for kw, name in ((dict(detokenize=False, stop="x"), "detokenize"), (dict(detokenize=1), "detokenize"),
                     (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
                     (dict(truncate_prompt_tokens=-2), "truncate_prompt_tokens")):
        with pytest.raises(ValueError, match=f"SamplingParams.{name}="):
            SamplingParams(**kw)


@pytest.mark.parametrize("V", [40, 1000])
def test_small_top_k_draws_the_same_without_the_sort(V):
    """filtered="top_k" (no sort: the rows' top candidates) draws exactly the token of the sorted program for rows
    with 0 < top_k <= TOP_K_CANDIDATES, whatever their top_p / min_p, and the plain draw for rows that do not
    filter; so a row's token does not depend on which program its batch ran. Ties (equal logits) included, and a
    vocabulary smaller than the candidate count."""
    from jaxinfer.sampling_params import TOP_K_CANDIDATES
    B = 96
    x = jax.random.normal(jax.random.PRNGKey(V), (B, V)) * jnp.linspace(0.1, 6, B)[:, None]
    x = x.at[::7].set(jnp.round(x[::7]))                                   # rows full of ties
    r = np.random.default_rng(V)
    top_k = jnp.asarray(np.where(np.arange(B) % 5 == 0, 0, r.integers(1, TOP_K_CANDIDATES + 1, B)), jnp.int32)
    unfiltered = np.asarray(top_k) == 0
    top_p = jnp.asarray(np.where(unfiltered | (np.arange(B) % 3 == 0), 1.0, r.uniform(0.3, 1.0, B)), jnp.float32)
    min_p = jnp.asarray(np.where(unfiltered | (np.arange(B) % 4 != 1), 0.0, r.uniform(0, 0.5, B)), jnp.float32)
    temperature = jnp.asarray(np.where(np.arange(B) % 11 == 3, 0.0, r.uniform(0.5, 3, B)), jnp.float32)
    f = jax.jit(sample, static_argnames="filtered")
    for step in range(4):
        args = (x, temperature, top_k, top_p, min_p, jnp.arange(B, dtype=jnp.int32), jnp.full(B, step, jnp.int32))
        fast, sort = np.asarray(f(*args, filtered="top_k")), np.asarray(f(*args, filtered=True))
        np.testing.assert_array_equal(fast, sort)
        np.testing.assert_array_equal(fast[unfiltered], np.asarray(f(*args, filtered=False))[unfiltered])
        given = np.asarray(sample(*args, filtered="top_k", plain=jnp.full(B, -7, jnp.int32)))   # the step's ids
        assert (given[unfiltered] == -7).all() and (given[~unfiltered] == fast[~unfiltered]).all()
        assert (fast[np.asarray(top_k) == 1] == np.asarray(jnp.argmax(x, -1))[np.asarray(top_k) == 1]).all()
        # "top_k_only" (every row greedy or with such a top_k: no plain draw) on the rows it may take
        only = ~unfiltered | (np.asarray(temperature) == 0)
        mine = np.asarray(f(*(a[only] if getattr(a, "ndim", 0) and a.shape[0] == B else a for a in args),
                            filtered="top_k_only"))
        np.testing.assert_array_equal(mine, fast[only])


def test_draws_from_candidates_checks_every_row():
    """The host's check for the "top_k_only" step: every row greedy (padding included) or 1 <= top_k <= bound."""
    from jaxinfer.sampling_params import TOP_K_CANDIDATES
    from jaxinfer.step import RESAMPLE_FIELDS, draws_from_candidates

    def fields(temperature, top_k):
        f = np.zeros((len(RESAMPLE_FIELDS), len(top_k)), np.int32)
        f[RESAMPLE_FIELDS.index("temperature")] = np.asarray(temperature, np.float32).view(np.int32)
        f[RESAMPLE_FIELDS.index("top_k")] = top_k
        return f.reshape(-1)
    assert draws_from_candidates(fields([0.6, 0.0, 0.0], [20, 0, 0]), 3)
    assert draws_from_candidates(fields([0.6, 1.0], [1, TOP_K_CANDIDATES]), 2)
    assert not draws_from_candidates(fields([0.6, 0.7], [20, 0]), 2)                 # a plain-sampled row
    assert not draws_from_candidates(fields([0.6, 0.7], [20, TOP_K_CANDIDATES + 1]), 2)


def test_filter_kind_and_batch_filter():
    from jaxinfer.sampling import batch_filter
    from jaxinfer.sampling_params import TOP_K_CANDIDATES
    kind = lambda **kw: SamplingParams(**kw).filter_kind
    assert kind() is False and kind(temperature=0.0, top_p=0.5) is False
    assert kind(top_k=20, top_p=0.95) == "top_k" and kind(top_k=TOP_K_CANDIDATES, min_p=0.1) == "top_k"
    assert kind(top_k=TOP_K_CANDIDATES + 1) is True and kind(top_p=0.9) is True and kind(min_p=0.1) is True
    assert batch_filter([False, False]) is False and batch_filter([False, "top_k"]) == "top_k"
    assert batch_filter(["top_k", True, False]) is True and batch_filter([]) is False


def test_integer_sort_keys_order_as_the_float_sort(monkeypatch):
    """The filtered draw sorts uint32 keys (CUB's radix sort on the GPU): the same order, ties by lower id, as the
    stable float sort it replaced, on rows with ties, +-0.0, +-inf and both signs; and the same tokens."""
    import jaxinfer.sampling as sampling
    x = jax.random.normal(jax.random.PRNGKey(3), (6, 700)) * 5
    x = x.at[0, :40].set(0.0).at[0, 40:80].set(-0.0).at[1, ::3].set(1.25).at[2, :4].set(-jnp.inf)
    x = x.at[3, 5:9].set(jnp.inf).at[4].set(-jnp.abs(x[4])).at[5].set(jnp.abs(x[5]) + 1e-30)
    got = {}
    for keys in ("float", "uint32"):
        monkeypatch.setattr(sampling, "SORT_KEYS", keys)
        monkeypatch.setattr(sampling, "SORTED_DRAW", "ids")             # the draw that uses this sort
        values, order = jax.jit(sampling.sort_descending)(x)
        got[keys] = (np.asarray(values), np.asarray(order))
        ref = np.argsort(-np.asarray(x), axis=-1, kind="stable")
        np.testing.assert_array_equal(got[keys][1], ref)
        np.testing.assert_array_equal(got[keys][0], np.take_along_axis(np.asarray(x), ref, -1))
        jax.clear_caches()
        got[keys + "_ids"] = run(x[1:2].repeat(64, 0), temperature=0.9, top_p=0.7, min_p=0.01)
    np.testing.assert_array_equal(got["float_ids"], got["uint32_ids"])


@pytest.mark.parametrize("case", ["random", "ties"])
def test_threshold_draw_equals_the_sorted_draw_with_ids(monkeypatch, case):
    """Rows that need the sort draw by threshold (values sorted alone, the draw in the row's own order) and get the
    tokens of the draw over the row sorted with its ids: every filter and temperature 0, with ties at the kept
    prefix's end (equal logits: the lowest ids are kept first), top_k past the 64 candidates, min_p, top_p."""
    import jaxinfer.sampling as sampling
    rng = np.random.default_rng(5)
    B, V = 48, 300
    x = rng.normal(size=(B, V)).astype(np.float32) * 2
    if case == "ties":                            # values from a few levels: long runs of equal logits
        x = np.round(x * 1.5) / 1.5
        x[:8] = 0.0
    params = (jnp.asarray(rng.choice([0.0, 0.7, 1.0, 1.6], B), jnp.float32),
              jnp.asarray(rng.choice([0, 0, 3, 70, 200], B), jnp.int32),
              jnp.asarray(rng.choice([1.0, 0.95, 0.5, 0.12, 0.999], B), jnp.float32),
              jnp.asarray(rng.choice([0.0, 0.0, 0.05, 0.3], B), jnp.float32))
    got = {}
    for form in ("ids", "threshold"):
        monkeypatch.setattr(sampling, "SORTED_DRAW", form)
        monkeypatch.setattr(sampling, "SORT_KEYS", "float")      # the sort the draw used before either change
        f = jax.jit(lambda lg, c: sampling.sample(lg, *params, jnp.arange(B), c, filtered=True))
        got[form] = np.stack([np.asarray(f(jnp.asarray(x), jnp.full((B,), c, jnp.int32))) for c in range(12)])
        jax.clear_caches()
    np.testing.assert_array_equal(got["ids"], got["threshold"])
    assert len(np.unique(got["ids"][:, 8])) > 1 or params[0][8] == 0       # a tied row still samples


def test_threshold_draw_breaks_equal_logit_plus_noise_as_the_sorted_draw(monkeypatch):
    """Logit + noise equal in fp32 for several kept tokens: both draws take the larger logit (the sorted order),
    not the lower id. The noise is replaced by a fixed table that makes ids 0-2 tie."""
    import jaxinfer.sampling as sampling
    V = 40
    x = jnp.full((1, V), -5.0).at[0, :3].set(jnp.asarray([1.0, 3.0, 2.0]))
    g = jnp.zeros((V,)).at[:3].set(jnp.asarray([2.0, 0.0, 1.0]))          # x + g = 3 for ids 0, 1, 2
    monkeypatch.setattr(sampling, "gumbel_noise", lambda seeds, counters, n, start=0: jnp.broadcast_to(g, (1, n)))
    monkeypatch.setattr(sampling, "gumbel_at", lambda seeds, counters, ids: g[ids])
    one = lambda v, dt: jnp.full((1,), v, dt)
    got = {}
    for form in ("ids", "threshold"):
        monkeypatch.setattr(sampling, "SORTED_DRAW", form)
        got[form] = int(sampling.sample(x, one(1.0, jnp.float32), one(0, jnp.int32), one(0.999, jnp.float32),
                                        one(0.0, jnp.float32), one(0, jnp.int32), one(0, jnp.int32), filtered=True)[0])
    assert got == {"ids": 1, "threshold": 1}
