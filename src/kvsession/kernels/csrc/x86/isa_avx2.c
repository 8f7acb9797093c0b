/* The kernels for x86-64 CPUs with AVX2, FMA and F16C (Haswell, Zen and later): the AVX2 int8 products and GEMM. setup.py compiles this file with the instruction set's flags. */
#define KERNELS_NAME kernels_avx2
#define KERNELS_ISA "avx2"
#include "../isa.h"
