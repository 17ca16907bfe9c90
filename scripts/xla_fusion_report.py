"""What XLA fuses: kernels of the engine's compiled xla decode and prefill steps, per layer, from the optimised HLO.

    PYTHONPATH=. python scripts/xla_fusion_report.py [--model qwen3-0.6b] [--json PATH] [--hlo-dir DIR]
    PYTHONPATH=. python scripts/xla_fusion_report.py --time        # + attention micro-benchmark per shape
    PYTHONPATH=. python scripts/xla_fusion_report.py --smoke       # tiny shapes (CPU: checks the script)

For one decode bucket (--batch rows, --context tokens) and one prefill bucket (--prefill-tokens tokens in rows
of --prompt tokens; bucket rows --rows) the step is lowered and compiled for the current platform with the
engine's compiler options (`jax.jit(step).lower(...).compile().as_text()`; weights are shapes only, nothing
is allocated). Every fusion or custom call outside a fused computation is one kernel launch; each is listed by
kind (kLoop elementwise, kInput reduction, kOutput / custom-call GEMM, ...) and by the ops fused into it, then
divided by the layer count. The attention call alone is compiled the same way, to show whether the page
gather is fused into its consumer (decode "reduce" and "reduce_per_group" forms) or written out first ("einsum"
form: a gather fusion whose output is the [B, S, K, D] copy).

--time times the attention call alone per shape (median of back-to-back calls): decode in each form at tight
and 2x-padded block-table widths, prefill per tile size; decode's effective GB/s counts the K/V bytes the
rows need, next to the copy bandwidth measured in the same process.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

_SKIP = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "copy-start", "copy-done"}
_INTERESTING = ("gather", "scatter", "dot", "reduce", "exponential", "convolution", "sort", "dynamic-slice",
                "dynamic-update-slice", "transpose", "copy", "convert", "select")


def parse_hlo(text: str) -> tuple[dict[str, list[tuple]], set[str]]:
    """{computation: [(name, opcode, shape, called computation | None)]}, and the names of the computations that
    launch nothing themselves (fusion bodies, reducers and comparators called through to_apply)."""
    comps: dict[str, list[tuple]] = {}
    fused, cur = set(), None
    for line in text.splitlines():
        if line and not line.startswith(" ") and line.rstrip().endswith("{"):
            cur = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
            comps[cur] = []
            continue
        m = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\([^=]*?\)|\S+)\s+([\w\-]+)\(", line)
        if cur is None or not m:
            continue
        calls = re.search(r"calls=%?([\w.\-]+)", line)
        comps[cur].append((m.group(1), m.group(3), m.group(2), calls.group(1) if calls else None))
        if m.group(3) == "fusion" and calls:
            fused.add(calls.group(1))
        fused.update(re.findall(r"to_apply=%?([\w.\-]+)", line))
    return comps, fused


def fused_ops(comps, name: str) -> Counter:
    """Opcodes inside a fused computation (nested fusions included)."""
    ops = Counter()
    for _, op, _, calls in comps.get(name, []):
        if op == "fusion" and calls:
            ops.update(fused_ops(comps, calls))
        elif op not in _SKIP:
            ops[op] += 1
    return ops


def kernels(text: str) -> list[dict]:
    """One entry per kernel launch: every fusion / custom call / other op in a non-fused computation (the
    entry, loop bodies). While loops run their body's kernels per iteration (counted once here)."""
    comps, fused = parse_hlo(text)
    out = []
    for comp, instrs in comps.items():
        if comp in fused:
            continue
        for name, op, shape, calls in instrs:
            if op in _SKIP or op in ("while", "conditional", "call", "all-reduce-start", "all-reduce-done"):
                continue
            if op == "fusion":
                inside = fused_ops(comps, calls)
                kind = re.search(rf"%?{re.escape(name)}\s*=.*kind=(k\w+)", text)
                label = "fusion " + (kind.group(1) if kind else "?")
            else:
                inside, label = Counter({op: 1}), op
            if op == "custom-call":
                target = re.search(rf"%?{re.escape(name)}\s*=.*custom_call_target=\"([^\"]+)\"", text)
                label = "custom-call " + (target.group(1) if target else "?")
            out.append(dict(name=name, kind=label, shape=shape,
                            ops=sorted(o for o in inside if o in _INTERESTING)))
    return out


def _elements(shape: str) -> int:
    dims = re.search(r"\[([\d,]*)\]", shape)
    return int(np.prod([int(d) for d in dims.group(1).split(",") if d])) if dims else 0


def table(ks: list[dict], per: int = 1) -> list[tuple[str, float]]:
    """(kind [+ the interesting ops fused in], count / per), most frequent first."""
    c = Counter(f"{k['kind']}" + (f" [{', '.join(k['ops'])}]" if k["ops"] else "") for k in ks)
    return [(key, n / per) for key, n in c.most_common()]


def print_table(title: str, ks: list[dict], per: int, unit: str) -> None:
    print(f"\n{title}: {len(ks)} kernels ({len(ks) / per:.1f} {unit})")
    for key, n in table(ks, per):
        print(f"  {n:7.2f}  {key}")


def compile_text(fn, *args, platform: str) -> str:
    import jax

    from jaxinfer.xla_options import step_compiler_options
    return jax.jit(fn).lower(*args).compile(compiler_options=step_compiler_options(platform)).as_text()


def step_reports(a, cfg, platform: str, hlo_dir: str | None) -> dict:
    """Kernels of the engine's whole decode and prefill steps (make_step) for one bucket each."""
    import jax
    import jax.numpy as jnp

    from jaxinfer.model.qwen3 import init_params
    from jaxinfer.step import batch_layout, make_step

    dtype = jnp.dtype(a.dtype)
    params = jax.eval_shape(lambda: init_params(cfg, dtype))
    L, bs = cfg.num_hidden_layers, a.block_size
    out = {}
    for kind, T, B, ctx in (("decode", a.batch, a.batch, a.context), ("prefill", a.prefill_tokens, a.rows, a.prompt)):
        W = -(-ctx // bs)
        blocks = B * W + 1
        cache = jax.ShapeDtypeStruct((blocks, bs, cfg.num_key_value_heads, cfg.head_dim), dtype)
        caches = [(cache, cache) for _ in range(L)]       # a pair per layer: unrolled, so counts per layer read
        #                                                   directly (the engine scans the same layer body)
        packed = jax.ShapeDtypeStruct((batch_layout(T, B, W)["_size"][0],), jnp.int32)
        prev = jax.ShapeDtypeStruct((B,), jnp.int32)
        text = compile_text(make_step(cfg, kind, T, B, W, "xla"), params, caches, packed, prev, platform=platform)
        if hlo_dir:
            with open(os.path.join(hlo_dir, f"xla_{kind}_step.hlo.txt"), "w") as f:
                f.write(text)
        ks = kernels(text)
        print_table(f"{kind} step, {T} tokens, {B} rows, {W}-block tables ({ctx} tokens)", ks, L, "per layer")
        out[kind] = dict(tokens=T, rows=B, width=W, kernels=len(ks), per_layer=len(ks) / L, table=table(ks, L))
    return out


FORMS = ("einsum", "reduce", "reduce_per_group", "mixed")     # the forms that read every page of a row's width


def attention_cases(a, cfg):
    """(label, fn, args, kv bytes needed) of the attention call alone, per shape and variant. The cache is a
    pool of --pool-tokens like the engine's: XLA fuses a gather into its consumer only when the gather's
    output is smaller than its operand (gpu_fusible.cc IfFusedReadsElementsMultipleTimes), so a pool
    holding just the benchmarked rows would show a copy the engine never makes."""
    import jax
    import jax.numpy as jnp

    from jaxinfer.model.xla_attention import prefill_xla
    from jaxinfer.model.xla_decode import paged_decode_xla
    H, K, D, bs, dtype = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, a.block_size, jnp.dtype(a.dtype)
    rng = np.random.default_rng(0)
    need_blocks = max([B * -(-c // bs) for B, c in a.decode_shapes] + [T // p * -(-p // bs) for T, _, p in a.prefill_shapes])
    blocks = max(need_blocks + 1, a.pool_tokens // bs)
    cache = jax.random.normal(jax.random.PRNGKey(0), (blocks, bs, K, D), jnp.float32).astype(dtype)   # [P, bs, K, D]
    cases = []
    for B, ctx in a.decode_shapes:
        n = -(-ctx // bs)
        q = jnp.asarray(rng.standard_normal((B, H, D)), dtype)
        lens = jnp.full((B,), ctx, jnp.int32)
        need = 2 * B * ctx * K * D * dtype.itemsize
        for pad in (1, 2):                      # tight table, and a bucket twice as wide (padding -> block 0)
            tables = np.zeros((B, n * pad), np.int32)
            tables[:, :n] = 1 + np.arange(B * n).reshape(B, n)
            for form, chunk in (("chunks", 128), ("chunks", 256), ("chunks", 512), *((f, None) for f in FORMS)):
                fn = (lambda form, chunk: lambda q, k, v, t, s: paged_decode_xla(q, k, v, t, s, form=form,
                                                                                 chunk=chunk))(form, chunk)
                cases.append((f"decode {form}{chunk or ''} B={B} ctx={ctx} width={n * pad * bs}", fn,
                              (q, cache, cache, jnp.asarray(tables), lens), need))
    for T, rows, prompt in a.prefill_shapes:
        n = -(-prompt // bs)
        used = T // prompt
        q = jnp.asarray(rng.standard_normal((T, H, D)), dtype)
        tables = np.zeros((rows, n), np.int32)
        tables[:used] = 1 + np.arange(used * n).reshape(used, n)
        cu = np.minimum(np.arange(rows + 1) * prompt, used * prompt).astype(np.int32)
        lens = np.where(np.arange(rows) < used, prompt, 0).astype(np.int32)
        for tile in (None, 1) if T * n * bs * K * D * 4 <= 2**31 else (None,):      # per token only if small
            fn = (lambda tile: lambda q, k, v, t, c, s: prefill_xla(q, k, v, t, c, s, tile=tile))(tile)
            cases.append((f"prefill tile={tile or 'auto'} T={T} rows={rows} ({used} x {prompt})", fn,
                          (q, cache, cache, jnp.asarray(tables), jnp.asarray(cu), jnp.asarray(lens)),
                          2 * used * prompt * K * D * dtype.itemsize))
    return cases


def attention_reports(a, cfg, platform: str, timed: bool) -> list[dict]:
    from timing import copy_bandwidth, time_loop
    bw = copy_bandwidth(1 << (14 if a.smoke else 30)) if timed else None
    if bw:
        print(f"\ncopy bandwidth in this process: {bw / 1e9:.0f} GB/s")
    rows = []
    for label, fn, args, need in attention_cases(a, cfg):
        ks = kernels(compile_text(fn, *args, platform=platform))
        gathers = [k for k in ks if "gather" in k["ops"]]
        fused_in = sum(1 for k in gathers if {"reduce", "dot"} & set(k["ops"]))
        big = max((k["shape"] for k in gathers), key=_elements, default="-")     # the page copy, if written
        row = dict(case=label, kernels=len(ks), gather_kernels=len(gathers), gather_fused_into_consumer=fused_in,
                   largest_gather_output=big, table=table(ks))
        line = (f"{label}: {len(ks)} kernels, {len(gathers)} with a gather ({fused_in} fused into a reduce/dot; "
                f"largest gather kernel output {big})")
        if timed:
            s = time_loop(lambda q, *rest: fn(q, *rest), *args, est_s=1e-3)
            row.update(seconds=s, needed_gbps=need / s / 1e9)
            line += f"; {s * 1e6:9.1f} us, {need / s / 1e9:7.0f} GB/s of needed K/V ({need / s / bw:.0%} of copy)"
        print(line)
        rows.append(row)
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-0.6b", help="a preset name or checkpoint directory")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--batch", type=int, default=64, help="decode bucket rows")
    ap.add_argument("--context", type=int, default=2048, help="decode block-table width, tokens")
    ap.add_argument("--prefill-tokens", type=int, default=2048)
    ap.add_argument("--rows", type=int, default=256, help="prefill bucket rows")
    ap.add_argument("--prompt", type=int, default=1024, help="prefill block-table width, tokens")
    ap.add_argument("--pool-tokens", type=int, default=800_000, help="KV pool of the timed attention calls "
                    "(the engine's Qwen3-0.6B pool on an H200 holds ~800k tokens)")
    ap.add_argument("--time", action="store_true", help="also time the attention call per shape")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes: checks the script on a CPU")
    ap.add_argument("--decode-only", action="store_true", help="time no prefill attention calls")
    ap.add_argument("--skip-steps", action="store_true", help="only the attention call (no whole steps)")
    ap.add_argument("--hlo-dir", default=None, help="write the steps' optimised HLO text here")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    import jax

    from bench import write_json
    from jaxinfer.hub import model_config_for
    cfg = model_config_for(a.model)[1]
    if a.smoke:
        from jaxinfer.model.presets import ModelConfig
        cfg = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16)
        a.batch, a.context, a.prefill_tokens, a.rows, a.prompt, a.block_size = 8, 64, 64, 8, 16, 4
        a.decode_shapes, a.prefill_shapes, a.pool_tokens = [(8, 64)], [(64, 8, 16)], 4096
    else:
        a.decode_shapes = [(64, 1024), (256, 1024), (256, 2048)]
        a.prefill_shapes = [] if a.decode_only else [(2048, 256, 512), (16384, 256, 512), (16384, 256, 1024)]
    platform = jax.devices()[0].platform
    print(f"{cfg.name}: {cfg.num_hidden_layers} layers, H={cfg.num_attention_heads} K={cfg.num_key_value_heads} "
          f"D={cfg.head_dim}, {a.dtype}, on {jax.devices()[0].device_kind} ({jax.__version__})")
    if a.hlo_dir:
        os.makedirs(a.hlo_dir, exist_ok=True)
    result = dict(model=cfg.name, platform=platform, device=jax.devices()[0].device_kind, jax=jax.__version__)
    if not a.skip_steps:
        result["steps"] = step_reports(a, cfg, platform, a.hlo_dir)
    result["attention"] = attention_reports(a, cfg, platform, a.time)
    write_json(a.json, result)
    return result


if __name__ == "__main__":
    main()
