"""Several decode steps in one jitted call: `multistep(params, kv_caches, packed, prev_ids) -> (ids [K, B], kv_caches,
prev_ids')`, prev_ids' holding each row's last sampled id (-1: the row stopped) for the call after it.

A batch-1 decode step is bound by the host (dispatching one call costs ~1 ms on the H200 host, the GPU needs
~0.3-0.5 ms), so small batches run K steps per call. Each step's sampled ids feed the next on the device; the
host reserves KV blocks for all K steps beforehand (look-ahead blocks) and reads K tokens per row at the end.

The packed batch is a decode batch (`step.batch_layout(B, B, W)`, step 0's positions / slots / seq_lens) plus
- stop_ids [B, STOP_IDS]: ids that end the row (EOS unless ignore_eos, and stop_token_ids; -1 pads);
- remaining [B]: how many tokens the row may still sample (max_tokens and max_model_len; 0 for padding rows).
A row stops on the device after a stop id or `remaining` tokens: from then on it is masked (its seq_len is 0,
so it writes no KV and attends to nothing) and returns -1, so no token past a stop ever reaches the host.
Step k of row b samples with counter counters[b] + k: the index of the token it samples (seeded tokens do
not depend on K). Positions / slots of step k come from the block table on the device.
The host dispatches the next call before reading this one (as one-step calls are: engine/llm_engine.py), its
rows' input ids read from prev_ids' on the device; a row that stopped in this call reads -1 there and stays
masked for the whole next call, whose ids the host then ignores (it finishes the row on reading this one).

The loop over K is a `lax.fori_loop` (LOOP = "fori"): one program per (bucket, K) whose compile time does not
grow with K. Measured on CPU with a 28-layer tiny model (B = 8): a 1-step decode compiles in 5.7 s, the
fori_loop in 5.4-5.6 s for K = 4 and 16, a static Python loop ("unroll") in 19.7 s for K = 4 and 163 s for
K = 16 (superlinear): unrolled variants would break the 60 s warm-up. Its trip count is static, so XLA runs
the loop without reading a predicate back to the host; the body's kernels are captured in command buffers
(CUDA graphs), replayed once per iteration. Rows cannot exit early without a host read (a device-side
predicate is copied to the host), so the host picks K from the rows' `remaining` instead.

A batch with a request asking for penalties or logprobs runs one step per call (Scheduler.plan_steps): the
step's extras variant (step.Extras: penalty counts, logprob rows) has no K-step form. Their tokens are the
same either way; only the host-bound small-batch speed-up is lost for them.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig
from jaxinfer.model.layers import decode_matmul
from jaxinfer.model.qwen3 import compute_logits, forward, tp_size
from jaxinfer.parallel.sample import sample_sharded
from jaxinfer.sampling import sample
from jaxinfer.step import aligned, batch_layout, step_attention, unpack

STOP_IDS = 4          # stop ids per row carried on the device; a row with more runs one step per call
LOOP = "fori"         # "fori" | "unroll" (see above)


def multistep_layout(B: int, W: int) -> dict[str, tuple[int, int]]:
    """The decode layout plus stop_ids [B * STOP_IDS] and remaining [B] at its end."""
    layout = dict(batch_layout(B, B, W))
    off = aligned(layout.pop("_size")[0])
    layout["stop_ids"] = (off, B * STOP_IDS)
    off = aligned(off + B * STOP_IDS)
    layout["remaining"] = (off, B)
    layout["_size"] = (off + B, 0)
    return layout


def make_multistep(config: ModelConfig, B: int, W: int, K: int, backend: str, interpret: bool = False,
                   filtered: bool | str = False, mesh=None, loop: str | None = None, unroll: int = 1):
    """The K-step decode function for B rows and W-block tables (not yet jitted). `unroll`: steps per iteration
    of the fori_loop (K / unroll iterations; scripts/bench_small_batch.py measures whether the per-iteration
    cost of the device loop matters)."""
    loop = loop or LOOP
    mm = decode_matmul(B, interpret, tp_size(mesh))          # small batches: the gemv kernel (None: XLA's dot)

    def multistep(params, kv_caches, packed, prev_ids):
        base = unpack(packed[:batch_layout(B, B, W)["_size"][0]], B, B, W)
        lay = multistep_layout(B, W)
        stop = packed[lay["stop_ids"][0]:lay["stop_ids"][0] + B * STOP_IDS].reshape(B, STOP_IDS)
        remaining = packed[lay["remaining"][0]:lay["remaining"][0] + B]
        prev = base["prev_row"]
        tok0 = jnp.where(prev >= 0, prev_ids[jnp.maximum(prev, 0)], base["token_ids"])           # [B]
        start, pages = base["positions"], base["block_tables"].reshape(-1)                      # [B], [B * W]
        P, bs = kv_caches[0][0].shape[:2]      # (stacked caches: P spans all layers; P * bs is still padding)
        # a row whose input token was sampled by the step before (still on the device) and was a stop id is done
        # (-1: the row stopped in the call before this one, dispatched before the host read it). A token from the
        # host is a prompt's last one (chunked prefill left it to this call) or one the host checked: no stop.
        stopped = (prev >= 0) & jnp.any(tok0[:, None] == stop, axis=-1)
        active0 = (base["seq_lens"] > 0) & (remaining > 0) & (tok0 >= 0) & ~stopped

        def one(k, tok, active, caches):
            pos = start + k
            # row b's pages start at table_start[b] (engine/batch.py); the host reserved the call's look-ahead
            # blocks, so an active row's position is inside its own pages (inactive rows write nowhere)
            slot = pages[jnp.clip(base["table_start"] + pos // bs, 0, B * W - 1)] * bs + pos % bs
            meta = dict(base, positions=pos, slot_mapping=jnp.where(active, slot, P * bs),
                        seq_lens=jnp.where(active, pos + 1, 0))
            attn = step_attention(config, "decode", backend, meta, interpret, mesh, params, caches)
            hidden, caches = forward(config, params, tok, pos, attn, caches, mesh, mm)
            logits = compute_logits(config, params, hidden, mm)                                  # [B, V']
            args = (logits, base["temperature"], base["top_k"], base["top_p"], base["min_p"], base["seeds"],
                    base["counters"] + k, filtered)
            ids = sample_sharded(*args, mesh, config.vocab_size) if tp_size(mesh) > 1 else sample(*args)
            out = jnp.where(active, ids, -1)
            active = active & ~jnp.any(ids[:, None] == stop, axis=-1) & (k + 1 < remaining)
            return ids, active, caches, out

        if loop == "unroll":
            tok, active, caches, outs = tok0, active0, kv_caches, []
            for k in range(K):
                tok, active, caches, out = one(k, tok, active, caches)
                outs.append(out)
            return jnp.stack(outs), caches, prev_ids.at[:B].set(outs[-1])

        def body(k, carry):
            tok, active, caches, outs = carry
            tok, active, caches, out = one(k, tok, active, caches)
            return tok, active, caches, outs.at[k].set(out)
        init = (tok0, active0, kv_caches, jnp.full((K, B), -1, jnp.int32))
        _, _, caches, outs = jax.lax.fori_loop(0, K, body, init, unroll=unroll)
        return outs, caches, prev_ids.at[:B].set(outs[K - 1])

    return multistep
