"""Scheduler rules: FCFS, chunked prefill of any prompt, all-prefill or all-decode steps, preemption."""
from jaxinfer.config import EngineConfig
from jaxinfer.engine.block_manager import BlockManager
from jaxinfer.engine.scheduler import Scheduler
from jaxinfer.engine.sequence import Sequence, Status
from jaxinfer.sampling_params import SamplingParams

BS = 4


def make(num_blocks=32, budget=16, max_seqs=4, max_len=64):
    cfg = EngineConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=max_len,
                       block_size=BS, num_kvcache_blocks=num_blocks)
    return Scheduler(cfg, BlockManager(num_blocks, BS), eos_token_ids=(0,))


def seq(n, max_tokens=8, **kw):
    return Sequence(list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens, **kw), 0, BS)


def run_step(s, tok=7):
    b = s.schedule()
    s.on_dispatch(b)
    s.postprocess(b, [tok] * len(b.seqs))
    return b


def test_prefill_chunks_any_prompt_within_budget():
    s = make(budget=10)
    a, b = seq(6), seq(9)
    s.add(a), s.add(b)
    b1 = s.schedule()
    assert b1.is_prefill and b1.num_new_tokens == [6, 4]          # b is split: 4 now ...
    s.on_dispatch(b1)
    s.postprocess(b1, [7, 7])
    assert len(a) == 7 and len(b) == 9                            # a sampled; b mid-prompt did not
    b2 = s.schedule()
    assert b2.is_prefill and b2.seqs == [b] and b2.num_new_tokens == [5]   # ... 5 later
    s.on_dispatch(b2)
    s.postprocess(b2, [7])
    b3 = s.schedule()
    assert not b3.is_prefill and b3.seqs == [a, b]


def test_max_num_seqs_and_fcfs():
    s = make(max_seqs=2, budget=64)
    seqs = [seq(3) for _ in range(3)]
    for x in seqs:
        s.add(x)
    b = s.schedule()
    assert b.seqs == seqs[:2] and list(s.waiting) == [seqs[2]]


def test_stop_conditions_free_blocks():
    s = make()
    a, b, c = seq(3, max_tokens=2), seq(3, stop_token_ids=[9]), seq(3, ignore_eos=True, max_tokens=3)
    for x in (a, b, c):
        s.add(x)
    run_step(s, tok=0)                                 # eos for a and b; c ignores it
    assert a.finish_reason == "stop" and b.finish_reason == "stop" and c.status is Status.RUNNING
    run_step(s, tok=9)                                 # c: stop_token_ids not set for c
    run_step(s, tok=9)
    assert c.finish_reason == "length" and c.num_output_tokens == 3
    assert s.bm.num_free_blocks == s.bm.num_blocks and not s.has_unfinished()


def test_max_model_len_stops():
    s = make(max_len=8)
    a = seq(6, max_tokens=100)
    s.add(a)
    while s.has_unfinished():
        run_step(s)
    assert a.finish_reason == "length" and len(a) == 8


def test_preemption_of_newest_when_blocks_run_out():
    s = make(num_blocks=5, budget=64)
    a, b = seq(7, max_tokens=9), seq(7, max_tokens=9)     # 2 blocks each after prefill, 4 at the end
    s.add(a), s.add(b)
    run_step(s)                                             # prefill both; lengths 8
    b2 = run_step(s)                                        # decode: both fit (8 tokens in 2 blocks)
    assert b2.seqs == [a, b]
    b3 = s.schedule()                                       # len 9 needs a 3rd block each: b is preempted
    assert b3.seqs == [a] and b.status is Status.WAITING and s.num_preemptions == 1
    assert b.block_table == [] and b.num_computed_tokens == 0 and s.waiting[0] is b
    s.on_dispatch(b3)
    s.postprocess(b3, [7])
    while s.has_unfinished():
        run_step(s)
    assert a.num_output_tokens == 9 and b.num_output_tokens == 9
    assert s.bm.num_free_blocks == 5


def test_abort_waiting_and_running():
    s = make(max_seqs=1)
    a, b = seq(3), seq(3)
    s.add(a), s.add(b)
    run_step(s)
    s.finish(a, "abort"), s.finish(b, "abort")
    assert a.finish_reason == b.finish_reason == "abort"
    assert not s.has_unfinished() and s.bm.num_free_blocks == s.bm.num_blocks


def test_async_dispatch_before_readback():
    """Step N+1 is scheduled while step N's tokens are still on the device (placeholders)."""
    from jaxinfer.engine.sequence import PLACEHOLDER
    s = make()
    a, b = seq(5, max_tokens=3), seq(6, max_tokens=1)
    s.add(a), s.add(b)
    b1 = s.schedule()
    s.on_dispatch(b1)                                     # prefill: both sample a token (not read yet)
    assert a.token_ids[-1] == PLACEHOLDER and a.num_output_tokens == 0 and a.num_scheduled_outputs == 1
    b2 = s.schedule()                                     # b's only token is pending: not scheduled again
    assert not b2.is_prefill and b2.seqs == [a]
    s.on_dispatch(b2)
    assert a.num_pending == 2 and a.output_token_ids == []
    s.postprocess(b1, [11, 12])                           # read step 1: fills the oldest placeholders
    assert a.output_token_ids == [11] and b.output_token_ids == [12] and b.finish_reason == "length"
    s.postprocess(b2, [13])
    assert a.output_token_ids == [11, 13] and a.num_pending == 0
    b3 = s.schedule()
    s.on_dispatch(b3)
    s.finish(a, "abort")                                  # aborted while a step is in flight
    assert a.token_ids[-1] != PLACEHOLDER and a.output_token_ids == [11, 13]
    s.postprocess(b3, [14])                               # its late token is dropped
    assert a.output_token_ids == [11, 13] and s.bm.num_free_blocks == s.bm.num_blocks


def test_prefix_cache_never_hashes_placeholders():
    s = make(budget=64)
    a = seq(7, max_tokens=4)                              # block size 4: token 8 completes block 2
    s.add(a)
    s.on_dispatch(s.schedule())                           # prefill 7 tokens, placeholder at position 7
    assert a.num_computed_tokens == 7 and s.bm.blocks[a.block_table[1]].hash is None
    s.bm.cache_full_blocks(a)
    assert s.bm.blocks[a.block_table[1]].hash is None     # position 7 is not known yet


def test_pack_orders_rows_longest_first_for_the_decode_kernel():
    """attn_order is a permutation of the bucket's rows by decreasing context, padding rows (length 0) last."""
    from jaxinfer.engine.batch import pack
    from jaxinfer.step import batch_layout
    s = make(budget=64, max_seqs=4)
    seqs = [seq(n) for n in (5, 11, 3)]
    for x in seqs:
        s.add(x)
    run_step(s)                                                  # prefill all three
    b = s.schedule()
    assert not b.is_prefill and len(b.seqs) == 3
    B, W = 8, 4
    buf = pack(b, B, B, W, BS, 32 * BS)
    off, n = batch_layout(B, B, W)["attn_order"]
    order = buf[off:off + n]
    off, n = batch_layout(B, B, W)["seq_lens"]
    lens = buf[off:off + n]
    assert sorted(order.tolist()) == list(range(B))
    assert lens[order].tolist() == [12, 6, 4, 0, 0, 0, 0, 0]
    assert order[:3].tolist() == [1, 0, 2]


def test_packed_fields_are_256_byte_aligned():
    """Every field of every packed layout starts at a multiple of 64 int32s: XLA hands a field to a kernel as a
    slice of the packed buffer, and Mosaic GPU kernels refuse operands that are not 256-byte aligned."""
    from jaxinfer.multistep import multistep_layout
    from jaxinfer.step import Extras, batch_layout, extras_layout
    for T, B, W in ((1, 1, 1), (37, 5, 3), (256, 256, 256)):
        layouts = [batch_layout(T, B, W), multistep_layout(B, W),
                   extras_layout(T, B, W, Extras(penalties=True, logprobs=True, top_n=5, prompt_rows=7))]
        for layout in layouts:
            spans = sorted((off, n) for name, (off, n) in layout.items() if name != "_size")
            assert all(off % 64 == 0 for off, _ in spans), spans
            assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:])), spans     # no overlap
            assert layout["_size"][0] >= spans[-1][0] + spans[-1][1]
