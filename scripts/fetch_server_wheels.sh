#!/usr/bin/env bash
# Wheels the server needs on the GPU machine (Python 3.12, x86-64, no package index there), into .whl/.
# The machine already has httpx, aiohttp, uvloop, msgpack, anyio, h11, click, idna, typing-extensions, certifi (see
# the device notes' package list); we still carry the versions tested here for everything the server
# imports, so the run does not depend on what the image happens to hold. --no-deps: the list is the closure
# (checked below against each wheel's Requires-Dist).
#
#   bash scripts/fetch_server_wheels.sh            # here, where pip reaches the index
#   # there, at the start of the command:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#       .whl/*.whl && export PYTHONPATH=/tmp/site:.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=(
  fastapi==0.165.0 starlette==1.10.0 annotated-doc==0.0.7 opentelemetry-api==1.45.2
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  typing-extensions==4.16.0
  uvicorn==0.54.0 h11==0.16.0 click==8.5.1 httptools==0.9.0
  anyio==4.16.0 idna==3.20 sniffio==1.3.1
  httpx==0.28.1 httpcore==1.0.9                    # bench_serve's client (h11 above: httpcore's pin)
  pyzmq==27.3.0 msgpack==1.2.4
  prometheus-client==0.26.0 fastapi-offline==1.7.7 # /metrics; /docs without a CDN
  outlines-core==0.2.14                            # structured outputs json / regex
)
mkdir -p .whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
for w in "${WHEELS[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$w"
done
# every requirement (extras aside) of every wheel must be in the list or already on the GPU machine
for f in .whl/*.whl; do
  unzip -p "$f" '*.dist-info/METADATA' | grep '^Requires-Dist' | grep -v 'extra ==' | sed "s|^|$(basename "$f"): |" || true
done
ls -la .whl | tail -n +2
du -sh .whl
