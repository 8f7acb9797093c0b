/* The kernels for every CPU: portable C, float32 products (no int8 ones); what the compiler makes of it. setup.py compiles this file with the instruction set's flags. */
#define KERNELS_NAME kernels_generic
#define KERNELS_ISA "generic"
#include "../isa.h"
