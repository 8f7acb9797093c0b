/* The kernels for x86-64 CPUs with AVX-512 F/BW/VL/DQ, VNNI and BF16 (Zen 4, Sapphire Rapids and later): the
 * avx512 build, whose bfloat16 slabs are rounded by the CPU's own instruction. setup.py compiles this file with
 * the instruction set's flags. */
#define KERNELS_NAME kernels_avx512bf16
#define KERNELS_ISA "avx512bf16"
#include "../isa.h"
