"""The xla backend (model/xla_attention.py) against the kernels' jnp references: prefill per query tile with
a causal offset mask (ragged rows, cached prefixes, padding rows and tokens), decode in both forms, fp8."""
import numpy as np
import jax.numpy as jnp
import pytest
from helpers import make_paged

from jaxinfer.config import EngineConfig
from jaxinfer.model.presets import preset
from jaxinfer.model.xla_attention import prefill_xla, query_tiles
from jaxinfer.model.xla_decode import paged_decode_xla
from pallas_kernels.flash_attention import flash_attention_reference
from pallas_kernels.paged_attention import paged_attention_reference
from pallas_kernels.quant import quantize

TOL = dict(atol=2e-5, rtol=2e-5)


def prefill_case(rng, dtype=jnp.float32):
    """4 rows (a cached prefix, a whole prompt, a 1-token chunk, a prompt at a block boundary) + 2 padding
    rows, 41 tokens in a 48-token bucket; block size 4, 4 q heads over 2 kv heads."""
    lens, counts = [9, 33, 5, 8], [5, 27, 1, 8]
    k, v, tables, _ = make_paged(rng, lens, 4, 2, 8, dtype)
    tables = jnp.concatenate([tables, jnp.zeros((2, tables.shape[1]), jnp.int32)])
    cu = np.concatenate([[0], np.cumsum(counts)])
    cu = jnp.asarray(np.concatenate([cu, [cu[-1]] * 2]), jnp.int32)
    q = jnp.asarray(rng.standard_normal((48, 4, 8)), dtype)
    return q, k, v, tables, cu, jnp.asarray(lens + [0, 0], jnp.int32)


@pytest.mark.parametrize("gather", ["pages", "rows"])
@pytest.mark.parametrize("tile,budget", [(None, 2**30), (3, 2**30), (4, 9000)])
def test_prefill_equals_reference(tile, budget, gather):
    """Any tile size, in one group or several (lax.map under a small budget), pages gathered whole or as
    head-major rows, gives the reference; padding tokens give zeros."""
    q, k, v, tables, cu, lens = prefill_case(np.random.default_rng(0))
    got = prefill_xla(q, k, v, tables, cu, lens, tile=tile, gather_budget_bytes=budget, gather=gather)
    ref = flash_attention_reference(q, k, v, tables, cu, lens)
    np.testing.assert_allclose(np.asarray(got[:41]), np.asarray(ref[:41]), **TOL)
    assert float(jnp.abs(got[41:]).max()) == 0.0


def test_query_tiles_layout():
    """Each token lands in a tile of its own row, at its chunk index; tiles hold consecutive positions."""
    _, _, _, _, cu, lens = prefill_case(np.random.default_rng(0))
    slot, row, pos = (np.asarray(x) for x in query_tiles(cu, lens, 48, 4))
    assert pos.shape == ((48 + 6 * 3) // 4, 4) and slot[41:].tolist() == [pos.size] * 7
    for t in range(41):
        b = int(np.searchsorted(np.asarray(cu)[1:], t, side="right"))
        tile, place = divmod(int(slot[t]), 4)
        assert row[tile] == b and pos[tile, place] == int(lens[b]) - int(cu[b + 1]) + t
    assert len(set(slot[:41].tolist())) == 41 and (pos >= 0).sum() == 41


@pytest.mark.parametrize("form", ["chunks", "reduce", "reduce_per_group", "einsum", "mixed"])
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, TOL), (jnp.bfloat16, dict(atol=2e-2, rtol=2e-2))])
def test_decode_forms_equal_reference(form, dtype, tol):
    rng = np.random.default_rng(1)
    lens = [1, 8, 13, 0, 31]                                  # a row of 1, a block boundary, a padding row
    k, v, tables, seq_lens = make_paged(rng, lens, 4, 2, 16, dtype)
    q = jnp.asarray(rng.standard_normal((5, 4, 16)), dtype)
    got = paged_decode_xla(q, k, v, tables, seq_lens, form=form)
    ref = paged_attention_reference(q, k, v, tables, seq_lens)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32), **tol)
    assert float(jnp.abs(got[3]).max()) == 0.0
    per_row = 2 * tables.shape[1] * 4 * 2 * 16 * 4                     # rows in groups of 2 (lax.map): same
    grouped = paged_decode_xla(q, k, v, tables, seq_lens, form=form, gather_budget_bytes=2 * per_row)
    np.testing.assert_allclose(np.asarray(grouped, np.float32), np.asarray(got, np.float32), **tol)


@pytest.mark.parametrize("gather", ["pages", "rows"])
@pytest.mark.parametrize("budget", [2**30, 3000])
def test_decode_chunks_over_flat_tables(monkeypatch, budget, gather):
    """The "chunks" form with chunks of 2 pages (8 tokens): rows of several chunks, a row ending inside a chunk,
    one on a chunk boundary, a padding row, in ordinary [B, W] tables and in flat tables (the rows' pages one
    after another from table_start, as the engine packs them, W then a per-row budget); in one group and in
    several (lax.map under a small budget); chunks gathered as whole pages or head-major rows. All equal the
    reference."""
    import jaxinfer.model.xla_decode as xd
    monkeypatch.setattr(xd, "DECODE_CHUNK", 8)
    rng = np.random.default_rng(4)
    lens = [1, 8, 13, 0, 31, 17]
    k, v, tables, seq_lens = make_paged(rng, lens, 4, 2, 16, jnp.float32)
    q = jnp.asarray(rng.standard_normal((6, 4, 16)), jnp.float32)
    ref = np.asarray(paged_attention_reference(q, k, v, tables, seq_lens))
    got = paged_decode_xla(q, k, v, tables, seq_lens, form="chunks", gather_budget_bytes=budget, gather=gather)
    np.testing.assert_allclose(np.asarray(got), ref, **TOL)
    cp, t = 2, np.asarray(tables)
    blocks = [-(-n // 4) for n in lens]
    start = np.concatenate([[0], np.cumsum([-(-b // cp) * cp for b in blocks])[:-1]]).astype(np.int32)
    W = 4                                                    # 24 pages for 18 used: narrower than the longest row (8)
    flat = np.zeros(6 * W, np.int32)
    for b, n in enumerate(blocks):
        flat[start[b]:start[b] + n] = t[b, :n]
    got = paged_decode_xla(q, k, v, jnp.asarray(flat.reshape(6, W)), seq_lens, form="chunks",
                           table_start=jnp.asarray(start), gather_budget_bytes=budget, gather=gather)
    np.testing.assert_allclose(np.asarray(got), ref, **TOL)
    assert float(jnp.abs(got[3]).max()) == 0.0


@pytest.mark.parametrize("per_head", [False, True])
def test_fp8_cache_equals_reference(per_head):
    """fp8 pages with stacked [L, 1] or [L, K] scales (layer row 1): both paths equal the references, which
    dequantise the whole cache first."""
    rng = np.random.default_rng(2)
    q, k, v, tables, cu, lens = prefill_case(rng)
    C = 2 if per_head else 1
    ks = jnp.asarray(rng.uniform(0.5, 2.0, (3, C)), jnp.float32) / 100
    vs = jnp.asarray(rng.uniform(0.5, 2.0, (3, C)), jnp.float32) / 100
    k8, v8 = quantize(k, ks[1], jnp.float8_e4m3fn), quantize(v, vs[1], jnp.float8_e4m3fn)
    scales = dict(k_scale=ks, v_scale=vs, layer=1)
    ref = flash_attention_reference(q, k8, v8, tables, cu, lens, **scales)
    for gather in ("pages", "rows"):
        got = prefill_xla(q, k8, v8, tables, cu, lens, gather=gather, **scales)
        np.testing.assert_allclose(np.asarray(got[:41]), np.asarray(ref[:41]), atol=1e-4, rtol=1e-4)
    qd, dl = q[:6], jnp.asarray([9, 33, 5, 8, 0, 1], jnp.int32)
    for form, gather in (("chunks", "pages"), ("chunks", "rows"), ("reduce", None), ("reduce_per_group", None),
                         ("einsum", None), ("mixed", None)):
        got = paged_decode_xla(qd, k8, v8, tables, dl, form=form, gather=gather, **scales)
        ref = paged_attention_reference(qd, k8, v8, tables, dl, **scales)
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=1e-4, rtol=1e-4)


def test_block_table_widths_per_backend():
    """xla: a ladder of widths below max_model_len and fewer prefill buckets; pallas: one narrow width; an
    explicit context_buckets (decode_context_buckets) wins."""
    m = preset("qwen3-0.6b")
    xla = EngineConfig(attn_backend="xla").resolve("gpu", m)
    assert xla.block_table_widths() == (64, 128, 512, 2560) and xla.prefill_buckets == (256, 2048, 16384)
    # the xla decode: flat tables, so W is a page budget per row (decode_context_buckets), and few row buckets
    assert xla.block_table_widths(decode=True) == (32, 40, 48, 64, 96, 128, 512, 2560)
    assert xla.decode_buckets == (8, 64, 256)
    assert EngineConfig(attn_backend="xla", decode_context_buckets=(100,)).resolve("gpu", m).block_table_widths(
        decode=True) == (7, 2560)
    pallas = EngineConfig(attn_backend="pallas", max_model_len=4096).resolve("gpu", m)
    assert pallas.block_table_widths() == (256,) and pallas.prefill_buckets[0] == 64
    own = EngineConfig(attn_backend="xla", max_model_len=4096, context_buckets=(1000,)).resolve("gpu", m)
    assert own.block_table_widths() == (63, 256)
    # prefill steps: the xla ladder at every size; the kernels' (which read just a row's pages) above 1024 tokens
    # only the full width
    assert xla.prefill_table_widths(16384) == (64, 128, 512, 2560)
    full = EngineConfig(attn_backend="pallas").resolve("gpu", m)
    assert full.block_table_widths() == (256, 2560) and full.prefill_table_widths(1024) == (256, 2560)
    assert full.prefill_table_widths(4096) == (2560,)
    assert EngineConfig(attn_backend="mosaic").resolve("gpu", m).prefill_table_widths(16384) == (2560,)


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_engine_with_narrow_widths_equals_transformers(tiny_dir, backend, monkeypatch):
    """The engine moves rows between block-table widths as contexts grow (16 / 48 tokens, then the full
    128; block size 4): greedy tokens still equal transformers', for a prompt crossing a width while it
    decodes, one filling a width exactly, and a repeated prompt (a prefix-cache hit). pallas (interpret):
    prefill steps run at the full width only, decode steps at the narrow ones. xla: decode in chunks of 8 tokens
    over flat tables, the widths then budgets of pages per row."""
    from helpers import TINY_ENGINE, hf_greedy, hf_model

    import jaxinfer.model.xla_decode as xd
    from jaxinfer import LLM, SamplingParams
    monkeypatch.setattr(xd, "DECODE_CHUNK", 8)
    llm = LLM(tiny_dir, **{**TINY_ENGINE, "context_buckets": (16, 48), "attn_backend": backend,
                           "decode_context_buckets": (16, 48),
                           "prefill_buckets": (16, 2048)})
    assert llm.engine.runner.widths == (4, 12, 32)
    cfg = llm.engine.config
    assert cfg.prefill_table_widths(16) == (4, 12, 32)
    assert cfg.prefill_table_widths(2048) == ((4, 12, 32) if backend == "xla" else (32,))
    rng = np.random.default_rng(3)
    ps = [rng.integers(0, 512, n).tolist() for n in (10, 16, 45)]
    ps.append(ps[2])
    outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    ref = hf_model(tiny_dir)
    for p, o in zip(ps, outs):
        assert o.token_ids == hf_greedy(ref, p, 12), f"prompt of {len(p)} tokens"
    assert outs[3].num_cached_tokens > 0
    st = llm.stats()
    assert st["kv_blocks_free"] == st["kv_blocks_total"]
    used = {(k[1], k[3]) for k in llm.engine.runner.compiled if k[0] == "prefill"}
    assert used and all(W in cfg.prefill_table_widths(T) for T, W in used)


def test_fusion_report_counts_kernels():
    """scripts/xla_fusion_report.py's HLO reading: the compiled decode call has launches, one of them reads
    pages through a gather, and fused bodies / reducers are not counted as launches."""
    import os
    import sys

    import jax
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
    from xla_fusion_report import kernels, table
    k, v, tables, lens = make_paged(np.random.default_rng(4), [5, 9], 4, 2, 16, jnp.float32)
    q = jnp.ones((2, 4, 16), jnp.float32)
    ks = kernels(jax.jit(paged_decode_xla).lower(q, k, v, tables, lens).compile().as_text())
    assert ks and any("gather" in x["ops"] for x in ks) and any("reduce" in x["ops"] for x in ks)
    assert not any(x["kind"] in ("add", "maximum") for x in ks)       # the softmax's reducer bodies
    assert sum(n for _, n in table(ks)) == len(ks)


def test_gathered_pages_are_counted_at_their_converted_size():
    """fp8 pages are gathered and converted to q's dtype for the einsums: the group budget counts both copies (the
    fp8 one alone would let a prefill group's temporaries grow past GATHER_BUDGET: an OOM on the H200)."""
    from jaxinfer.model.xla_attention import gathered_itemsize
    q = jnp.zeros((2, 4, 16), jnp.bfloat16)
    assert gathered_itemsize(jnp.zeros((4, 4, 2, 16), jnp.float8_e4m3fn), q) == 3
    assert gathered_itemsize(jnp.zeros((4, 4, 2, 16), jnp.bfloat16), q) == 2
    assert gathered_itemsize(jnp.zeros((4, 4, 2, 16), jnp.float32), q.astype(jnp.float32)) == 4


@pytest.mark.parametrize("backend,kv", [("xla", "auto"), ("xla", "fp8"), ("pallas", "auto"), ("pallas", "fp8")])
def test_stacked_caches_give_the_per_layer_tokens(tiny_dirs, backend, kv, monkeypatch):
    """The xla and pallas backends keep one (k, v) pair stacked over the layers ([L * P, bs, K, D]) and scan the
    layers (pallas: prefill; its decode kernel takes each layer's page offset, layers unrolled); with a pair per
    layer (unrolled layers, as the other kernels' backends run) every token is the same: greedy and seeded,
    prompts over several steps' chunks and a prefix-cache hit, one step and K steps per call (fp8 pages: K), and
    the stacked cache's padding slots write nowhere (all blocks come back)."""
    import jaxinfer.model.attention as attention
    from helpers import TINY_ENGINE

    from jaxinfer import LLM, SamplingParams
    # xla: 3 layers, GQA group 4, head_dim 24; pallas (head_dim a power of two): 2 layers, GQA group 2
    path = tiny_dirs["gqa4_wide_head" if backend == "xla" else "gqa2"]
    L = 3 if backend == "xla" else 2
    rng = np.random.default_rng(7)
    ps = [rng.integers(0, 512, n).tolist() for n in (5, 70, 33)]
    ps.append(ps[1][:40])
    params = [SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=11, max_tokens=9, ignore_eos=True)]
    kw = {**TINY_ENGINE, "attn_backend": backend, "kv_cache_dtype": kv, "max_num_batched_tokens": 32}
    got = {}
    for stacked in (True, False):
        monkeypatch.setattr(attention, "STACKED_BACKENDS", (backend,) if stacked else ())
        for steps in ((1, 4) if kv == "auto" else (4,)):     # fp8: the K-step call only (CI time)
            llm = LLM(path, **kw, num_scheduler_steps=steps)
            caches = llm.engine.runner.kv_caches
            assert len(caches) == (1 if stacked else L)
            assert caches[0][0].shape[0] == (L if stacked else 1) * llm.stats()["kv_blocks_total"]
            got[stacked, steps] = [[o.token_ids for o in llm.generate(ps, p, use_tqdm=False)] for p in params]
            st = llm.stats()
            assert st["kv_blocks_free"] == st["kv_blocks_total"]
    assert len({str(v) for v in got.values()}) == 1, "the tokens differ between the layouts or the K of a call"


def test_cache_layout_keeps_pallas_offsets_exact():
    """One stacked pair, except a pallas fp8 array of 2-4 GiB a device (Pallas' Triton lowering would index it with
    32-bit element offsets, which overflow past 2^31): a pair per layer then. bf16, xla and other sizes stack."""
    from jaxinfer.model.attention import cache_layout
    page = (16, 8, 128)                                   # 16 KiB of one-byte elements a page
    small, mid, big = 2**31 // 2**14 // 28, 3 * 2**32 // 4 // 2**14 // 28, 2**32 // 2**14 // 28 + 1
    assert cache_layout("pallas", 28, (small, *page), 1) == ((28 * small, *page), 1)
    assert cache_layout("pallas", 28, (mid, *page), 1) == ((mid, *page), 28)          # 3 GiB stacked: per layer
    assert cache_layout("pallas", 28, (mid, *page), 1, shards=2) == ((28 * mid, *page), 1)   # 1.5 GiB a device
    assert cache_layout("pallas", 28, (big, *page), 1) == ((28 * big, *page), 1)      # > 4 GiB: 64-bit offsets
    assert cache_layout("pallas", 28, (mid, *page), 2) == ((28 * mid, *page), 1)      # bf16
    assert cache_layout("xla", 28, (mid, *page), 1) == ((28 * mid, *page), 1)
    assert cache_layout("cudnn", 28, (small, *page), 2) == ((small, *page), 28)


def test_one_layer_fp8_pool_that_pallas_cannot_index_is_refused():
    """A one-layer model's fp8 pallas page array of 2^31-2^32 elements (inexact 32-bit offsets in the kernels): an
    explicit num_kvcache_blocks there is a ValueError naming the sizes that work; memory sizing stays under it."""
    import dataclasses

    from jaxinfer.engine.memory import check_pool_fits, inexact_offsets
    m = dataclasses.replace(preset("qwen3-0.6b"), num_hidden_layers=1)
    e = EngineConfig(attn_backend="pallas", kv_cache_dtype="fp8", block_size=16).resolve("gpu", m)
    per_block = 16 * m.num_key_value_heads * m.head_dim                  # 16 Ki one-byte elements a block
    assert inexact_offsets(m, e, jnp.float8_e4m3fn, 2**31 // per_block) is None
    assert inexact_offsets(m, e, jnp.float8_e4m3fn, 2**32 // per_block + 1) is None
    assert inexact_offsets(m, e, jnp.float8_e4m3fn, 3 * 2**30 // per_block)[1:] == (2**31 // per_block,
                                                                                    2**32 // per_block + 1)
    assert inexact_offsets(m, e, jnp.bfloat16, 3 * 2**30 // per_block) is None
    with pytest.raises(ValueError, match="num_kvcache_blocks=196608 .* at most 131072 blocks, or at least 262145"):
        check_pool_fits(m, e, 3 * 2**30 // per_block)
