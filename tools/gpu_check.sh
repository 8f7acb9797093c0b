#!/usr/bin/env bash
# The device checks in one call on a lent GPU machine: the GPU tests, then tools/gpu_bench.py.
#
#   tools/gpu_check.sh --prepare     here, once a session: the wheels the device machine lacks, into .whl/
#                                    (git ignores it through .git/info/exclude)
#   device run: command "tools/gpu_check.sh", carry [".whl"], timeout_s 570
#
# What comes back in $OUT: gpu.txt (GPU, driver, torch), build.log, tests.log, bench.log, gpu_bench.json and
# gpu_bench.md (the tables BENCHMARKS.md quotes). Sized for about 6 minutes on an H200: the tests ~1, the
# 1.5B-shaped model written ~1, the bench ~4; each step has its own timeout, so a hang costs its step only.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=(gguf==0.19.0)  # pure Python; everything else kvsession imports is in the device image

if [ "${1:-}" = "--prepare" ]; then
    mkdir -p .git/info
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    exec python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl "${WHEELS[@]}"
fi

OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
ls .whl/*.whl > /dev/null 2>&1 || { echo "no .whl/: run tools/gpu_check.sh --prepare here and carry .whl"; exit 2; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())"
} > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
# the CPU kernels: not used on a GPU, built where a compiler is, so that the CPU halves of the tests run too
python3 setup.py -q build_ext --inplace > "$OUT/build.log" 2>&1 || echo "C kernels not built (see build.log)"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_transfer.py tests/test_graph.py tests/test_kv.py \
    2>&1 | tee "$OUT/tests.log"
timeout 390 python3 tools/gpu_bench.py --out "$OUT" 2>&1 | tee "$OUT/bench.log"
