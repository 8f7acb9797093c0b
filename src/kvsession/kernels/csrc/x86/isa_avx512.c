/* The kernels for x86-64 CPUs with AVX-512 F/BW/VL/DQ and VNNI (Ice Lake, Zen 4 and later): the VNNI products and GEMM, 512-bit attention. setup.py compiles this file with the instruction set's flags. */
#define KERNELS_NAME kernels_avx512
#define KERNELS_ISA "avx512"
#include "../isa.h"
