/* The kernels for AArch64 CPUs with the dot-product extension (ARMv8.2-A's, in Neoverse N1, Cortex-A76, Apple
 * M1 and later): the neon build's int8 products, each 16 of them one sdot. setup.py compiles this file with the
 * instruction set's flags. */
#define KERNELS_NAME kernels_neon_dotprod
#define KERNELS_ISA "neon_dotprod"
#define NEON_DOTS
#include "../isa.h"
