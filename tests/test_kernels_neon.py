"""The NEON kernels without ARM hardware: tests/neon/harness.c cross-compiled with the kernels' AArch64 builds
(aarch64-linux-gnu-gcc -static, each build with setup.py's flags) and run under qemu-aarch64, on a CPU with the
dot-product extension (qemu's `max`) and on one without (Cortex-A53, ARMv8.0). The harness holds every int8
product of every NEON build the CPU runs (as builds.c decides it, the check module.c makes) to the generic
build's dequantization: integer sums exactly, random blocks to 1e-5, a token's outputs independent of its
neighbours, and the two builds' outputs equal; and flash attention in every build the CPU runs against float64
attention (the harness's cases). tools/neon_check.sh installs the two tools (Debian's
gcc-aarch64-linux-gnu and qemu-user) and runs this.
"""
from __future__ import annotations

import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "src" / "kvsession" / "kernels" / "csrc"
CC, QEMU = "aarch64-linux-gnu-gcc", "qemu-aarch64"
# setup.py's COMMON flags with OpenMP, and its ISA_FLAGS on AArch64
COMMON = ["-O3", "-Wall", "-fno-strict-aliasing", "-fopenmp"]
SOURCES = {CSRC / "generic" / "isa_generic.c": [], CSRC / "arm" / "isa_neon.c": [],
           CSRC / "arm" / "isa_neon_dotprod.c": ["-march=armv8.2-a+dotprod"],
           CSRC / "builds.c": [],
           # -O2: Debian's GCC 12 fails at -O3 on the harness's float64 reductions (an internal compiler error)
           ROOT / "tests" / "neon" / "harness.c": ["-O2", f"-I{CSRC}"]}
TYPES = "q4_k q6_k q8_0 q5_0 q4_1 iq4_nl iq4_xs mxfp4"  # the harness's, most used first

pytestmark = [
    pytest.mark.neon,
    pytest.mark.skipif(not (shutil.which(CC) and shutil.which(QEMU)),
                       reason=f"needs {CC} and {QEMU} (tools/neon_check.sh installs them: gcc-aarch64-linux-gnu, qemu-user)"),
]


@pytest.fixture(scope="module")
def harness(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("neon")

    def compile_one(src: Path) -> Path:
        obj = out / (src.stem + ".o")
        r = subprocess.run([CC, *COMMON, *SOURCES[src], "-c", str(src), "-o", str(obj)], capture_output=True,
                           text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-4000:]
        return obj

    with ThreadPoolExecutor(len(SOURCES)) as pool:
        objects = list(pool.map(compile_one, SOURCES))
    exe = out / "harness"
    r = subprocess.run([CC, "-static", "-fopenmp", *map(str, objects), "-lm", "-o", str(exe)], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    return exe


def run(harness: Path, cpu: str) -> list[str]:
    r = subprocess.run([QEMU, "-cpu", cpu, str(harness)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert r.stdout.splitlines()[-1].endswith(" 0 failures")
    return r.stdout.splitlines()


def test_both_neon_builds_on_a_cpu_with_dotprod(harness):
    lines = run(harness, "max")
    assert lines[0] == "builds this CPU runs: neon_dotprod neon generic"
    assert f"neon_dotprod: {TYPES}" in lines
    assert f"neon: {TYPES}" in lines
    assert "attention: neon_dotprod neon generic" in lines


def test_the_neon_build_alone_on_a_cpu_without_dotprod(harness):
    # builds.c leaves the dot-product build out, and the neon build has no instruction an ARMv8.0 CPU lacks
    lines = run(harness, "cortex-a53")
    assert lines[0] == "builds this CPU runs: neon generic"
    assert f"neon: {TYPES}" in lines
    assert "attention: neon generic" in lines
