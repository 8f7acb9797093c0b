#!/usr/bin/env bash
# The NEON kernels checked on an x86-64 Debian or Ubuntu machine, without ARM hardware: installs the AArch64
# cross compiler and qemu's user-mode emulator where they are missing (apt-get, as root or through sudo), then
# runs tests/test_kernels_neon.py, which cross-compiles tests/neon/harness.c with the kernels' AArch64 builds and
# runs it under qemu-aarch64 on a CPU with the dot-product extension and on one without.
#
#   tools/neon_check.sh            the test (about 15 s on two cores, nearly all of it compiling)
#   tools/neon_check.sh -v         other arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
command -v aarch64-linux-gnu-gcc >/dev/null || need+=(gcc-aarch64-linux-gnu libc6-dev-arm64-cross)
command -v qemu-aarch64 >/dev/null || need+=(qemu-user)
if [ ${#need[@]} -gt 0 ]; then
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo=sudo
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}"
fi
PY=${PYTHON:-.venv/bin/python}
exec "$PY" -m pytest -q -m neon tests/test_kernels_neon.py "$@"
