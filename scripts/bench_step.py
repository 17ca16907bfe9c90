"""Anatomy of one decode step: where the time of the engine's compiled step goes.

    python scripts/bench_step.py [--model qwen3-0.6b] [--batch 256] [--context 1024] [--attn-backend pallas]
                                 [--json PATH]

Each part is compiled alone and timed back to back on the device (median of --iters calls):
  step       the engine's whole decode step (KV write, all layers, LM head, sampling), as the runner runs it
             (each call waited for: dispatch + GPU + read-back)
  pipelined  the same step dispatched back to back, as the engine does (GPU time per step, unless the host
             is slower)
  dispatch   host time for the step call to return while the GPU is idle (argument handling, launch)
  layers     the decoder layers with attention left out (matmuls, norms, rope, KV write)
  attention  the attention calls of all layers alone, over `context` tokens of every sequence
  head       the sampled rows -> logits -> sampling
next to each part's floor: the bytes it must read divided by the bandwidth measured in this process.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402


def median_time(fn, args, iters: int, carry: dict[int, int] | None = None) -> float:
    """Median seconds per call; carry {argument index: output index} feeds donated outputs back."""
    import jax
    args = list(args)
    times = []
    for i in range(iters + 2):
        t = time.perf_counter()
        out = fn(*args)
        jax.block_until_ready(out)
        if i >= 2:                                     # two warm-up calls
            times.append(time.perf_counter() - t)
        for i_arg, i_out in (carry or {}).items():
            args[i_arg] = out[i_out]
    return float(np.median(times))


def back_to_back(step, args, iters: int, like_engine: bool = False) -> tuple[float, float]:
    """(seconds per step, host seconds per call in transfer + dispatch) for steps dispatched back to back, each
    fed the previous step's ids on the device and its donated caches. `like_engine`: as the engine loop runs
    it, the numpy batch is sent every step and the previous step's ids are read after the next is dispatched."""
    import jax
    params, kv, packed, ids = args
    runs, dispatch = [], []
    for _ in range(6):                                 # the first round is a warm-up
        t = time.perf_counter()
        for _ in range(iters):
            t0 = time.perf_counter()
            new_ids, kv = step(params, kv, jax.device_put(packed) if like_engine else packed, ids)
            dispatch.append(time.perf_counter() - t0)
            if like_engine:
                np.asarray(ids)
            ids = new_ids
        jax.block_until_ready(ids)
        runs.append((time.perf_counter() - t) / iters)
    return float(np.median(runs[1:])), float(np.mean(dispatch[iters:]))


def idle_dispatch(step, args, iters: int) -> float:
    """Median host seconds for one step call to return while the GPU is idle."""
    import jax
    params, kv, packed, ids = args
    times = []
    for _ in range(iters):
        jax.block_until_ready(ids)
        t = time.perf_counter()
        ids, kv = step(params, kv, packed, ids)
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def hlo_kernels(hlo_text: str) -> dict[str, int]:
    """Kernel launches of a compiled step, counted from its optimised HLO text: every fusion and custom call
    (cuBLAS GEMM, Pallas kernel) outside fused computations is one kernel (a cuBLAS split-K GEMM may be two)."""
    counts: dict[str, int] = {}
    fused = False
    for line in hlo_text.splitlines():
        if line and not line.startswith(" "):      # a computation header: fused bodies hold no launches
            fused = line.lstrip("%").startswith(("fused", "wrapped", "triton", "horizontally", "command_buffer_fused"))
            continue
        if fused:
            continue
        m = re.search(r"custom_call_target=\"([^\"]+)\"", line)
        if m:
            key = "custom-call " + m.group(1)
        elif re.search(r"\bfusion\(", line):
            kind = re.search(r"kind=(k\w+)", line)
            key = "fusion " + (kind.group(1) if kind else "?")
        else:
            continue
        counts[key] = counts.get(key, 0) + 1
    return counts


def _option_value(v: str):
    """XLA compile options take typed values: 'true'/'false' -> bool, digits -> int, else the string."""
    if v.lower() in ("true", "false"):
        return v.lower() == "true"
    return int(v) if v.lstrip("-").isdigit() else v


def decode_batch(B: int, ctx: int, block_size: int, extra: int = 0, temperature: float = 0.6):
    """B sequences of ctx tokens (ctx - 1 cached), each with its own contiguous run of blocks (room for `extra`
    more tokens). -> (ScheduledBatch, number of blocks used + 1)."""
    from jaxinfer.engine.scheduler import ScheduledBatch
    from jaxinfer.engine.sequence import Sequence
    from jaxinfer.sampling_params import SamplingParams
    n = -(-(ctx + extra) // block_size)
    seqs = []
    for b in range(B):
        s = Sequence([1 + b % 7] * ctx, SamplingParams(temperature=temperature, ignore_eos=True), b, block_size)
        s.block_table = list(range(b * n, (b + 1) * n))
        s.num_computed_tokens = ctx - 1
        seqs.append(s)
    return ScheduledBatch(seqs, [1] * B, False), B * n + 1


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--attn-backend", default="pallas", choices=["xla", "pallas"])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", default=None)
    ap.add_argument("--only-step", action="store_true", help="time the whole step only (no parts)")
    ap.add_argument("--compiler-option", action="append", default=[], metavar="KEY=VALUE",
                    help="an XLA option for compiling the step, e.g. xla_gpu_enable_cublaslt=true")
    ap.add_argument("--profile", default=None, metavar="DIR", help="also trace the whole step; print its kernels")
    ap.add_argument("--kernels", default=None, metavar="PATH",
                    help="write the compiled step's optimised HLO here and print its kernels by kind")
    a = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from bench import write_json
    from timing import copy_bandwidth
    from jaxinfer.engine.batch import pack
    from jaxinfer.engine.memory import kv_bytes_per_block
    from jaxinfer.hub import load_model
    from jaxinfer.model.attention import attention_fns, cache_layout, write_kv
    from jaxinfer.model.qwen3 import compute_logits, forward
    from jaxinfer.sampling import sample
    from jaxinfer.step import jit_step, make_step, unpack

    cfg, params, _ = load_model(a.model, a.dtype)
    B, bs, L = a.batch, a.block_size, cfg.num_hidden_layers
    batch, num_blocks = decode_batch(B, a.context, bs)
    W = -(-a.context // bs)
    packed = jnp.asarray(pack(batch, B, B, W, bs, num_blocks * bs))
    shape = (num_blocks, bs, cfg.num_key_value_heads, cfg.head_dim)
    dtype = jnp.dtype(a.dtype)
    step_shape, pairs = cache_layout(a.attn_backend, L, shape)          # the step: the engine's cache layout
    fresh_step_kv = lambda: [(jnp.zeros(step_shape, dtype), jnp.zeros(step_shape, dtype)) for _ in range(pairs)]
    fresh_kv = lambda: [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(L)]   # the parts: per layer
    interpret = jax.devices()[0].platform != "gpu"
    prev = jnp.zeros((B,), jnp.int32)
    f = unpack(packed, B, B, W)
    _, decode_fn = attention_fns(a.attn_backend, interpret)

    def layers_only(params, kv, tokens, positions):
        def attn(l, q, k, v, cache):
            return q, write_kv(*cache, k, v, f["slot_mapping"])
        return forward(cfg, params, tokens, positions, attn, kv)

    def attention_only(q, kv):
        return [decode_fn(q, k, v, f["block_tables"], f["seq_lens"]) for k, v in kv]

    def head(params, hidden):
        ids = sample(compute_logits(cfg, params, hidden), f["temperature"], f["top_k"], f["top_p"], f["min_p"],
                     f["seeds"], f["counters"], filtered=False)
        return ids

    q = jnp.ones((B, cfg.num_attention_heads, cfg.head_dim), dtype)
    hidden = jnp.ones((B, cfg.hidden_size), dtype)
    opts = {k: _option_value(v) for k, v in (kv.split("=", 1) for kv in a.compiler_option)}
    step = jit_step(make_step(cfg, "decode", B, B, W, a.attn_backend, interpret, B)).lower(
        params, fresh_step_kv(), packed, prev).compile(compiler_options=opts or None)
    if a.kernels:
        text = step.as_text()
        with open(a.kernels, "w") as fh:
            fh.write(text)
        counts = hlo_kernels(text)
        print(f"kernels in the compiled step: {sum(counts.values())} ({sum(counts.values()) / L:.1f} per layer)")
        for k, n in sorted(counts.items(), key=lambda kv: -kv[1]):
            print(f"  {n:5d}  {k}")
    times = {"step": median_time(step, (params, fresh_step_kv(), packed, prev), a.iters, {1: 1})}
    times["dispatch"] = idle_dispatch(step, (params, fresh_step_kv(), packed, prev), a.iters)
    times["pipelined"], _ = back_to_back(step, (params, fresh_step_kv(), packed, prev), a.iters)
    times["engine"], times["engine_dispatch"] = back_to_back(step, (params, fresh_step_kv(), np.asarray(packed), prev),
                                                             a.iters, like_engine=True)
    if not a.only_step:
        times["layers"] = median_time(jax.jit(layers_only, donate_argnums=1),
                                      (params, fresh_kv(), f["token_ids"], f["positions"]), a.iters, {1: 1})
        times["attention"] = median_time(jax.jit(attention_only), (q, fresh_kv()), a.iters)
        times["head"] = median_time(jax.jit(head), (params, hidden), a.iters)
    profile = None
    if a.profile:
        from trace_summary import profiled, summarize_profile
        with profiled(a.profile):
            median_time(step, (params, fresh_step_kv(), packed, prev), a.iters, {1: 1})
        profile = summarize_profile(a.profile, a.iters + 2)

    bw = copy_bandwidth(2**30 if not interpret else 2**22)
    item = dtype.itemsize
    head_bytes = cfg.vocab_size * cfg.hidden_size * item
    layer_bytes = (cfg.num_params() - cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)) * item
    kv_bytes = B * a.context * kv_bytes_per_block(cfg, 1, dtype)
    floors = {"step": (layer_bytes + head_bytes + kv_bytes) / bw, "layers": layer_bytes / bw,
              "attention": kv_bytes / bw, "head": head_bytes / bw}
    print(f"{a.model} decode step, batch {B} x context {a.context}, {a.attn_backend}, "
          f"stacked weights; bandwidth {bw / 1e12:.2f} TB/s")
    print(f"{'part':>10} | {'time ms':>8} | {'floor ms':>8} | {'% floor':>7}")
    for k in ("step", "pipelined", "layers", "attention", "head"):
        if k in times:
            fl = floors[k if k != "pipelined" else "step"]
            print(f"{k:>10} | {times[k] * 1e3:8.3f} | {fl * 1e3:8.3f} | {100 * fl / times[k]:6.1f}%")
    print(f"host dispatch of one step (GPU idle): {times['dispatch'] * 1e3:.3f} ms; as the engine runs it "
          f"(numpy batch -> device, dispatch, read the previous step's ids): {times['engine'] * 1e3:.3f} ms a step, "
          f"{times['engine_dispatch'] * 1e3:.3f} ms of it in transfer + dispatch")
    if not a.only_step:
        other = times["step"] - times["layers"] - times["attention"] - times["head"]
        print(f"step - (layers + attention + head) = {other * 1e3:.3f} ms (fusion differences, launch gaps)")
    r = dict(model=a.model, batch=B, context=a.context, attn_backend=a.attn_backend,
             bandwidth_GBs=bw / 1e9,
             times_ms={k: v * 1e3 for k, v in times.items()}, floors_ms={k: v * 1e3 for k, v in floors.items()},
             profile=profile)
    write_json(a.json, r)
    return r


if __name__ == "__main__":
    main()
