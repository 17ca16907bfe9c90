"""The tile sweep of `scripts/bench_kernels.py --sweep / --only-sweep`: decode tiles x context splits of the Pallas
decode kernel (bf16 and fp8 pages) and prefill tiles, at the shapes that matter for the targets."""
from __future__ import annotations

from bench_kernels import PREFILL_CASES, bench_decode, bench_prefill

DECODE_SWEEP_SHAPES = ((32, 2048), (64, 1024), (128, 1024), (256, 1024))
DECODE_SWEEP_TILES = tuple(dict(block_n=n, num_warps=w, num_stages=s) for n, w, s in (    # the default first
    (64, 2, 3), (64, 4, 3), (64, 2, 4), (32, 2, 3), (128, 4, 2), (128, 2, 3), (128, 4, 3), (256, 4, 2), (128, 2, 2)))
DECODE_SWEEP_SPLITS = (None, 1, 2, 4, 8)   # None: choose_num_splits


def sweep(ceil, smoke, prefill: bool = True):
    """Tile sweep at the shapes that matter for the targets: decode tiles x context splits, prefill tiles."""
    out = {"decode": [], "prefill": []}
    for b, ctx in ((2, 40),) if smoke else DECODE_SWEEP_SHAPES:
        variants = [{**t, "num_splits": None} for t in DECODE_SWEEP_TILES]
        variants += [{**DECODE_SWEEP_TILES[0], "num_splits": n} for n in DECODE_SWEEP_SPLITS[1:]]
        for opts in [{**v, "block_n": 16} for v in variants[:2]] if smoke else variants:
            r = bench_decode(b, ctx, ceil, opts, smoke, impls=("pallas", "fp8_qkv"))
            out["decode"].append({**opts, "batch": b, "ctx": ctx, "tbps": r.get("pallas_tbps"),
                                  "fp8_engine_tbps": r.get("fp8_qkv_tbps")})
            print(f"  sweep decode B={b} ctx={ctx} {opts}: {r.get('pallas_tbps') or 0:.2f} TB/s, fp8 engine "
                  f"{r.get('fp8_qkv_tbps') or 0:.2f} TB/s read", flush=True)
    if not prefill:
        return out
    for bq, bk, warps, stages in ((128, 64, 4, 3), (128, 64, 4, 2), (128, 128, 4, 2), (128, 32, 4, 3),
                                  (128, 64, 4, 4), (64, 32, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3)):
        opts = dict(block_q=16 if smoke else bq, block_k=16 if smoke else bk, num_warps=warps, num_stages=stages)
        for name, case in {"2x24": ([24, 9], [0, 20])}.items() if smoke else \
                [(n, PREFILL_CASES[n]) for n in ("1x8192", "8x1024")]:
            r = bench_prefill(name, *case, ceil, opts, smoke, impls=("pallas",))
            out["prefill"].append({**opts, "case": name, "tflops": r.get("pallas_tflops")})
            print(f"  sweep prefill {name} {opts}: {r.get('pallas_tflops') or 0:.1f} TFLOP/s", flush=True)
        if smoke:
            break
    return out
