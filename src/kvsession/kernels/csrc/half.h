#pragma once
/* Half-precision conversions for every build: the compiler's _Float16 where it has one (and, to widen, the
 * CPU converts in one instruction), else by the bits (IEEE binary16, round to nearest even, subnormals too). */
#ifndef KVSESSION_HALF_H
#define KVSESSION_HALF_H

#include <stdint.h>
#include <string.h>

static inline float half_to_float(uint16_t h) {
#if defined(__FLT16_MAX__) && (defined(__F16C__) || defined(__AVX512F__))  /* one instruction; else the bits */
    _Float16 x;
    memcpy(&x, &h, 2);
    return (float)x;
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) bits = sign | 0x7f800000 | (man << 13);
    else if (exp) bits = sign | ((exp + 112) << 23) | (man << 13);
    else if (!man) bits = sign;
    else { /* subnormal: normalize */
        exp = 113;
        while (!(man & 0x400)) { man <<= 1; exp--; }
        bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

static inline uint16_t float_to_half(float f) {
#ifdef __FLT16_MAX__
    const _Float16 x = (_Float16)f;
    uint16_t h;
    memcpy(&h, &x, 2);
    return h;
#else
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint32_t sign = (u >> 16) & 0x8000, a = u & 0x7fffffff;
    if (a > 0x7f800000) return (uint16_t)(sign | 0x7e00);                  /* NaN */
    if (a >= 0x477ff000) return (uint16_t)(sign | 0x7c00);                 /* rounds past 65504: infinity */
    if (a < 0x38800000) {                                                   /* below 2^-14: subnormal or zero */
        if (a < 0x33000000) return (uint16_t)sign;                         /* under half the smallest: zero */
        const uint32_t man = (a & 0x7fffff) | 0x800000, shift = 126 - (a >> 23);  /* 14 .. 24 */
        uint32_t h = man >> shift;
        const uint32_t rest = man & ((1u << shift) - 1), halfway = 1u << (shift - 1);
        if (rest > halfway || (rest == halfway && (h & 1))) h++;
        return (uint16_t)(sign | h);
    }
    uint32_t h = ((a >> 13) - (112 << 10));
    const uint32_t rest = a & 0x1fff;
    if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) h++;
    return (uint16_t)(sign | h);
#endif
}

#endif
