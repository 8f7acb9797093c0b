"""The compiled part of kvsession; everything else is declared in pyproject.toml.

The CPU kernels (src/kvsession/_kernels.c, wrapped by kernels.py): GGUF blocks
multiplied where they lie, and decode attention over the cache's rows. They
are compiled for the machine they are installed on (-march=native: AVX-512
where it has it), with OpenMP, whose runtime is the one PyTorch has already
loaded (the same libgomp.so.1), so the two share one pool of threads.
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "kvsession._kernels",
    sources=["src/kvsession/_kernels.c"],
    extra_compile_args=["-O3", "-march=native", "-fopenmp", "-Wall"],
    extra_link_args=["-fopenmp"],
)])
