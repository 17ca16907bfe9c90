"""The fp8 engine decode kernel (paged_attention_qkv) on V pages in pairs against plain fp8 V pages, at several tiles
and the shapes W runs (docs/fp8_kv_cache.md, "V pages in pairs"). TB/s of the fp8 bytes read. H200: ~1.5 min.

    python scripts/probe_fp8_tiles.py OUT.json [--smoke]      # --smoke: CPU interpret mode, one tiny shape
"""
import itertools
import json
import os
import sys

if sys.argv[1:2] in (["-h"], ["--help"]) or len(sys.argv) < 2:   # the docstring is the usage
    sys.exit(print(__doc__) if sys.argv[1:2] in (["-h"], ["--help"]) else __doc__)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_kernels as bk  # noqa: E402

TILES = [(64, 2, 3), (128, 2, 2), (128, 4, 2), (128, 2, 3), (64, 4, 3), (128, 4, 3)]   # the default first
SHAPES = [(256, 1024), (128, 1024), (64, 1024), (32, 2048), (64, 4096), (8, 1024)]


def main(path: str, smoke: bool):
    rows = []
    shapes, tiles = ([(2, 40)], [(16, 2, 3)]) if smoke else (SHAPES, TILES)
    for (b, ctx), (n, w, s) in itertools.product(shapes, tiles):
        opts = dict(block_n=n, num_warps=w, num_stages=s)
        impls = ("fp8_qkv", "fp8_qkv_plain") if (n, w, s) == tiles[0] else ("fp8_qkv",)
        r = bk.bench_decode(b, ctx, {"copy_tbps": 4.3}, opts, smoke, impls=impls)
        rows.append(dict(batch=b, ctx=ctx, **opts, pairs=r.get("fp8_qkv_tbps"), plain=r.get("fp8_qkv_plain_tbps"),
                         pairs_us=(r.get("fp8_qkv_s") or 0) * 1e6))
        print(rows[-1], flush=True)
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], "--smoke" in sys.argv)
