"""Condense Nsight Compute raw CSV exports (`ncu -i FILE.ncu-rep --csv --page raw > FILE.csv`) to the numbers the
kernel notes quote: time, DRAM and SM throughput, occupancy, issue rate, tensor-pipe use, L2 hit rate, launch
shape, and the warp stall reasons (cycles per issued instruction, largest first).

    python scripts/ncu_summary.py A.csv B.csv ... [--min-us 2] > summary.json

One entry per kernel launch of at least --min-us microseconds (the probes' small XLA ops are left out).
"""
from __future__ import annotations

import argparse
import csv
import json
import sys

KEEP = {  # raw metric -> short name
    "gpu__time_duration.sum": "us",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram_pct",
    "dram__bytes_read.sum": "dram_read_bytes",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "sm_pct",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "occupancy_pct",
    "smsp__issue_active.avg.pct_of_peak_sustained_active": "issue_active_pct",
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active": "tensor_pipe_pct",
    "sm__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_active": "gmma_pct",
    "lts__t_sector_hit_rate.pct": "l2_hit_pct",
    "launch__grid_size": "grid",
    "launch__block_size": "block",
    "launch__registers_per_thread": "regs",
    "launch__occupancy_limit_shared_mem": "blocks_per_sm_by_smem",
    "smsp__inst_executed.sum": "instructions",
}
STALL = "smsp__average_warps_issue_stalled_"


def number(text: str):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def rows_of(path: str):
    with open(path, newline="") as f:
        lines = [ln for ln in f if ln.startswith('"')]       # skip ncu's ==PROF== lines and the program's output
    table = list(csv.reader(lines))
    if len(table) < 3:
        return
    header, units = table[0], table[1]
    for raw in table[2:]:
        row = dict(zip(header, raw))
        scale = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3}.get(units[header.index("gpu__time_duration.sum")], 1.0) \
            if "gpu__time_duration.sum" in header else 1.0
        out = {"file": path, "kernel": row.get("Kernel Name", "")[:120]}
        for metric, short in KEEP.items():
            if metric in row:
                val = number(row[metric])
                out[short] = val * scale if short == "us" and val is not None else val
        for metric in row:           # the DRAM columns, whatever this ncu version names them
            if metric.startswith(("dram__", "gpu__dram")) and "throughput" in metric and number(row[metric]) is not None:
                out.setdefault(metric, number(row[metric]))
        stalls = {m[len(STALL):].replace("_per_issue_active.ratio", ""): number(v) for m, v in row.items()
                  if m.startswith(STALL) and m.endswith("_per_issue_active.ratio") and number(v)}
        out["stalls"] = dict(sorted(stalls.items(), key=lambda kv: -kv[1])[:8])
        yield out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", nargs="+")
    ap.add_argument("--min-us", type=float, default=2.0)
    a = ap.parse_args()
    kept = [r for p in a.csv for r in rows_of(p) if (r.get("us") or 0) >= a.min_us]
    json.dump(kept, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
