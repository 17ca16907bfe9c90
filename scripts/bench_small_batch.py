"""Small-batch decode on the GPU: the engine's step at batch 1 / 8 / 32 and its pieces, to cut its GPU time.

    python scripts/bench_small_batch.py [--json PATH] [--profile DIR]       # H200: ~4 minutes with compiles
    python scripts/bench_small_batch.py --quick                              # CPU: a tiny model, interpret mode

Sections (printed as they run, all in the JSON; `--only steps,host,gemv,attention` picks some):
  steps      the engine's decode step per batch in its bucket (8 rows for batch 1-8, 32 for 32), `--context` tokens
             per row, with XLA's dots ("xla"), the gemv kernel with the RMSNorms / swiglu folded in ("gemv", i.e.
             layers.GEMV_MAX_ROWS = bucket), or without folding ("gemv-unfused", GEMV_FUSE = False):
             - one-step call: `pipelined` = calls back to back, ids fed on the device (the GPU time of a step);
               `engine-like` = the batch sent each step, the previous step's ids read after the next dispatch
             - K-step call (multistep.py, K = --k; "/unroll 4": 4 steps per loop iteration): `pipelined` = per step,
               calls back to back; `serial` = per step when each call's ids are read before the next is sent
             plus kernel launches per call from the optimised HLO (gemm / gemv / pad ops); --profile: a trace of
             each variant (busy vs span, top kernels)
  host       TPOT of a tiny model through LLM.generate, K-step calls vs one step per call, and the engine's host
             ms per call (the engine dispatches the next K-step call before reading one: docs/design.md, step 7)
  gemv       each decode matmul (the fused forms first) for M = bucket rows: XLA's dot (with its norm / swiglu ops)
             on the stacked weights as the model runs it, against pallas_kernels/gemv.py (auto tiles + a sweep
             while under --budget seconds): us per matmul, GB/s and % of 4.3 TB/s, error against XLA
  attention  the engine's decode attention kernel (paged_attention_qkv) chained over L layers as in a step, per
             batch and context split count / tile (auto = choose_num_splits): us per layer
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

HBM = 4.3e12          # H200 device copy, bytes/s (measured)


def timed(fn, args, iters: int, carry=None, read: str | None = None) -> float:
    """Median over 3 rounds of seconds per call, `iters` calls dispatched back to back (round 0 warms up).
    carry {arg: out index, or None for the whole output}: feed outputs back (donated caches, ids). read="each":
    read output 0 to the host after every call (serialised); "previous": after each dispatch read the previous
    call's output 0 (the engine's one-step loop: the host never waits for the step it just sent)."""
    import jax
    args, rounds, prev = list(args), [], None
    for r in range(4):
        t = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
            if read == "each":
                np.asarray(out[0])
            elif read == "previous" and prev is not None:
                np.asarray(prev)
            prev = out[0] if read else None
            for i, o in (carry or {}).items():
                args[i] = out if o is None else out[o]
        jax.block_until_ready(out)
        if r:
            rounds.append((time.perf_counter() - t) / iters)
    return float(np.median(rounds))


def decode_batch(n: int, ctx: int, bs: int, extra: int):
    """n sequences of ctx tokens (ctx - 1 cached), each with its own blocks for ctx + extra tokens; greedy."""
    from bench_step import decode_batch as make
    return make(n, ctx, bs, extra, temperature=0.0)


def count_kernels(hlo: str) -> dict:
    """Kernel launches of a compiled step from its optimised HLO: top-level fusions / custom calls / pads."""
    import re
    from collections import Counter
    out, fused, others = {"launches": 0, "pads": 0, "gemv": 0, "gemm": 0, "attention": 0}, False, Counter()
    for line in hlo.splitlines():
        if line and not line.startswith(" "):
            # fusion bodies hold no launches; command-buffer computations (CUDA graphs) and loop bodies do
            # (a dynamic-slice fusion's body is the one cuBLAS call it launches on a slice of its operand)
            fused = line.lstrip("%").startswith(("fused", "wrapped", "triton", "horizontally", "dynamic-slice-fusion"))
            continue
        if fused or " = " not in line:
            continue
        name = line.split(" = ")[0].strip().lstrip("%")
        if re.search(r"\b(fusion|custom-call|pad)\(", line):
            out["launches"] += 1
            out["pads"] += "pad" in name or bool(re.search(r"\bpad\(", line))
            out["gemv"] += "gemv" in line
            out["gemm"] += "gemm" in line.lower() or "cublas" in line.lower() or "dynamic_slice_fusion" in name
            out["attention"] += "paged_attention" in line
            if not any(w in line.lower() for w in ("gemv", "gemm", "cublas", "paged_attention", "dynamic_slice_fusion")):
                others[re.sub(r"([._]\d+)+$", "", name)] += 1        # the rest by XLA's fusion name
    out["others"] = dict(others.most_common(20))     # what the per-layer elementwise launches are
    return out


def bench_steps(a, cfg, params, out: dict) -> None:
    import jax
    import jax.numpy as jnp
    from concurrent.futures import ThreadPoolExecutor
    from jaxinfer.engine.batch import pack, pack_multistep
    from jaxinfer.engine.scheduler import ScheduledBatch
    from jaxinfer.model import layers
    from jaxinfer.model.attention import cache_layout
    from jaxinfer.multistep import make_multistep
    from jaxinfer.step import jit_step, make_step
    from jaxinfer.xla_options import step_compiler_options
    interpret = jax.devices()[0].platform != "gpu"
    bs, W, L, K = a.block_size, a.width, cfg.num_hidden_layers, a.k
    variants = []                          # (batch, bucket, call, matmul, unroll); call "one" | "K"
    for n in a.batches:
        B = next(b for b in a.buckets if b >= n)
        variants += [(n, B, c, mm, 1) for mm in ("xla", "gemv") for c in ("one", "K")]
        if B == a.buckets[0]:
            variants.append((n, B, "one", "gemv-unfused", 1))
    n_max = max(a.batches)
    if a.unroll > 1:                       # the device loop's per-iteration cost, at the largest batch
        variants.append((n_max, next(b for b in a.buckets if b >= n_max), "K", "xla", a.unroll))
    built = {}
    for _, B, call, mm, unroll in variants:
        layers.GEMV_MAX_ROWS = 0 if mm == "xla" else B     # both read when the step is built
        layers.GEMV_FUSE = mm != "gemv-unfused"
        f = (make_step(cfg, "decode", B, B, W, "pallas", interpret, B) if call == "one" else
             make_multistep(cfg, B, W, K, "pallas", interpret, unroll=unroll))
        built.setdefault((B, call, mm, unroll), jit_step(f))
    layers.GEMV_MAX_ROWS, layers.GEMV_FUSE = 0, True
    batch, blocks = decode_batch(n_max, a.context, bs, K)
    kv_shape, pairs = cache_layout("pallas", L, (blocks, bs, cfg.num_key_value_heads, cfg.head_dim))  # the engine's
    fresh = lambda: [(jnp.zeros(kv_shape, a.dtype), jnp.zeros(kv_shape, a.dtype)) for _ in range(pairs)]  # noqa: E731

    def packed_for(n, B, call):
        sub = ScheduledBatch(batch.seqs[:n], [1] * n, False)
        if call == "one":
            return pack(sub, B, B, W, bs, blocks * bs)
        return pack_multistep(sub, B, W, bs, blocks * bs, [[] for _ in range(n)], [K] * n)

    # compile every variant in parallel threads (XLA compiles outside the GIL), as the engine's warm-up does
    kv0, opts = fresh(), step_compiler_options(jax.devices()[0].platform)

    def compile_one(key):
        B, call = key[:2]
        p = jnp.asarray(packed_for(min(B, n_max), B, call))
        t = time.perf_counter()
        try:
            exe = built[key].lower(params, kv0, p, jnp.zeros((B,), jnp.int32)).compile(compiler_options=opts or None)
        except Exception as err:         # e.g. a kernel the GPU compiler refuses: the other variants still run
            print(f"  compiling {key} FAILED: {str(err)[:300]}", flush=True)
            exe = None
        return key, exe, time.perf_counter() - t
    t0 = time.perf_counter()
    with ThreadPoolExecutor(min(8, len(built))) as pool:
        compiled = {k: (e, s) for k, e, s in pool.map(compile_one, list(built))}
    print(f"compiled {len(compiled)} step variants in {time.perf_counter() - t0:.1f} s", flush=True)
    kv0 = None                       # the compile-only pool copy is freed (the closure above is done with it)
    rows = []
    for n, B, call, mm, unroll in variants:
        exe, compile_s = compiled[(B, call, mm, unroll)]
        if exe is None:
            rows.append(dict(batch=n, bucket=B, call=call, matmul=mm, unroll=unroll, error="compile failed"))
            continue
        pk, ids = packed_for(n, B, call), jnp.zeros((B,), jnp.int32)
        r = dict(batch=n, bucket=B, call="one-step" if call == "one" else f"K={K}" + (f"/unroll {unroll}" if unroll > 1
                 else ""), matmul=mm, compile_s=round(compile_s, 1), kernels=count_kernels(exe.as_text()))
        if a.hlo_dir:                 # the optimised HLO, to read which fusions a step launches
            os.makedirs(a.hlo_dir, exist_ok=True)
            with open(os.path.join(a.hlo_dir, f"b{n}_B{B}_{call}_{mm}_u{unroll}.hlo.txt"), "w") as f:
                f.write(exe.as_text())
        per = 1 if call == "one" else K               # steps per call
        iters = a.iters if call == "one" else max(2, a.iters // K)
        carry = {1: 1, 3: 0} if call == "one" else {1: 1}          # K-step calls: same batch every call
        r["pipelined_ms"] = timed(exe, (params, fresh(), jnp.asarray(pk), ids), iters, carry) * 1e3 / per
        if call == "one":
            r["engine_ms"] = timed(lambda p, kv, _, i: exe(p, kv, jax.device_put(pk), i), (params, fresh(), None, ids),
                                   iters, {1: 1, 3: 0}, read="previous") * 1e3
        else:     # each call's ids read before the next is sent (the engine did so before it queued K-step calls)
            r["serial_ms"] = timed(lambda *x: exe(*x[:2], jax.device_put(pk), x[3]), (params, fresh(), None, ids),
                                   iters, {1: 1}, read="each") * 1e3 / per
        if a.profile:
            from trace_summary import profiled
            from trace_summary import summarize
            d = os.path.join(a.profile, f"b{n}_{call}_{mm}_u{unroll}")
            with profiled(d):
                timed(exe, (params, fresh(), jnp.asarray(pk), ids), iters, carry)
            # per step; busy / span: how much of the time some kernel ran (the rest: launch / loop / host gaps)
            s = summarize(d, top=20, steps=4 * iters * per)
            r["profile"] = dict(span_ms=s["span_ms"], busy_ms=s["busy_ms"], kernels=s["kernels"], top=s["top"])
            trace = (f"    trace: busy {100 * s['busy_ms'] / max(s['span_ms'], 1e-9):.1f}% of the span; per step: "
                     + ", ".join(f"{t['name'][:28]} {t['ms'] * 1e3:.0f} us x{t['calls']:.0f}" for t in s["top"][:5]))
        rows.append(r)
        k = r["kernels"]
        print(f"  batch {n:3d} (bucket {B:3d}) {r['call']:>16} {mm:>12}: pipelined {r['pipelined_ms']:.3f} ms/step"
              + (f", engine-like {r['engine_ms']:.3f}" if "engine_ms" in r else f", serial {r['serial_ms']:.3f}")
              + f"  [{k['launches']} launches/call: {k['gemm']} gemm, {k['gemv']} gemv, {k['pads']} pad; others: "
              + ", ".join(f"{n} {c}" for n, c in list(k["others"].items())[:6]) + "]", flush=True)
        if a.profile:
            print(trace, flush=True)
    out["steps"] = rows


def bench_host(a, out: dict) -> None:
    """TPOT through LLM.generate of a tiny model (its GPU step is ~0.1-0.2 ms), K-step calls against one step per
    call, with the engine's host seconds per call: the host's own cost per token. A K-step call is read, applied,
    scheduled and packed before the next is sent, so that cost adds to the GPU's; one-step calls overlap it."""
    import gc
    import tempfile
    import jaxinfer.engine.runner as runner
    from bench_multistep import latency
    from jaxinfer import LLM
    from make_tiny_model import make_tiny_model
    saved, runner.MULTISTEP_MAX_ROWS = runner.MULTISTEP_MAX_ROWS, max(a.batches)   # K-step up to the largest batch
    path = make_tiny_model(os.path.join(tempfile.mkdtemp(), "tiny"), vocab_size=4096, hidden_size=256,
                           intermediate_size=768, num_hidden_layers=4, head_dim=64, dtype="bfloat16",
                           max_position_embeddings=4096)
    rows = []
    for steps in (a.k, 1):
        buckets = tuple(sorted({next(b for b in a.buckets if b >= n) for n in a.batches}))
        llm = LLM(path, max_num_seqs=max(a.batches), decode_buckets=buckets, prefill_buckets=(4096,),
                  max_model_len=2048, max_num_batched_tokens=4096, num_kvcache_blocks=8192, num_scheduler_steps=steps)
        eng = llm.engine
        for n in a.batches:
            eng.host_time = dict.fromkeys(eng.host_time, 0.0)
            calls0, steps0 = eng.counters["multistep_calls"], eng.counters["decode_steps"]
            r, _ = latency(llm, n, prompt_len=128, out_len=8 * a.k + 1, repeats=2)
            calls = eng.counters["multistep_calls"] - calls0 or eng.counters["decode_steps"] - steps0
            host = {k.removesuffix("_s") + "_ms": v * 1e3 / max(calls, 1) for k, v in eng.host_time.items()}
            rows.append(dict(batch=n, steps_per_call=steps, calls=calls, **r, host_per_call=host))
            print(f"  tiny model, batch {n:3d}, {steps:2d} steps/call: TPOT {r['tpot_ms']:.3f} ms; host per call "
                  + ", ".join(f"{k} {v:.2f}" for k, v in host.items()), flush=True)
        del llm, eng
        gc.collect()                        # the first engine's KV pool goes before the second is made
    runner.MULTISTEP_MAX_ROWS = saved
    out["host"] = rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--buckets", default="8,32,64", help="the engine's decode buckets (its GPU default starts 8, 32)")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--width", type=int, default=256, help="block-table width (the engine's: 4096 tokens / 16)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--k", type=int, default=16, help="steps per K-step call")
    ap.add_argument("--unroll", type=int, default=4, help="also a K-step call with this many steps per loop "
                                                         "iteration, at the largest batch (1: none)")
    ap.add_argument("--iters", type=int, default=32)
    ap.add_argument("--no-sweep", dest="sweep", action="store_false", help="gemv: automatic tiles only")
    ap.add_argument("--only", default="steps,host,gemv,attention", help="sections to run")
    ap.add_argument("--quick", action="store_true", help="tiny model, few iterations (CPU check of this script)")
    ap.add_argument("--profile", default=None, metavar="DIR")
    ap.add_argument("--hlo-dir", default=None, metavar="DIR", help="write each step variant's optimised HLO here")
    ap.add_argument("--json", default=None)
    ap.add_argument("--budget", type=float, default=160.0,
                    help="seconds after which the gemv tile sweep and extra attention splits are skipped")
    a = ap.parse_args(argv)
    a.t0 = time.perf_counter()
    from jaxinfer.xla_options import set_process_flags
    set_process_flags()                     # this script owns its process: the engine's command-buffer mode
    import jax
    import jax.numpy as jnp
    from bench import write_json
    a.batches = [int(x) for x in a.batches.split(",")]
    a.buckets = sorted(int(x) for x in a.buckets.split(","))
    a.dtype = jnp.bfloat16
    if a.quick:
        from jaxinfer.config import ModelConfig
        from jaxinfer.model.qwen3 import init_params
        cfg = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
                          rope_theta=10000.0, tie_word_embeddings=True, max_position_embeddings=512,
                          torch_dtype="bfloat16", eos_token_id=(1,), name="tiny")
        params = init_params(cfg, a.dtype)
        a.batches, a.context, a.width, a.k, a.iters, a.sweep, a.unroll = [1, 8], 48, 4, 2, 2, False, 2
    else:
        from jaxinfer.hub import load_model
        cfg, params, _ = load_model(a.model, "bfloat16")
    out = dict(model=cfg.name, device=str(jax.devices()[0].device_kind), jax=jax.__version__, context=a.context,
               width=a.width, k=a.k, xla_flags=os.environ.get("XLA_FLAGS", ""))
    t0 = time.perf_counter()
    sections = a.only.split(",")
    from small_batch_kernels import bench_attention, bench_gemv      # the kernel sections (their own file)
    for name, fn in (("steps", lambda: bench_steps(a, cfg, params, out)), ("host", lambda: bench_host(a, out)),
                     ("gemv", lambda: bench_gemv(a, cfg, out)), ("attention", lambda: bench_attention(a, cfg, out))):
        if name in sections:
            print(f"== {name} ({time.perf_counter() - t0:.0f} s so far)", flush=True)
            try:
                fn()
            except Exception:               # one section failing (on a new machine / JAX) keeps the others
                import traceback
                traceback.print_exc()
                out[name + "_error"] = traceback.format_exc()[-2000:]
            write_json(a.json, out)         # after each section: a later failure keeps what was measured
    out["wall_s"] = time.perf_counter() - t0
    print(f"done in {out['wall_s']:.0f} s")
    write_json(a.json, out)
    return out


if __name__ == "__main__":
    main()
