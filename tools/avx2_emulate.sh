#!/usr/bin/env bash
# An AVX2-only CPU (the Zen 3 machine kind: no AVX-512, no bfloat16 arithmetic) emulated on an AVX-512 one, to
# measure its paths without it: the kernels' AVX2 build (KVSESSION_ISA=avx2), float32 slabs, PyTorch held to
# AVX2. The kernel tests need none of this (they run every build the CPU runs); for speed, compare ratios against
# llama.cpp built for AVX2 too (BENCHMARKS.md, "AMD EPYC Zen 3", "Kernels").
#
#   tools/avx2_emulate.sh --peer /tmp/peer-avx2     llama-cpp-python 0.3.36 without AVX-512 into that venv (~8 min)
#   tools/avx2_emulate.sh bench -m qwen2.5-coder-1.5b --peer-python /tmp/peer-avx2/bin/python
#   tools/avx2_emulate.sh pytest -q tests/test_gemma.py
#
# Any other arguments go to `kvsession`. Needs `make setup` first. Subprocesses a test starts use the AVX2
# kernels too, but pick their slabs' dtype from the CPU (bfloat16 here).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--peer" ]; then
    peer="${2:?usage: tools/avx2_emulate.sh --peer DIR}"
    python3 -m venv "$peer"
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
-DGGML_AVX512=OFF" "$peer/bin/pip" install --no-cache-dir llama-cpp-python==0.3.36
    exit
fi

PY=.venv/bin/python
PKG=$(mktemp -d)
trap 'rm -rf "$PKG"' EXIT
cat > "$PKG/avx2_float32.py" <<'PLUGIN'
"""float32 slabs, as on a CPU without bfloat16 arithmetic (imported first; a pytest plugin too)"""
import torch

from kvsession import kernels

kernels.GEMM_DTYPE = torch.float32
PLUGIN
export PYTHONPATH="$PKG" KVSESSION_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
    ONEDNN_MAX_CPU_ISA=AVX2
status=0
if [ "${1:-}" = pytest ]; then
    shift
    $PY -m pytest -p avx2_float32 "$@" || status=$?
else
    $PY -c 'import sys, avx2_float32; from kvsession.cli.main import main; sys.exit(main(sys.argv[1:]))' "$@" || status=$?
fi
exit $status
