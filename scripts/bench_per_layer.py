"""scripts/bench.py with the KV cache as a (k, v) pair per layer and the layers unrolled, as every backend ran before
the stacked cache (model/attention.py, STACKED_BACKENDS): the other side of that A/B (docs/performance.md).

    PYTHONPATH=. python scripts/bench_per_layer.py [bench.py's arguments]
"""
import os
import runpy
import sys

import jaxinfer.model.attention as attention

if __name__ == "__main__":
    attention.STACKED_BACKENDS = ()
    here = os.path.dirname(os.path.abspath(__file__))
    sys.argv = [os.path.join(here, "bench.py")] + sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
