"""Pack one scheduled step into the single padded int32 array the jitted step reads (numpy only)."""
from __future__ import annotations

import bisect

import numpy as np

from jaxinfer.config import EngineConfig
from jaxinfer.engine.scheduler import ScheduledBatch
from jaxinfer.step import FLOAT_FIELDS, batch_layout


def pick_bucket(buckets: tuple[int, ...], n: int) -> int:
    """Smallest bucket >= n (buckets sorted ascending)."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


def bucket_for(config: EngineConfig, widths: tuple[int, ...], batch: ScheduledBatch) -> tuple[str, int, int, int]:
    """(kind, T, B, W) of the compiled step that runs this batch."""
    W = pick_bucket(widths, max(len(s.block_table) for s in batch.seqs))
    if batch.is_prefill:
        T = pick_bucket(config.prefill_buckets, sum(batch.num_new_tokens))
        return "prefill", T, min(config.max_num_seqs, T), W
    B = pick_bucket(config.decode_buckets, len(batch.seqs))
    return "decode", B, B, W


def pack(batch: ScheduledBatch, T: int, B: int, W: int, block_size: int, num_slots: int) -> np.ndarray:
    layout = batch_layout(T, B, W)
    buf = np.zeros(layout["_size"][0], np.int32)
    f = {name: buf[off:off + n] for name, (off, n) in layout.items() if name != "_size"}
    fl = {name: f[name].view(np.float32) for name in FLOAT_FIELDS}
    f["slot_mapping"][:] = num_slots                 # padding tokens write nowhere
    f["top_p"].view(np.float32)[:] = 1.0
    tables = f["block_tables"].reshape(B, W)
    t = 0
    for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
        start = seq.num_computed_tokens
        table = np.asarray(seq.block_table, np.int32)
        pos = np.arange(start, start + n, dtype=np.int32)
        f["token_ids"][t:t + n] = seq.token_ids[start:start + n]
        f["positions"][t:t + n] = pos
        f["slot_mapping"][t:t + n] = table[pos // block_size] * block_size + pos % block_size
        tables[i, :len(table)] = table
        t += n
        f["cu_seqlens"][i + 1] = t
        f["seq_lens"][i] = start + n
        f["sample_idx"][i] = t - 1
        p = seq.params
        f["top_k"][i] = p.top_k
        f["seeds"][i] = seq.seed
        f["counters"][i] = seq.num_output_tokens
        fl["temperature"][i], fl["top_p"][i], fl["min_p"][i] = p.temperature, p.top_p, p.min_p
    f["cu_seqlens"][len(batch.seqs) + 1:] = t
    return buf
