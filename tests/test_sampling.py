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
    f = jax.jit(sample)
    return np.asarray(f(logits, full(temperature, jnp.float32), full(top_k, jnp.int32), full(top_p, jnp.float32),
                        full(min_p, jnp.float32), seeds, counters))


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
    # top_p=1 through the sorted path must give the same draw as the plain path (same noise per token)
    plain = run(logits)
    via_sort = run(logits, top_k=50)
    assert (plain == via_sort).all()


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


@pytest.mark.parametrize("kw, name", [
    (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(min_p=1.5), "min_p"), (dict(min_p=-0.1), "min_p"),
    (dict(max_tokens=0), "max_tokens"), (dict(stop=[""]), "stop"), (dict(stop_token_ids=[-1]), "stop_token_ids"),
])
def test_bad_sampling_params(kw, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kw)
