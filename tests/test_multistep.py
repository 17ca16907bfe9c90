"""Multi-step decode (jaxinfer/multistep.py): K decode steps per device call give the same tokens as one step
per call, for greedy and seeded rows, with rows stopping mid-call on EOS, stop ids, max_tokens and
max_model_len; stop strings, aborts mid-call, streaming and warm-up (no compilation after it, for any K)."""
import numpy as np
import pytest

from helpers import TINY_ENGINE

from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.llm_engine import is_finished

BASE = {**TINY_ENGINE, "max_model_len": 64}
KS = (1, 3, 16, None)          # None: the engine picks (4 or 16 per call)


def _requests(n=7, seed=3):
    """Greedy and seeded rows; max_tokens from 1 to 40 (several end mid-call); one prompt near max_model_len."""
    rng = np.random.default_rng(seed)
    ps = [rng.integers(0, 400, int(rng.integers(3, 20))).tolist() for _ in range(n - 1)]
    ps.append(rng.integers(0, 400, 50).tolist())            # 50 + 14 = max_model_len 64: ends by length
    sps = [SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=10 + i, ignore_eos=True,
                          max_tokens=[1, 5, 17, 40, 9, 23, 40][i % 7]) for i in range(n)]
    return ps, sps


def _generate(llm, ps, sps):
    outs = llm.generate(ps, sps, use_tqdm=False)
    st = llm.stats()
    assert st["kv_blocks_free"] == st["kv_blocks_total"], st       # look-ahead blocks all came back
    return [(o.token_ids, o.finish_reason) for o in outs], st


@pytest.fixture(scope="module")
def llms(tiny_dir):
    return {K: LLM(tiny_dir, **{**BASE, "num_scheduler_steps": K}) for K in KS}


@pytest.fixture(scope="module")
def reference(llms):
    return _generate(llms[1], *_requests())[0]


@pytest.mark.parametrize("K", KS)
def test_same_tokens_for_every_k(llms, reference, K):
    out, st = _generate(llms[K], *_requests())
    assert out == reference
    assert len(out[-1][0]) == 14 and out[-1][1] == "length"                       # max_model_len mid-call
    assert (st["multistep_calls"] > 0) == (K != 1)
    assert st["compiled_multistep"] in {1: (0,), 3: (1,), 16: (1,), None: (1, 2)}[K]   # lazily: the Ks used


@pytest.mark.parametrize("K", KS)
def test_stop_ids_and_eos_mid_call(llms, reference, K):
    """Rows stop on a stop id / on EOS in the middle of a call: nothing after the stop comes back."""
    ps, sps = _requests()
    toks = [t for t, _ in reference]
    i, j, f = 3, 4, 5                                      # 40, 9 and 23 tokens in the reference
    stop_tok, eos_tok = toks[i][11], toks[j][6]
    sps[i] = SamplingParams(**{**sps[i].__dict__, "stop_token_ids": [stop_tok]})
    # row f stops on its first token (the prefill's, still on the device when the first K-step call starts)
    sps[f] = SamplingParams(**{**sps[f].__dict__, "stop_token_ids": [toks[f][0]]})
    sps[j] = SamplingParams(**{**sps[j].__dict__, "ignore_eos": False})
    llm = llms[K]
    saved = llm.engine.scheduler.eos
    llm.engine.scheduler.eos = frozenset({eos_tok})
    try:
        out, _ = _generate(llm, ps, sps)
    finally:
        llm.engine.scheduler.eos = saved
    assert out[i] == (toks[i][:toks[i].index(stop_tok) + 1], "stop")
    assert out[j] == (toks[j][:toks[j].index(eos_tok) + 1], "stop")
    assert out[f] == (toks[f][:1], "stop")
    others = [k for k in range(len(ps)) if k not in (i, j, f)]
    # rows that ignore EOS are unaffected (a row with ignore_eos=False among them would stop at eos_tok too)
    assert [out[k] for k in others] == [reference[k] for k in others]


@pytest.mark.parametrize("K", KS)
def test_small_top_k_rows_run_k_steps_with_the_same_tokens(llms, K):
    """Rows with Qwen3's sampling (top_k=20, top_p=0.95) and plain rows decode K steps per call (the "top_k"
    draw needs no sort) with the tokens of one step per call; top_p-only rows keep their batch at one step."""
    ps, sps = _requests()
    sps = [SamplingParams(**{**sp.__dict__, "top_k": 20, "top_p": 0.95}) if i % 3 else sp
           for i, sp in enumerate(sps)]
    ref = _generate(llms[1], ps, sps)[0]
    out, st = _generate(llms[K], ps, sps)
    assert out == ref and (st["multistep_calls"] > 0) == (K != 1)
    calls = st["multistep_calls"]
    top_p = [SamplingParams(**{**sp.__dict__, "temperature": 0.9, "top_k": 0, "top_p": 0.9}) for sp in sps]
    _generate(llms[K], ps, top_p)
    assert llms[K].stats()["multistep_calls"] == calls


@pytest.mark.parametrize("K", [4, 16])
def test_a_stop_token_ending_a_block_is_not_cached(tiny_dir, K):
    """A row masked on the device after its stop token (mid-call, or a call queued behind the prefill whose first
    token stops it) never writes that token's KV: the block it ends must not enter the prefix cache, or a
    follow-up prompt extending the conversation (a chat's next turn after EOS) reads stale KV."""
    greedy = dict(temperature=0.0, ignore_eos=True)
    bs = TINY_ENGINE["block_size"]
    ref = LLM(tiny_dir, **{**BASE, "num_scheduler_steps": 1, "enable_prefix_caching": False})
    llm = LLM(tiny_dir, **{**BASE, "num_scheduler_steps": K})
    prompt = [11, 22, 33, 44, 55, 66, 77]
    out = ref.generate([prompt], SamplingParams(**greedy, max_tokens=20), use_tqdm=False)[0].token_ids
    for after in (0, 1):        # the prefill's first token (position 7, a block's last slot), then one mid-call
        k = next(k for k in range(after, len(out)) if (len(prompt) + k) % bs == bs - 1 and out[k] not in out[:k])
        stop = SamplingParams(**greedy, max_tokens=20, stop_token_ids=[out[k]])
        follow = prompt + out[:k + 1] + [101, 102, 103, 104, 105]
        want = ref.generate([follow], SamplingParams(**greedy, max_tokens=8, logprobs=0), use_tqdm=False)[0]
        first = llm.generate([prompt], stop, use_tqdm=False)[0]
        assert (first.token_ids, first.finish_reason) == (out[:k + 1], "stop")
        got = llm.generate([follow], SamplingParams(**greedy, max_tokens=8, logprobs=0), use_tqdm=False)[0]
        assert got.num_cached_tokens == (len(prompt) + k) // bs * bs       # the block with the stop token: not
        assert got.token_ids == want.token_ids
        assert got.outputs[0].cumulative_logprob == pytest.approx(want.outputs[0].cumulative_logprob, abs=1e-4)


@pytest.mark.parametrize("K", [4, None])
def test_a_prompt_ending_in_a_stop_id_or_eos_is_not_stopped_by_it(tiny_dir, K):
    """Chunked prefill can leave a prompt's last token to a K-step call (it runs as a decode row). Stop ids and
    EOS end a request only when they are generated: a prompt ending in one (a chat prompt with stop_token_ids=
    [the newline]) must still get its output, as at one step per call."""
    kw = {**BASE, "max_num_batched_tokens": 8, "enable_prefix_caching": False}
    prompt = [31, 32, 33, 34, 35, 36, 37, 38, 39]          # 9 tokens: the 9th is computed by a decode call
    eos = next(iter(LLM(tiny_dir, **{**kw, "num_scheduler_steps": 1}).engine.scheduler.eos))
    cases = [(prompt, dict(stop_token_ids=[39])), (prompt[:-1] + [eos], {})]
    outs = {}
    for k in (1, K):
        llm = LLM(tiny_dir, **{**kw, "num_scheduler_steps": k})
        for i, (p, extra) in enumerate(cases):
            sp = SamplingParams(temperature=0.0, max_tokens=16, **extra)
            o = llm.generate([p], sp, use_tqdm=False)[0].outputs[0]
            streamed = [t for d in llm.stream([p], sp) for t in d.outputs[0].token_ids]
            outs[k, i] = (o.token_ids, o.finish_reason, streamed)
        st = llm.stats()
        assert st["kv_blocks_free"] == st["kv_blocks_total"]
        assert (st["multistep_calls"] > 0) == (k != 1)
    for i in range(len(cases)):
        assert len(outs[1, i][0]) > 0 and outs[1, i][2] == outs[1, i][0]
        assert outs[K, i] == outs[1, i]


def test_stop_strings(llms):
    """Stop strings are checked on the host after a call: the text and the tokens end at the match."""
    prompt = "def add(a, b):"
    sp = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    full = llms[1].generate([prompt], sp, use_tqdm=False)[0]
    stop = full.text[8:11]
    assert stop and full.text.find(stop) == 8
    sp = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop])
    outs = {K: llms[K].generate([prompt], sp, use_tqdm=False)[0] for K in (1, 16)}
    assert outs[16].text == outs[1].text == full.text[:8]
    assert outs[16].finish_reason == outs[1].finish_reason == "stop"
    assert outs[16].token_ids == outs[1].token_ids and len(outs[16].token_ids) < 30
    # tokens read back after the match are not counted as generated
    before = llms[16].stats()["generated_tokens"]
    n = len(llms[16].generate([prompt], sp, use_tqdm=False)[0].token_ids)
    assert llms[16].stats()["generated_tokens"] - before == n
    assert llms[16].stats()["kv_blocks_free"] == llms[16].stats()["kv_blocks_total"]


def test_abort_mid_call_frees_all_blocks(llms):
    eng = llms[16].engine
    ps, sps = _requests()
    seqs = [eng.add_request(p, sp) for p, sp in zip(ps, sps)]
    for _ in range(20):
        eng.step()
        if eng.in_flight is not None and eng.in_flight[0].num_steps > 1:
            break
    assert eng.in_flight is not None and eng.in_flight[0].num_steps > 1, "no K-step call in flight"
    for s in seqs:
        eng.abort(s)
    assert not eng.has_unfinished()
    assert eng.step() == []                      # reads the call: its tokens go nowhere
    assert eng.in_flight is None and all(is_finished(s) and s.finish_reason in ("abort", "length") for s in seqs)
    st = eng.stats()
    assert st["kv_blocks_free"] == st["kv_blocks_total"]


def test_streaming_order(llms, reference):
    """Each call's tokens stream as soon as it returns, in order; deltas concatenate to generate's output."""
    ps, sps = _requests()
    got = {i: [] for i in range(len(ps))}
    reasons, sizes = {}, []
    for d in llms[16].stream(ps, sps):
        assert d.request_id not in reasons, "a delta after the request finished"
        got[d.request_id] += d.token_ids
        sizes.append(len(d.token_ids))
        if d.finish_reason:
            reasons[d.request_id] = d.finish_reason
    assert [(got[i], reasons[i]) for i in range(len(ps))] == reference
    assert max(sizes) > 1                        # several tokens per delta: one per call, not per step


@pytest.mark.parametrize("k, words", [(0, "num_scheduler_steps=0 must be a positive"), (2.5, "=2.5 must be"),
                                      (True, "=True must be"), (10**9, "=1000000000 is more than max_model_len=")])
def test_bad_num_scheduler_steps(tiny_dir, k, words):
    """Not a positive integer, or more steps than any request could take (a call no request would use)."""
    with pytest.raises(ValueError, match=words):
        LLM(tiny_dir, **{**BASE, "num_scheduler_steps": k})


def test_steps_past_a_max_model_len_the_kv_pool_capped(tiny_dir):
    """max_model_len left to the KV pool (3 blocks of 4: 12 tokens): an explicit K above it is refused as an
    explicit max_model_len is; the automatic Ks above it are not compiled (no request could use them)."""
    pool = {**BASE, "block_size": 4, "num_kvcache_blocks": 3}
    pool.pop("max_model_len", None)
    with pytest.raises(ValueError, match="num_scheduler_steps=64 is more than max_model_len=12"):
        LLM(tiny_dir, **pool, num_scheduler_steps=64)
    for backend, ks in (("xla", ()), ("pallas", (4,))):
        llm = LLM(tiny_dir, **pool, attn_backend=backend, num_scheduler_steps=None)
        assert llm.config.max_model_len == 12 and llm.engine.runner.multistep_ks() == ks


def test_no_compilation_after_warmup(tiny_dir):
    """Warm-up compiles every variant (K = 1 and the K-step ones), runs each once and two tiny requests:
    afterwards no K, sampling variant or batch size compiles anything."""
    llm = LLM(tiny_dir, **{**BASE, "warmup": True})
    st = llm.stats()
    r = llm.engine.runner
    # xla: the largest K only; plain and small-top_k sampling
    assert r.multistep_ks() == (16,) and st["compiled_multistep"] == 2 * len(r.widths)
    assert st["generated_tokens"] == 0 and st["kv_blocks_free"] == st["kv_blocks_total"]
    ps, sps = _requests()
    _generate(llm, ps, sps)                                                   # auto K (4 and 16)
    _generate(llm, ps[:1], [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=6)])   # filtered: K = 1
    _generate(llm, ps[:2], [SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_tokens=20)] * 2)  # no sort
    _generate(llm, [list(range(60))], [SamplingParams(max_tokens=4)])        # a wider block table
    st = llm.stats()
    assert st["multistep_calls"] > 0
    assert st["compilations"] == 0, st


def test_pallas_backend_same_tokens(tiny_dir):
    """The Pallas decode kernel (interpret mode) inside the device loop: masked rows write nothing."""
    cfg = {**BASE, "attn_backend": "pallas", "block_size": 16, "num_kvcache_blocks": 32, "max_num_seqs": 4}
    ps, sps = _requests(4)
    sps = [SamplingParams(**{**sp.__dict__, "max_tokens": m}) for sp, m in zip(sps, (3, 21, 9, 14))]
    outs = {K: _generate(LLM(tiny_dir, **{**cfg, "num_scheduler_steps": K}), ps, sps) for K in (1, 16)}
    assert outs[16][0] == outs[1][0]
    assert outs[16][1]["multistep_calls"] > 0 and outs[1][1]["multistep_calls"] == 0


@pytest.mark.parametrize("K", (1, 16))
def test_xla_chunks_over_flat_tables_same_tokens(tiny_dir, reference, monkeypatch, K):
    """The xla decode in chunks of 8 tokens (2 blocks) over flat tables (engine/batch.py): rows span several
    chunks, widths are budgets narrower than the longest row, and the K-step call writes its look-ahead slots
    through table_start. Same tokens as one chunk a row."""
    import jaxinfer.model.xla_decode as xd
    monkeypatch.setattr(xd, "DECODE_CHUNK", 8)
    llm = LLM(tiny_dir, **{**BASE, "num_scheduler_steps": K, "decode_context_buckets": (16, 32), "attn_backend": "xla"})
    assert llm.engine.runner.chunk_pages == 2 and llm.engine.runner.widths == (4, 8, 16)
    out, st = _generate(llm, *_requests())
    assert out == reference and (st["multistep_calls"] > 0) == (K > 1)
    assert any(k[0] in ("decode", "multistep") and k[3] < 16 for k in llm.engine.runner.compiled)


def test_an_explicit_k_runs_batches_past_the_auto_limit(tiny_dir, llms):
    """num_scheduler_steps=K (vLLM's multi-step) overrides the engine's choice at any batch size: 12 rows (past the
    auto policy's 8) run K-step calls, with K=1's tokens."""
    ps = [[5 + i, 6, 7 + i] for i in range(12)]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(tiny_dir, **{**BASE, "max_num_seqs": 16, "num_scheduler_steps": 4})
    out, st = _generate(llm, ps, sp)
    assert st["multistep_calls"] > 0 and out == _generate(llms[1], ps, sp)[0]


def test_k_choice():
    """K = 1 while requests wait, for filtered sampling, too many stop ids or too few free blocks; else the
    largest compiled K that no row's remaining tokens fall short of, with look-ahead blocks reserved."""
    from jaxinfer.config import EngineConfig
    from jaxinfer.engine.block_manager import BlockManager
    from jaxinfer.engine.scheduler import Scheduler
    from jaxinfer.engine.sequence import Sequence

    def setup(max_tokens=(30, 10), blocks=64, **sp):
        cfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, block_size=4)
        bm = BlockManager(blocks, 4)
        sch = Scheduler(cfg, bm, eos_token_ids=(7,))
        for i, m in enumerate(max_tokens):
            sch.add(Sequence([1, 2, 3 + i], SamplingParams(max_tokens=m, **sp), 0, 4))
        sch.on_dispatch(sch.schedule())                   # prefill: each row's first token is pending
        return sch, bm, sch.schedule()

    sch, bm, batch = setup()
    free = bm.num_free_blocks
    assert sch.plan_steps(batch, (4, 16), 4) == 16 and batch.num_steps == 16      # max remaining 29
    # look-ahead: 3 computed tokens + K (or the row's remaining tokens, if fewer)
    assert [len(s.block_table) for s in batch.seqs] == [-(-(3 + 16) // 4), -(-(3 + 9) // 4)]
    assert bm.num_free_blocks < free
    sch, _, batch = setup(max_tokens=(8, 3))
    assert sch.plan_steps(batch, (4, 16), 4) == 4                                  # 7 left: 16 would waste 9
    sch, _, batch = setup(max_tokens=(2, 2))
    assert sch.plan_steps(batch, (4, 16), 4) == 4                                  # none fits: the smallest
    sch, _, batch = setup(max_tokens=(8, 3))
    assert sch.plan_steps(batch, (16,), 4) == 1                 # xla's K = 16 alone: 7 left would waste 9 steps
    sch, _, batch = setup(top_p=0.5)
    assert sch.plan_steps(batch, (4, 16), 4) == 1                                  # filtered sampling
    sch, _, batch = setup(stop_token_ids=[1, 2, 3, 4])                             # + EOS: 5 stop ids
    assert sch.plan_steps(batch, (4, 16), 4) == 1
    sch, _, batch = setup(blocks=4)
    assert sch.plan_steps(batch, (4, 16), 4) == 1                                  # no look-ahead blocks
    sch, _, batch = setup()
    sch.add(Sequence([5, 6], SamplingParams(), 0, 4))
    assert sch.plan_steps(batch, (4, 16), 4) == 1                                  # a request waits
    sch, _, batch = setup()
    assert sch.plan_steps(batch, (4, 16), 4, queued=True) == 4 and batch.steps == [4, 4]   # behind a K-step call
    sch.on_dispatch(batch)
    assert [(s.num_pending, s.num_computed_tokens) for s in batch.seqs] == [(5, 7), (5, 7)]  # + the prefill's token


def _log_calls(eng, monkeypatch) -> list:
    """Record ("run", steps) at each device call and ("read", steps) when its ids are applied."""
    log, run, apply = [], eng.runner.run, eng._apply
    monkeypatch.setattr(eng.runner, "run", lambda key, *a: log.append(("run", key[-1] if key[0] == "multistep"
                                                                        else 1)) or run(key, *a))
    monkeypatch.setattr(eng, "_apply", lambda batch, *a: log.append(("read", batch.num_steps)) or apply(batch, *a))
    return log


def _queued(log) -> list[int]:
    """The steps of each call dispatched while a K-step call was in flight (dispatched, not read yet). A read with
    nothing logged in flight is of a call an earlier test left in flight (a shared engine): skipped."""
    out, in_flight = [], []
    for event, steps in log:
        if event == "read":
            in_flight and in_flight.pop(0)
            continue
        if any(k > 1 for k in in_flight):
            out.append(steps)
        in_flight.append(steps)
    return out


def _long_requests():
    """Three rows of 56-58 tokens (three 16-step calls each); row 1 greedy, the others seeded."""
    ps = [[5, 6, 7], [8, 9, 10, 11], [12, 13]]
    return ps, [SamplingParams(temperature=0.0 if i == 1 else 0.8, seed=i, ignore_eos=True, max_tokens=56 + i)
                for i in range(3)]


def test_k_step_calls_queue_behind_each_other(llms, monkeypatch):
    """A K-step call is dispatched before the one in flight is read (its rows' input ids stay on the device), with
    the smallest compiled K; a row that stopped in the call before it is masked. Same tokens as one step a call."""
    ps, sps = _long_requests()
    ref = _generate(llms[1], ps, sps)[0]
    eng = llms[None].engine
    log = _log_calls(eng, monkeypatch)
    out, st = _generate(llms[None], ps, sps)
    assert out == ref and st["multistep_calls"] >= 3
    queued = [k for k in _queued(log) if k > 1]
    assert len(queued) >= 2 and set(queued) == {eng.runner.multistep_ks()[0]}, log
    # row 2 stops on EOS in its second call while the third is already on its way: nothing after the EOS returns
    toks = ref[2][0]
    eos = next(t for t in toks[20:] if t not in toks[:20])
    sps[2] = SamplingParams(**{**sps[2].__dict__, "ignore_eos": False})
    saved, eng.scheduler.eos = eng.scheduler.eos, frozenset({eos})
    try:
        out, _ = _generate(llms[None], ps, sps)
    finally:
        eng.scheduler.eos = saved
    assert out[2] == (toks[:toks.index(eos) + 1], "stop") and out[:2] == ref[:2]


def test_preemption_while_a_k_step_call_is_in_flight(tiny_dir, monkeypatch):
    """A pool too small for every row: rows are preempted while K-step calls are in flight (their tokens still
    pending), recomputed later, and come out the same; every block comes back."""
    ps, sps = _long_requests()
    ref = _generate(LLM(tiny_dir, **{**BASE, "num_scheduler_steps": 1}), ps, sps)[0]
    llm = LLM(tiny_dir, **{**BASE, "num_scheduler_steps": None, "num_kvcache_blocks": 20})
    log = _log_calls(llm.engine, monkeypatch)
    out, st = _generate(llm, ps, sps)
    assert out == ref
    assert st["preemptions"] > 0 and st["multistep_calls"] > 0
    assert _queued(log), "no step queued behind a K-step call"
