"""Where the GPU time went: a summary of a `jax.profiler.trace` directory, without TensorBoard.

    python scripts/trace_summary.py TRACE_DIR [--top 25]

Reads the newest *.xplane.pb under TRACE_DIR with jaxlib's ProfileData and prints, for the device plane:
the span from the first kernel to the last, the time some kernel was running (busy; the rest are host
gaps), and the kernels that took the most time, grouped by name. Then, per device, its busy time split into
collectives (NCCL kernels: their time includes waiting for the other devices), GEMMs, attention and the rest,
and its idle time: where a tensor-parallel step's time goes. On a machine without a GPU it summarises the
host's XLA threads instead, which is only good for testing this script.
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import os
import re
from collections import defaultdict


def _newest_xplane(trace_dir: str) -> str:
    found = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
    if not found:
        raise FileNotFoundError(f"no *.xplane.pb under {trace_dir!r}")
    return found[-1]


def _kernel_events(data, by_plane: bool = False):
    """(name, start_ns, end_ns) of every kernel on the GPU streams (or XLA CPU threads when no GPU); by_plane:
    a dict plane name -> its events."""
    planes = list(data.planes)
    gpu = [p for p in planes if p.name.startswith("/device:GPU")]
    out = {}
    for p in gpu or [p for p in planes if p.name == "/host:CPU"]:
        events = out.setdefault(p.name, [])
        for line in p.lines:
            wanted = line.name.startswith("Stream") if gpu else "XLA" in line.name and "Client" in line.name
            if not wanted:
                continue
            for e in line.events:
                if e.duration_ns > 0:
                    events.append((e.name, e.start_ns, e.start_ns + e.duration_ns))
    return out if by_plane else [e for events in out.values() for e in events]


CATEGORIES = (("collective", re.compile(r"nccl|all[-_]?reduce|all[-_]?gather|reduce[-_]?scatter|collective", re.I)),
              ("gemm", re.compile(r"gemm|cublas|cutlass|xmma|nvjet|matmul|\bdot", re.I)),
              ("attention", re.compile(r"attention|paged|flash|prefill|decode", re.I)))


def category(name: str) -> str:
    """collective / gemm / attention / other, from a kernel's name."""
    return next((c for c, pattern in CATEGORIES if pattern.search(name)), "other")


def _busy_ns(events) -> int:
    """Time some event of `events` (name, start, end) was running: the union of their intervals."""
    busy, cur_s, cur_e = 0, None, None
    for _, s, e in sorted(events, key=lambda e: e[1]):
        if cur_e is None or s > cur_e:
            busy += 0 if cur_e is None else cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return busy + (0 if cur_e is None else cur_e - cur_s)


def per_device(planes: dict, steps: int | None = None) -> list[dict]:
    """For each device plane: span, busy and idle ms, and the ms of each kernel category (per step when
    steps is given). Kernels overlapping on one device count once in busy, fully in their category."""
    per, rows = steps or 1, []
    for name, events in sorted(planes.items()):
        if not events:
            continue
        span = max(e for _, _, e in events) - min(s for _, s, _ in events)
        busy = _busy_ns(events)
        cats = {c: 0.0 for c, _ in CATEGORIES} | {"other": 0.0}
        for n, s, e in events:
            cats[category(n)] += (e - s) / 1e6 / per
        rows.append(dict(device=name, span_ms=span / 1e6 / per, busy_ms=busy / 1e6 / per,
                         idle_ms=(span - busy) / 1e6 / per, **{f"{c}_ms": v for c, v in cats.items()}))
    return rows


def _group(name: str) -> str:
    """Fold numbered copies of one fusion (fusion.12, loop_gather_fusion_3) into one row."""
    return re.sub(r"([._]\d+)+$", "", name)


def summarize(trace_dir: str, top: int = 25, steps: int | None = None) -> dict:
    from jax._src.profiler import ProfileData
    planes = _kernel_events(ProfileData.from_file(_newest_xplane(trace_dir)), by_plane=True)
    events = [e for evs in planes.values() for e in evs]
    if not events:
        return dict(span_ms=0.0, busy_ms=0.0, kernels=0, top=[], devices=[])
    events.sort(key=lambda e: e[1])
    busy = _busy_ns(events)                          # union of intervals: overlapping streams count once
    span = max(e for _, _, e in events) - events[0][1]
    total, count = defaultdict(float), defaultdict(int)
    for name, s, e in events:
        total[_group(name)] += e - s
        count[_group(name)] += 1
    rows = sorted(total.items(), key=lambda kv: -kv[1])[:top]
    per = steps or 1
    return dict(span_ms=span / 1e6, busy_ms=busy / 1e6, kernels=len(events), steps=steps,
                top=[dict(name=n, ms=t / 1e6 / per, calls=count[n] / per, share=t / max(busy, 1)) for n, t in rows],
                devices=per_device(planes, steps))


def print_summary(s: dict) -> None:
    per = f" per step (over {s['steps']} steps)" if s.get("steps") else ""
    print(f"trace: {s['kernels']} kernels; span {s['span_ms']:.1f} ms, GPU busy {s['busy_ms']:.1f} ms "
          f"({100 * s['busy_ms'] / max(s['span_ms'], 1e-9):.1f}%); the rest are gaps between kernels")
    print(f"{'ms' + per:>10} | {'calls':>6} | {'share':>6} | kernel")
    for r in s["top"]:
        print(f"{r['ms']:10.3f} | {r['calls']:6.1f} | {100 * r['share']:5.1f}% | {r['name'][:100]}")
    if s.get("devices"):
        cols = ("span", "busy", "idle", "collective", "gemm", "attention", "other")
        print(f"per device, ms{per}: " + " | ".join(cols))
        for d in s["devices"]:
            print(f"  {d['device']}: " + " | ".join(f"{d[c + '_ms']:.3f}" for c in cols))


@contextlib.contextmanager
def profiled(trace_dir: str | None):
    """jax.profiler.trace around the block when a directory is given."""
    import jax
    if not trace_dir:
        yield
        return
    with jax.profiler.trace(trace_dir):
        yield


def summarize_profile(trace_dir: str, steps: int) -> dict:
    """Summarise and print a trace of `steps` engine steps (bench.py, bench_step.py --profile)."""
    s = summarize(trace_dir, steps=steps)
    print_summary(s)
    return s


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace_dir")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--steps", type=int, default=None, help="divide times by this many steps")
    a = ap.parse_args(argv)
    s = summarize(a.trace_dir, a.top, a.steps)
    print_summary(s)
    return s


if __name__ == "__main__":
    main()
