/* A software model of the AMX tile unit (palette 1), for running tpp_tvm's tile kernels on
 * x86 CPUs without AMX. Each function stands in for the LLVM intrinsic of the same name
 * (llvm.x86.<name>) and follows the instruction's pseudocode in Intel's SDM: tile state is
 * per thread, ldtilecfg zeroes every tile, loads zero the bytes past a tile's columns and
 * rows, tdpbf16ps reads bf16 with denormals as zero and accumulates each pair of products
 * in order, tdpbusd and tdpbssd sum four u8 x s8 or s8 x s8 products into int32 (wrapping).
 *
 * Where the hardware raises #UD (no configuration, a tile outside the configuration, tile
 * shapes that do not chain), the model records the first such fault with the offending
 * shapes and skips the instruction: tpp_amx_emu_fault() reports it to the caller, which
 * turns it into an exception rather than a dead process. */
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

enum { TILES = 8, MAX_ROWS = 16, MAX_COLSB = 64 };

typedef struct {
    int configured;
    uint8_t rows[TILES];
    uint16_t colsb[TILES];
    uint8_t data[TILES][MAX_ROWS][MAX_COLSB];
} tile_state;

static __thread tile_state state;
static char fault_text[512];
static int fault_seen;
static unsigned long long products;

static void fault(const char *fmt, ...) {
    if (__atomic_exchange_n(&fault_seen, 1, __ATOMIC_ACQ_REL)) return;
    va_list args;
    va_start(args, fmt);
    vsnprintf(fault_text, sizeof fault_text, fmt, args);
    va_end(args);
}

const char *tpp_amx_emu_fault(void) { return fault_seen ? fault_text : NULL; }

void tpp_amx_emu_reset(void) {
    __atomic_store_n(&fault_seen, 0, __ATOMIC_RELEASE);
    __atomic_store_n(&products, 0, __ATOMIC_RELEASE);
}

unsigned long long tpp_amx_emu_products(void) {
    return __atomic_load_n(&products, __ATOMIC_ACQUIRE);
}

static int usable(int t, const char *what) {
    if (!state.configured) {
        fault("%s: no tile configuration loaded (ldtilecfg) on this thread", what);
        return 0;
    }
    if (t < 0 || t >= TILES || state.rows[t] == 0 || state.colsb[t] == 0) {
        fault("%s: tile %d is not in the loaded configuration", what, t);
        return 0;
    }
    return 1;
}

void tpp_amx_emu_ldtilecfg(const uint8_t *cfg) {
    memset(&state, 0, sizeof state);
    if (cfg[0] != 1) {
        fault("ldtilecfg: palette %d, only palette 1 exists", cfg[0]);
        return;
    }
    for (int t = 0; t < TILES; t++) {
        int colsb = cfg[16 + 2 * t] | (cfg[17 + 2 * t] << 8), rows = cfg[48 + t];
        if (rows > MAX_ROWS || colsb > MAX_COLSB || (rows == 0) != (colsb == 0)) {
            fault("ldtilecfg: tile %d has %d rows of %d bytes (at most 16 rows of 64)", t,
                  rows, colsb);
            return;
        }
        state.rows[t] = (uint8_t)rows;
        state.colsb[t] = (uint16_t)colsb;
    }
    state.configured = 1;
}

void tpp_amx_emu_tilerelease(void) { memset(&state, 0, sizeof state); }

void tpp_amx_emu_tilezero(int8_t t) {
    if (usable(t, "tilezero")) memset(state.data[t], 0, sizeof state.data[t]);
}

void tpp_amx_emu_tileloadd64(int8_t t, const uint8_t *base, int64_t stride) {
    if (!usable(t, "tileloadd")) return;
    memset(state.data[t], 0, sizeof state.data[t]);
    for (int r = 0; r < state.rows[t]; r++)
        memcpy(state.data[t][r], base + r * stride, state.colsb[t]);
}

void tpp_amx_emu_tilestored64(int8_t t, uint8_t *base, int64_t stride) {
    if (!usable(t, "tilestored")) return;
    for (int r = 0; r < state.rows[t]; r++)
        memcpy(base + r * stride, state.data[t][r], state.colsb[t]);
}

/* C (rows x n 32-bit), A (rows x k 32-bit groups), B (k rows x n 32-bit groups). */
static int chained(int8_t c, int8_t a, int8_t b, const char *what) {
    if (!usable(c, what) || !usable(a, what) || !usable(b, what)) return 0;
    if (state.rows[c] != state.rows[a] || state.colsb[c] != state.colsb[b]
        || state.colsb[a] / 4 != state.rows[b]) {
        fault("%s: C %dx%dB, A %dx%dB, B %dx%dB do not chain (C rows = A rows, "
              "C bytes = B bytes, A bytes / 4 = B rows)", what, state.rows[c], state.colsb[c],
              state.rows[a], state.colsb[a], state.rows[b], state.colsb[b]);
        return 0;
    }
    __atomic_add_fetch(&products, 1, __ATOMIC_RELAXED);
    return 1;
}

static float bf16_to_float(uint16_t x) {
    if ((x & 0x7F80) == 0) x &= 0x8000; /* denormals as zero */
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

void tpp_amx_emu_tdpbf16ps(int8_t c, int8_t a, int8_t b) {
    if (!chained(c, a, b, "tdpbf16ps")) return;
    int n = state.colsb[c] / 4, k = state.colsb[a] / 4;
    for (int m = 0; m < state.rows[c]; m++) {
        float acc[MAX_COLSB / 4];
        memcpy(acc, state.data[c][m], 4 * n);
        const uint16_t *ar = (const uint16_t *)state.data[a][m];
        for (int g = 0; g < k; g++) {
            const uint16_t *br = (const uint16_t *)state.data[b][g];
            float a0 = bf16_to_float(ar[2 * g]), a1 = bf16_to_float(ar[2 * g + 1]);
            for (int j = 0; j < n; j++) {
                acc[j] += a0 * bf16_to_float(br[2 * j]);
                acc[j] += a1 * bf16_to_float(br[2 * j + 1]);
            }
        }
        memcpy(state.data[c][m], acc, 4 * n);
    }
}

/* tdpb[su][su]d: four 8-bit products per int32 lane, A's bytes unsigned or signed as the
 * instruction's first letter after "tdpb" says, B's as its second. */
static void int8_product(int8_t c, int8_t a, int8_t b, int a_signed, int b_signed,
                         const char *what) {
    if (!chained(c, a, b, what)) return;
    int n = state.colsb[c] / 4, k = state.colsb[a] / 4;
    for (int m = 0; m < state.rows[c]; m++) {
        uint32_t acc[MAX_COLSB / 4];
        memcpy(acc, state.data[c][m], 4 * n);
        const uint8_t *ar = state.data[a][m];
        for (int g = 0; g < k; g++) {
            const uint8_t *br = state.data[b][g];
            for (int j = 0; j < n; j++) {
                int32_t dot = 0;
                for (int i = 0; i < 4; i++) {
                    int32_t x = a_signed ? (int8_t)ar[4 * g + i] : ar[4 * g + i];
                    int32_t y = b_signed ? (int8_t)br[4 * j + i] : br[4 * j + i];
                    dot += x * y;
                }
                acc[j] += (uint32_t)dot;
            }
        }
        memcpy(state.data[c][m], acc, 4 * n);
    }
}

void tpp_amx_emu_tdpbusd(int8_t c, int8_t a, int8_t b) { int8_product(c, a, b, 0, 1, "tdpbusd"); }

void tpp_amx_emu_tdpbssd(int8_t c, int8_t a, int8_t b) { int8_product(c, a, b, 1, 1, "tdpbssd"); }

/* fp32 -> bf16, rounded to nearest even (NaN stays a quiet NaN), as vcvtneps2bf16: the
 * routine LLVM calls for a conversion to bfloat on CPUs without AVX512_BF16 (the AMX kernels
 * compiled for an AVX2 host). libgcc has it from GCC 13 only; without a definition the JIT
 * would bind the call to nothing. The bf16 result is returned in the low 16 bits of xmm0,
 * where a float return value lies. */
float __truncsfbf2(float x) {
    union { float f; uint32_t u; } in = {x}, out = {0};
    uint32_t bits = in.u;
    if ((bits & 0x7fffffffu) > 0x7f800000u) out.u = (bits >> 16) | 0x40u;
    else out.u = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    return out.f;
}
