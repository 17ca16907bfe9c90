"""The persistent Mosaic GPU prefill (flash_prefill's default; pallas_kernels/mosaic/prefill_persistent.py).

On the CPU: its static schedule (every (unit, q tile) item once, heaviest first, balanced), its lowering for CUDA,
and Mosaic GPU's interpreter against the jnp reference with 2-3 programs each running several q tiles, so the K/V
ring's slots and barrier phases, the ping-pong schedule and the q buffers carry across tiles (the interpreter
fails a waiter that skips a phase, and a wrong ring slot deadlocks it or reads another tile). ~40 s on 2 cores.
The gpu-marked tests run the compiled kernel (PYTHONPATH=. python -m pytest -q -m gpu tests/test_mosaic_persistent.py).
"""
import numpy as np
import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.mosaic import _common, flash_prefill as fp
from pallas_kernels.mosaic.flash_prefill import flash_prefill
from pallas_kernels.mosaic.prefill_persistent import item_counts, item_index
from pallas_kernels.mosaic.prefill_tiles import aligned_tiles
from test_mosaic_prefill import (FP8, LOWER_CASES, check, lowered_text, make_prefill, needs_interpreter, needs_mosaic,
                                 prefill_args)


@pytest.fixture
def on_gpu(monkeypatch):
    """Lets the entry point trace on the CPU: these tests lower for CUDA, they never run the kernel here."""
    monkeypatch.setattr(fp, "_on_gpu", lambda: True)


@pytest.mark.parametrize("num_items,programs", [(1096, 132), (1040, 132), (15, 3), (5, 2), (7, 7), (264, 132)])
def test_schedule_covers_every_item_once(num_items, programs):
    """Program p's r-th item (item_index, the kernel's; counts as the kernel's) covers [0, W) once, each program's
    items in increasing (lighter) order; the traced form agrees with the Python one."""
    seen = []
    for p, count in enumerate(item_counts(num_items, programs)):
        items = [item_index(r, p, programs) for r in range(count)]
        assert items == sorted(items)
        traced = item_index(jnp.arange(count, dtype=jnp.int32), jnp.int32(p), programs)
        np.testing.assert_array_equal(np.asarray(traced), items)
        seen += items
    assert sorted(seen) == list(range(num_items))


def key_tiles(n_new, tile_rows=64, block_kv=128):
    """Key tiles of each q tile of fresh prompts (aligned_tiles' order, heaviest first); 0 for unused tiles."""
    cu = np.concatenate([[0], np.cumsum(n_new)]).astype(np.int32)
    seq, first, end = map(np.asarray, aligned_tiles(jnp.asarray(cu), jnp.asarray(n_new, jnp.int32), int(cu[-1]),
                                                    tile_rows))
    real = (seq < len(n_new)) & (end > first)
    return np.where(real, -(-(end - cu[np.minimum(seq, len(n_new) - 1)]) // block_kv), 0)


@pytest.mark.parametrize("n_new", [[1024] * 8, [8192]])
def test_schedule_balances_qwen3_prefills(n_new):
    """Qwen3-0.6B (8 units of two q heads) on 132 programs: the snake gives each within 4% of the mean key tiles
    (8 x 1024: 32-36, mean 34.9); round-robin over the unit-major grid order would give one 69-92% more."""
    work = np.repeat(key_tiles(n_new), 8)  # item w: q tile w // 8
    per = [sum(work[item_index(r, p, 132)] for r in range(count))
           for p, count in enumerate(item_counts(len(work), 132))]
    assert max(per) <= 1.04 * np.mean(per)


PERSISTENT_LOWER = [LOWER_CASES[0], LOWER_CASES[3], LOWER_CASES[6], LOWER_CASES[8],
                    (1024, 16, 8, 128, 16, 4, 32, jnp.bfloat16, dict(block_kv=64, num_stages=5))]


@needs_mosaic
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim,block_size,batch,width,dtype,opts", PERSISTENT_LOWER)
def test_lowers_for_cuda(on_gpu, tokens, heads, kv_heads, head_dim, block_size, batch, width, dtype, opts):
    """Qwen3 at 8 x 1024 (two q buffers a warpgroup: 231,528 bytes of SMEM), group 3 in halves with 2 pages a
    tile, 3 stages of 64 tokens, pair_heads=False, 5 stages of 64 (one q buffer: two do not fit)."""
    args = prefill_args(tokens, heads, kv_heads, head_dim, block_size, batch, width, dtype)
    text = lowered_text(lambda *a: flash_prefill(*a, **opts, persistent=True), args)
    assert "mosaic_gpu" in text and "triton" not in text


@needs_mosaic
def test_lowers_fp8_and_with_layout_inference(on_gpu, monkeypatch):
    """float8_e4m3fn pages with [L, K] scales (f16 tiles per warpgroup), then Warpgroup lowering (Mosaic's layout
    inference, JAX 0.11's default) of MQA halves with q padded."""
    scales = dict(k_scale=jnp.ones((28, 8)), v_scale=jnp.ones((28, 8)), layer=27)
    args = prefill_args(512, 16, 8, 128, 16, 4, 16, cache_dtype=FP8)
    assert "mosaic_gpu" in lowered_text(lambda *a: flash_prefill(*a, **scales, persistent=True), args)
    monkeypatch.setattr(_common, "LOWERING", "Warpgroup")
    jax.clear_caches()  # the kernel's jit caches traces by shapes
    try:
        args = prefill_args(*LOWER_CASES[1][:-1])
        assert "mosaic_gpu" in lowered_text(lambda *a: flash_prefill(*a, persistent=True, num_programs=16), args)
    finally:
        jax.clear_caches()


def test_smem_of_two_q_buffers():
    """The second q tile per compute warpgroup fits beside Qwen3's default ring (128 x 2), not beside 64 x 5."""
    assert fp.smem_bytes(128, 128, 2, q_buffers=2) <= fp.MAX_SMEM < fp.smem_bytes(128, 64, 5, q_buffers=2)


@needs_mosaic
def test_num_programs_is_checked(on_gpu):
    args, _ = make_prefill(np.random.default_rng(0), [5], [0], 16, 2, 1, 64)
    with pytest.raises(ValueError, match="num_programs"):
        flash_prefill(*args, persistent=True, num_programs=0)


@needs_interpreter
@pytest.mark.parametrize("n_new,prefix,block_size,heads,fp8,opts", [
    # GQA 2 (two heads on the same rows): 4 sequences, a 1-token chunk after 63 cached tokens; program 0 runs
    # items of 3, 2, 2 key tiles, padding rows, an unused tile (ring offsets 0, 3, 5: odd with 2 slots)
    ([100, 1, 150, 30], [20, 63, 0, 40], 16, 2, False, dict(num_programs=2)),
    # no GQA (two 64-row halves, the second often empty), fp8 pages of 8 tokens, one q buffer (see the test)
    ([130, 1, 20, 70], [10, 100, 0, 0], 8, 1, True, dict(num_programs=2)),
    # group 3 (halves), 3 stages, 3 programs of 5 items each (3 units x 5 tiles)
    ([40, 3, 90], [0, 70, 100], 32, 3, False, dict(num_programs=3, num_stages=3)),
])
def test_interpreter_matches_reference(monkeypatch, n_new, prefix, block_size, heads, fp8, opts):
    """Mosaic GPU's interpreter (the warpgroups as threads, TMA, mbarriers, every barrier phase observed; wgmma
    as dots), permuted block tables, cached prefixes, padding rows; ~10 s each on 2 cores."""
    if fp8:  # too little SMEM for a second q tile: the next item's q goes into the one buffer after its last QK^T
        monkeypatch.setattr(fp, "MAX_SMEM", 0)
    args, scales = make_prefill(np.random.default_rng(3), n_new, prefix, block_size, heads, 1, 64, pad_tokens=3,
                                fp8=fp8)
    jax.clear_caches()  # (a trace cached with or without the SMEM patch)
    try:
        check(flash_prefill(*args, interpret=True, block_kv=64, persistent=True, **opts, **scales), args, scales)
    finally:
        jax.clear_caches()


# ---- on the GPU (PYTHONPATH=. python -m pytest -q -m gpu tests/test_mosaic_persistent.py) ----

@pytest.mark.gpu
@pytest.mark.parametrize("n_new,prefix,block_size,heads,kv_heads,head_dim,opts", [
    ([1024] * 8, [0] * 8, 16, 16, 8, 128, {}),  # the bench's 8 x 1024, one program an SM
    ([8192], [0], 16, 16, 8, 128, {}),  # 1 x 8192
    ([512, 1024, 1, 300], [0, 0, 700, 1000], 16, 16, 8, 128, {}),  # fresh prompts, a 1-token chunk
    ([512, 1024, 1, 300], [0, 0, 700, 1000], 16, 16, 8, 128, dict(num_programs=5)),  # ~50 items a program
    ([2048], [0], 16, 16, 8, 128, dict(block_kv=64, num_stages=5)),  # one q buffer (no SMEM for two)
    ([77, 128, 200, 63], [16, 128, 33, 0], 32, 16, 8, 128, dict(num_stages=3, block_kv=64, num_programs=7)),
    ([300, 65], [40, 1000], 16, 4, 1, 128, dict(num_programs=11)),  # MQA
    ([129, 64, 1], [0, 7, 500], 8, 8, 8, 64, {}),  # no GQA (128-row tiles), head_dim 64, 8-token pages
    ([100, 37], [20, 0], 128, 6, 2, 64, dict(block_kv=64, num_programs=3)),  # group 3, pages bigger than a tile
    ([512, 1024, 1, 300], [0, 0, 700, 1000], 16, 16, 8, 128, dict(pair_heads=False, num_programs=13)),
])
def test_gpu_matches_reference(n_new, prefix, block_size, heads, kv_heads, head_dim, opts):
    """Compiled, against the jnp reference (bf16, 2e-2) and the program-per-tile kernel (same work per tile)."""
    args, _ = make_prefill(np.random.default_rng(4), n_new, prefix, block_size, heads, kv_heads, head_dim,
                           pad_tokens=13)
    out = jax.jit(lambda *a: flash_prefill(*a, persistent=True, **opts))(*args)
    check(out, args, {})
    plain = {k: v for k, v in opts.items() if k != "num_programs"}
    one_tile = jax.jit(lambda *a: flash_prefill(*a, **plain, persistent=False))(*args)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(one_tile, np.float32), atol=1e-2, rtol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("num_programs", [None, 9])
def test_gpu_fp8_matches_reference(num_programs):
    args, scales = make_prefill(np.random.default_rng(5), [700, 1, 90], [0, 300, 1000], 16, 16, 8, 128,
                                pad_tokens=5, fp8=True)
    fn = jax.jit(lambda *a: flash_prefill(*a, **scales, block_kv=64, persistent=True, num_programs=num_programs))
    check(fn(*args), args, scales)
