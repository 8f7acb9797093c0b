/* The kernels for every AArch64 CPU: the NEON int8 products, their int32 lanes made by widening multiplies
 * (ARMv8.0). NEON is part of the architecture, so the portable build is compiled with it too; this one is the
 * build that uses it by hand (NEON_DOTS, dots.h). setup.py compiles this file with the instruction set's flags
 * (none beyond the baseline). */
#define KERNELS_NAME kernels_neon
#define KERNELS_ISA "neon"
#define NEON_DOTS
#include "../isa.h"
