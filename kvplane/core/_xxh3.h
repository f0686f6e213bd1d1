/* XXH3-64 with the default secret and seed 0: the hash block keys are made of.

   Written here from xxHash's published specification (doc/xxhash_spec.md, "XXH3
   Algorithm Description"), so that building kvplane needs a C compiler and Python's
   headers and nothing else: no system xxHash, no download. It is the portable scalar
   form; the block-key chain hashes 8 + 4 * block_size bytes a call (72 at the usual
   16 tokens), where the medium-input path, the same in every implementation, is what
   runs. tests/core/test_xxh3.py holds it to xxHash's published test vectors and to
   the xxhash package at every length up to several blocks. Little-endian hosts only
   (the chain refuses to build elsewhere). */

#ifndef KVPLANE_XXH3_H
#define KVPLANE_XXH3_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define KV_PRIME32_1 0x9E3779B1U
#define KV_PRIME32_2 0x85EBCA77U
#define KV_PRIME32_3 0xC2B2AE3DU
#define KV_PRIME64_1 0x9E3779B185EBCA87ULL
#define KV_PRIME64_2 0xC2B2AE3D27D4EB4FULL
#define KV_PRIME64_3 0x165667B19E3779F9ULL
#define KV_PRIME64_4 0x85EBCA77C2B2AE63ULL
#define KV_PRIME64_5 0x27D4EB2F165667C5ULL
#define KV_PRIME_MX1 0x165667919E3779F9ULL
#define KV_PRIME_MX2 0x9FB21C651E98DF25ULL

#define KV_SECRET_SIZE 192
#define KV_STRIPE 64
#define KV_STRIPES_PER_BLOCK ((KV_SECRET_SIZE - KV_STRIPE) / 8)
#define KV_BLOCK (KV_STRIPE * KV_STRIPES_PER_BLOCK)

/* The specification's default secret. */
static const uint8_t kv_xxh3_secret[KV_SECRET_SIZE] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

static inline uint64_t kv_read64(const uint8_t *p) {
    uint64_t value;
    memcpy(&value, p, 8);
    return value;
}

static inline uint32_t kv_read32(const uint8_t *p) {
    uint32_t value;
    memcpy(&value, p, 4);
    return value;
}

static inline uint64_t kv_rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static inline uint64_t kv_bswap64(uint64_t x) {
    x = ((x & 0x00000000FFFFFFFFULL) << 32) | (x >> 32);
    x = ((x & 0x0000FFFF0000FFFFULL) << 16) | ((x >> 16) & 0x0000FFFF0000FFFFULL);
    return ((x & 0x00FF00FF00FF00FFULL) << 8) | ((x >> 8) & 0x00FF00FF00FF00FFULL);
}

/* The 128-bit product of a and b, its halves xor-ed. */
static inline uint64_t kv_mul128_fold64(uint64_t a, uint64_t b) {
#if defined(__SIZEOF_INT128__)
    unsigned __int128 product = (unsigned __int128)a * b;
    return (uint64_t)product ^ (uint64_t)(product >> 64);
#else /* four 32x32 products, for compilers without a 128-bit integer */
    uint64_t lo_lo = (a & 0xFFFFFFFFULL) * (b & 0xFFFFFFFFULL);
    uint64_t hi_lo = (a >> 32) * (b & 0xFFFFFFFFULL);
    uint64_t lo_hi = (a & 0xFFFFFFFFULL) * (b >> 32);
    uint64_t hi_hi = (a >> 32) * (b >> 32);
    uint64_t cross = (lo_lo >> 32) + (hi_lo & 0xFFFFFFFFULL) + lo_hi;
    uint64_t upper = (hi_lo >> 32) + (cross >> 32) + hi_hi;
    uint64_t lower = (cross << 32) | (lo_lo & 0xFFFFFFFFULL);
    return lower ^ upper;
#endif
}

static inline uint64_t kv_avalanche(uint64_t x) {
    x ^= x >> 37;
    x *= KV_PRIME_MX1;
    return x ^ (x >> 32);
}

static inline uint64_t kv_avalanche_xxh64(uint64_t x) {
    x ^= x >> 33;
    x *= KV_PRIME64_2;
    x ^= x >> 29;
    x *= KV_PRIME64_3;
    return x ^ (x >> 32);
}

static inline uint64_t kv_mix16(const uint8_t *data, const uint8_t *secret) {
    return kv_mul128_fold64(kv_read64(data) ^ kv_read64(secret),
                            kv_read64(data + 8) ^ kv_read64(secret + 8));
}

static uint64_t kv_xxh3_0to16(const uint8_t *in, size_t len) {
    const uint8_t *s = kv_xxh3_secret;
    if (len > 8) {
        uint64_t low = (kv_read64(s + 24) ^ kv_read64(s + 32)) ^ kv_read64(in);
        uint64_t high = (kv_read64(s + 40) ^ kv_read64(s + 48)) ^ kv_read64(in + len - 8);
        return kv_avalanche(len + kv_bswap64(low) + high + kv_mul128_fold64(low, high));
    }
    if (len >= 4) {
        uint64_t combined = (uint64_t)kv_read32(in + len - 4) | ((uint64_t)kv_read32(in) << 32);
        uint64_t value = (kv_read64(s + 8) ^ kv_read64(s + 16)) ^ combined;
        value ^= kv_rotl64(value, 49) ^ kv_rotl64(value, 24);
        value *= KV_PRIME_MX2;
        value ^= (value >> 35) + len;
        value *= KV_PRIME_MX2;
        return value ^ (value >> 28);
    }
    if (len > 0) {
        uint32_t combined = (uint32_t)in[len - 1] | ((uint32_t)len << 8) |
                            ((uint32_t)in[0] << 16) | ((uint32_t)in[len >> 1] << 24);
        return kv_avalanche_xxh64((uint64_t)(kv_read32(s) ^ kv_read32(s + 4)) ^ combined);
    }
    return kv_avalanche_xxh64(kv_read64(s + 56) ^ kv_read64(s + 64));
}

static uint64_t kv_xxh3_17to128(const uint8_t *in, size_t len) {
    const uint8_t *s = kv_xxh3_secret;
    uint64_t acc = len * KV_PRIME64_1;
    /* Chunks from both ends, paired: the i-th from the start and the i-th from the end. */
    size_t rounds = ((len - 1) >> 5) + 1;
    for (size_t i = rounds; i-- > 0;) {
        acc += kv_mix16(in + i * 16, s + i * 32);
        acc += kv_mix16(in + len - i * 16 - 16, s + i * 32 + 16);
    }
    return kv_avalanche(acc);
}

static uint64_t kv_xxh3_129to240(const uint8_t *in, size_t len) {
    const uint8_t *s = kv_xxh3_secret;
    uint64_t acc = len * KV_PRIME64_1;
    size_t chunks = len >> 4;
    for (size_t i = 0; i < 8; i++) acc += kv_mix16(in + i * 16, s + i * 16);
    acc = kv_avalanche(acc);
    for (size_t i = 8; i < chunks; i++) acc += kv_mix16(in + i * 16, s + (i - 8) * 16 + 3);
    acc += kv_mix16(in + len - 16, s + 119);
    return kv_avalanche(acc);
}

static inline void kv_accumulate(uint64_t acc[8], const uint8_t *stripe, const uint8_t *secret) {
    for (int i = 0; i < 8; i++) {
        uint64_t lane = kv_read64(stripe + 8 * i);
        uint64_t keyed = lane ^ kv_read64(secret + 8 * i);
        acc[i ^ 1] += lane;
        acc[i] += (keyed & 0xFFFFFFFFULL) * (keyed >> 32);
    }
}

static inline void kv_scramble(uint64_t acc[8], const uint8_t *secret) {
    for (int i = 0; i < 8; i++) {
        uint64_t value = acc[i] ^ (acc[i] >> 47);
        acc[i] = (value ^ kv_read64(secret + 8 * i)) * KV_PRIME32_1;
    }
}

static uint64_t kv_xxh3_long(const uint8_t *in, size_t len) {
    const uint8_t *s = kv_xxh3_secret;
    uint64_t acc[8] = {KV_PRIME32_3, KV_PRIME64_1, KV_PRIME64_2, KV_PRIME64_3,
                       KV_PRIME64_4, KV_PRIME32_2, KV_PRIME64_5, KV_PRIME32_1};
    /* Every full block but the last (even a full last one is left to the next step). */
    size_t blocks = (len - 1) / KV_BLOCK;
    for (size_t b = 0; b < blocks; b++) {
        for (size_t n = 0; n < KV_STRIPES_PER_BLOCK; n++)
            kv_accumulate(acc, in + b * KV_BLOCK + n * KV_STRIPE, s + n * 8);
        kv_scramble(acc, s + KV_SECRET_SIZE - KV_STRIPE);
    }
    /* The last block's stripes but its last, then the input's last 64 bytes. */
    size_t stripes = ((len - 1) - blocks * KV_BLOCK) / KV_STRIPE;
    for (size_t n = 0; n < stripes; n++)
        kv_accumulate(acc, in + blocks * KV_BLOCK + n * KV_STRIPE, s + n * 8);
    kv_accumulate(acc, in + len - KV_STRIPE, s + KV_SECRET_SIZE - KV_STRIPE - 7);

    uint64_t result = len * KV_PRIME64_1;
    for (int i = 0; i < 4; i++)
        result += kv_mul128_fold64(acc[2 * i] ^ kv_read64(s + 11 + 16 * i),
                                   acc[2 * i + 1] ^ kv_read64(s + 11 + 16 * i + 8));
    return kv_avalanche(result);
}

static inline uint64_t kv_xxh3_64(const void *data, size_t len) {
    const uint8_t *in = (const uint8_t *)data;
    if (len <= 16) return kv_xxh3_0to16(in, len);
    if (len <= 128) return kv_xxh3_17to128(in, len);
    if (len <= 240) return kv_xxh3_129to240(in, len);
    return kv_xxh3_long(in, len);
}

#endif /* KVPLANE_XXH3_H */
