"""The compiled part of kvsession; everything else is declared in pyproject.toml.

The CPU kernels (src/kvsession/kernels/csrc, wrapped by kernels/__init__.py): GGUF blocks multiplied where they lie, and
decode attention over the cache's rows. They are compiled once per instruction set, each build with its
own flags (ISA_FLAGS: none beyond the baseline, AVX2, AVX-512 with VNNI, and with BF16; on AArch64 NEON, and
NEON with the dot-product extension), into one extension that picks the best build the CPU runs when it loads
(csrc/builds.c, module.c): a build made on one machine runs on any other of its architecture, and never with
`-march=native`. Elsewhere only the portable build is made. OpenMP where the compiler
has it, whose runtime is the one PyTorch has already loaded (the same libgomp.so.1), so the two share one
pool of threads.

The extension is optional: without a C compiler `pip install` still succeeds and the engine runs on its
PyTorch path, saying once that it is slower and why (kernels/__init__.py).
"""
import os
import platform
import tempfile

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

CSRC = "src/kvsession/kernels/csrc"
ISA_DIR = {"generic": "generic", "avx2": "x86", "avx512": "x86", "avx512bf16": "x86", "neon": "arm", "neon_dotprod": "arm"}
X86 = platform.machine().lower() in ("x86_64", "amd64")
ARM64 = platform.machine().lower() in ("aarch64", "arm64")
AVX512 = ["-mavx2", "-mfma", "-mf16c", "-mbmi2", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni"]
ISA_FLAGS = {
    "generic": [],
    **({"avx2": ["-mavx2", "-mfma", "-mf16c", "-mbmi2"],
        "avx512": AVX512,
        "avx512bf16": AVX512 + ["-mavx512bf16"]} if X86 else {}),
    **({"neon": [],
        "neon_dotprod": ["-march=armv8.2-a+dotprod"]} if ARM64 else {}),
}
COMMON = ["-O3", "-Wall", "-fno-strict-aliasing"]


class BuildKernels(build_ext):
    """Each instruction set's build compiled with its own flags, then linked with the module."""

    def build_extension(self, ext: Extension) -> None:
        openmp = ["-fopenmp"] if self._accepts("-fopenmp") else []
        objects = []
        for isa, flags in ISA_FLAGS.items():
            objects += self.compiler.compile([f"{CSRC}/{ISA_DIR[isa]}/isa_{isa}.c"], output_dir=self.build_temp,
                                             extra_postargs=COMMON + openmp + flags, depends=ext.depends)
        ext.extra_objects = objects
        ext.extra_compile_args = COMMON + openmp
        ext.extra_link_args = openmp
        super().build_extension(ext)

    def _accepts(self, flag: str) -> bool:
        """Whether the compiler takes the flag (Apple's clang has no -fopenmp)."""
        with tempfile.TemporaryDirectory() as d:
            src = os.path.join(d, "probe.c")
            with open(src, "w") as f:
                f.write("int main(void) { return 0; }\n")
            try:
                self.compiler.compile([src], output_dir=d, extra_postargs=[flag])
            except Exception:
                return False
        return True


setup(
    ext_modules=[Extension(
        "kvsession.kernels._kernels",
        sources=[f"{CSRC}/module.c", f"{CSRC}/builds.c"],
        depends=sorted(os.path.join(d, f) for d, _, files in os.walk(CSRC) for f in files if f.endswith((".h", ".c"))),
        optional=True,
    )],
    cmdclass={"build_ext": BuildKernels},
)
