"""scripts/bench.py with the pallas backend's fp8 V pages stored plain (float8_e4m3fn [P, bs, K, D]), as before V
pages came in pairs (model/attention.py, v_pages): the other side of that A/B (docs/fp8_kv_cache.md).

    PYTHONPATH=. python scripts/bench_fp8_plain.py --kv-cache-dtype fp8 [bench.py's other arguments]
"""
import os
import runpy
import sys

import jaxinfer.engine.runner as runner

if __name__ == "__main__":
    runner.v_pages = lambda backend, shape, kv_dtype: (tuple(shape), kv_dtype)
    here = os.path.dirname(os.path.abspath(__file__))
    sys.argv = [os.path.join(here, "bench.py")] + sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
