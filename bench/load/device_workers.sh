#!/usr/bin/env bash
# bench.load.workers on a many-core machine with Python 3.12 and no package index (the project's
# GPU device machine, its CPUs only). Run from the repository root:
#   OUT=/some/dir bash bench/load/device_workers.sh
# It needs .whl/: cp312 manylinux wheels of the runtime packages that machine lacks, fetched on a
# machine with PyPI (`pip download --no-deps --only-binary=:all: --python-version 3.12
# --platform manylinux_2_28_x86_64 ... -d .whl` for fastapi, starlette, pydantic(-core,
# -settings), python-dotenv, uvicorn, httptools, msgspec, pyzmq, typing-inspection,
# annotated-types/-doc, aiohttp and its dependencies, uvloop, prometheus_client, anyio, h11,
# click, typing_extensions, sniffio, idna, PyYAML, at the versions of the dev environment).
# Installs the wheels the device lacks into /tmp/site (no network), checks the imports, then
# measures N = 1,2,4,8,16 router processes x {reuseport, shared} x 3 repeats (27 runs of <= 5 s
# measured + ~4 s start/stop each: ~5 min; `timeout` caps the bench at 400 s, and the JSON is
# rewritten after every N, so a cut-short run keeps what it measured).
# Overrides for a shorter try: WORKERS_LIST=1,2 REPEATS=1 DURATION=2.
set -uo pipefail
OUT=${OUT:?set OUT to the output directory}
mkdir -p "$OUT"
python3 --version; nproc; python3 -c 'import os; print("affinity:", len(os.sched_getaffinity(0)))'
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 2
export PYTHONPATH=/tmp/site:.
python3 -c 'import router.app, testkit.fake_engine, bench.load.workers' || exit 3
python3 -m router --help | grep -q -- '--workers' || { echo "router has no --workers"; exit 4; }
timeout -k 30 400 python3 -m bench.load.workers \
    --workers-list "${WORKERS_LIST:-1,2,4,8,16}" --repeats "${REPEATS:-3}" \
    --duration "${DURATION:-5}" --requests 400000 \
    --json "$OUT/workers.json" --log-dir "$OUT/logs" 2>&1 | tee "$OUT/workers.log"
code=${PIPESTATUS[0]}
echo "bench.load.workers exit status: $code" | tee -a "$OUT/workers.log"
exit "$code"
