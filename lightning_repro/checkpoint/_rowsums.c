/*
 * lightning_repro.checkpoint._rowsums: the row checksums of checkpoint.hashing.row_checksums in one pass over memory.
 *
 * A row is 4 KiB of a tensor's bytes read as 512 little-endian int64 words (native order, as torch's
 * `view(torch.int64)` reads them); its checksum is sum(word[c] * W[c]) modulo 2**64, where W[c] is SplitMix64 of the
 * column c with its lowest bit set (hashing._weights). The torch path computes it with `torch.mv` of the int64 rows,
 * which on the CPU reads the rows in a generic integer kernel at a few GB/s; here the words are multiplied and added
 * as they stream in, at about the speed of a plain sum of the same bytes.
 *
 * Three kernels compute the same values (integer arithmetic modulo 2**64 has no rounding: the order of the adds does
 * not matter): AVX-512 (vpmullq, AVX512DQ), AVX2 (the low 64 bits of each product from three 32x32->64 multiplies)
 * and plain C; the best one the CPU and the OS support is chosen when the module is loaded (`KERNEL`). Rows may start
 * anywhere in memory (unaligned loads). hashing checks the kernel against the torch path at import and falls back to
 * it on any difference; the tests compare every kernel with it over many shapes, dtypes and offsets.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define ROW_WORDS 512
#define ROW_BYTES (8 * ROW_WORDS)

#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#define HAVE_X86 1
#include <immintrin.h>
#else
#define HAVE_X86 0
#endif

static uint64_t weights[ROW_WORDS]; /* hashing._weights, as unsigned words */
#if HAVE_X86
static uint64_t weights_high[ROW_WORDS]; /* weights >> 32, for the AVX2 kernel */
#endif

static uint64_t
splitmix64(uint64_t x)
{
    x += 0x9E3779B97F4A7C15ULL;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

typedef void (*kernel_t)(const unsigned char *, uint64_t *, Py_ssize_t);

/* Read 8 KiB (two rows) ahead, a cache line at a time: the multiplies give the core fewer loads in flight than a
 * plain sum's, and without the hint the kernels ran ~1.4x slower than a sum of the same bytes (a hint only: a
 * prefetch past the end of the buffer does not fault). */
#define AHEAD 8192
#if HAVE_X86
#define PREFETCH(p) _mm_prefetch((const char *)(p) + AHEAD, _MM_HINT_T0)
#elif defined(__GNUC__) || defined(__clang__)
#define PREFETCH(p) __builtin_prefetch((const char *)(p) + AHEAD)
#else
#define PREFETCH(p) ((void)0)
#endif

static void
rows_scalar(const unsigned char *src, uint64_t *out, Py_ssize_t rows)
{
    for (Py_ssize_t r = 0; r < rows; r++, src += ROW_BYTES) {
        uint64_t acc[4] = {0, 0, 0, 0}; /* four chains: the multiplies of one row overlap */
        for (int c = 0; c < ROW_WORDS; c += 8) {
            uint64_t x[8];
            PREFETCH(src + 8 * c);
            memcpy(x, src + 8 * c, sizeof x);
            acc[0] += x[0] * weights[c] + x[4] * weights[c + 4];
            acc[1] += x[1] * weights[c + 1] + x[5] * weights[c + 5];
            acc[2] += x[2] * weights[c + 2] + x[6] * weights[c + 6];
            acc[3] += x[3] * weights[c + 3] + x[7] * weights[c + 7];
        }
        out[r] = acc[0] + acc[1] + acc[2] + acc[3];
    }
}

#if HAVE_X86
/* x * w mod 2**64 = lo(x)*lo(w) + ((hi(x)*lo(w) + lo(x)*hi(w)) << 32): the low products and the cross products are
 * summed apart (sums modulo 2**64, and the shift of a sum is the sum of the shifts), shifted once per row. */
__attribute__((target("avx2"))) static void
rows_avx2(const unsigned char *src, uint64_t *out, Py_ssize_t rows)
{
    for (Py_ssize_t r = 0; r < rows; r++, src += ROW_BYTES) {
        __m256i low0 = _mm256_setzero_si256(), low1 = low0, cross0 = low0, cross1 = low0;
        for (int c = 0; c < ROW_WORDS; c += 8) {
            const unsigned char *p = src + 8 * c;
            PREFETCH(p);
            __m256i x = _mm256_loadu_si256((const __m256i *)p);
            __m256i w = _mm256_loadu_si256((const __m256i *)(weights + c));
            __m256i wh = _mm256_loadu_si256((const __m256i *)(weights_high + c));
            low0 = _mm256_add_epi64(low0, _mm256_mul_epu32(x, w));
            cross0 = _mm256_add_epi64(
                cross0, _mm256_add_epi64(_mm256_mul_epu32(_mm256_srli_epi64(x, 32), w), _mm256_mul_epu32(x, wh)));
            x = _mm256_loadu_si256((const __m256i *)(p + 32));
            w = _mm256_loadu_si256((const __m256i *)(weights + c + 4));
            wh = _mm256_loadu_si256((const __m256i *)(weights_high + c + 4));
            low1 = _mm256_add_epi64(low1, _mm256_mul_epu32(x, w));
            cross1 = _mm256_add_epi64(
                cross1, _mm256_add_epi64(_mm256_mul_epu32(_mm256_srli_epi64(x, 32), w), _mm256_mul_epu32(x, wh)));
        }
        __m256i cross = _mm256_slli_epi64(_mm256_add_epi64(cross0, cross1), 32);
        uint64_t lanes[4];
        _mm256_storeu_si256((__m256i *)lanes, _mm256_add_epi64(_mm256_add_epi64(low0, low1), cross));
        out[r] = lanes[0] + lanes[1] + lanes[2] + lanes[3];
    }
}

__attribute__((target("avx512f,avx512dq"))) static void
rows_avx512(const unsigned char *src, uint64_t *out, Py_ssize_t rows)
{
    for (Py_ssize_t r = 0; r < rows; r++, src += ROW_BYTES) {
        __m512i acc0 = _mm512_setzero_si512(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
        for (int c = 0; c < ROW_WORDS; c += 32) {
            const unsigned char *p = src + 8 * c;
            PREFETCH(p);
            PREFETCH(p + 64);
            PREFETCH(p + 128);
            PREFETCH(p + 192);
            acc0 = _mm512_add_epi64(acc0, _mm512_mullo_epi64(_mm512_loadu_si512(p), _mm512_loadu_si512(weights + c)));
            acc1 = _mm512_add_epi64(
                acc1, _mm512_mullo_epi64(_mm512_loadu_si512(p + 64), _mm512_loadu_si512(weights + c + 8)));
            acc2 = _mm512_add_epi64(
                acc2, _mm512_mullo_epi64(_mm512_loadu_si512(p + 128), _mm512_loadu_si512(weights + c + 16)));
            acc3 = _mm512_add_epi64(
                acc3, _mm512_mullo_epi64(_mm512_loadu_si512(p + 192), _mm512_loadu_si512(weights + c + 24)));
        }
        __m512i acc = _mm512_add_epi64(_mm512_add_epi64(acc0, acc1), _mm512_add_epi64(acc2, acc3));
        out[r] = (uint64_t)_mm512_reduce_add_epi64(acc);
    }
}
#endif

#if HAVE_X86
/* The CRC-32 of zlib (reflected polynomial 0xEDB88320) of a buffer of at least 64 bytes, a multiple of 16 long, by
 * carry-less multiplication folding (Intel's "Fast CRC Computation for Generic Polynomials Using PCLMULQDQ", the
 * constants of its bit-reflected domain): four 128-bit lanes folded 64 bytes at a time, then into one, then 16 bytes
 * at a time, then Barrett-reduced to 32 bits. `crc` is zlib's running value (inverted on the way in and out). The
 * step trace digests each batch by its CRC-32: zlib's table-driven loop reads ~1-5 GB/s, this ~10x that. */
__attribute__((target("pclmul,sse4.1"))) static uint32_t
crc32_fold(const unsigned char *buf, size_t len, uint32_t crc)
{
    const __m128i k1k2 = _mm_set_epi64x(0x01c6e41596LL, 0x0154442bd4LL);
    const __m128i k3k4 = _mm_set_epi64x(0x00ccaa009eLL, 0x01751997d0LL);
    const __m128i k5k0 = _mm_set_epi64x(0x0000000000LL, 0x0163cd6124LL);
    const __m128i poly = _mm_set_epi64x(0x01f7011641LL, 0x01db710641LL);
    __m128i x0, x1, x2, x3, x4, x5, x6, x7, x8, y5, y6, y7, y8;

    crc = ~crc;
    x1 = _mm_loadu_si128((const __m128i *)(buf + 0x00));
    x2 = _mm_loadu_si128((const __m128i *)(buf + 0x10));
    x3 = _mm_loadu_si128((const __m128i *)(buf + 0x20));
    x4 = _mm_loadu_si128((const __m128i *)(buf + 0x30));
    x1 = _mm_xor_si128(x1, _mm_cvtsi32_si128((int)crc));
    x0 = k1k2;
    buf += 64;
    len -= 64;
    while (len >= 64) {
        x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
        x6 = _mm_clmulepi64_si128(x2, x0, 0x00);
        x7 = _mm_clmulepi64_si128(x3, x0, 0x00);
        x8 = _mm_clmulepi64_si128(x4, x0, 0x00);
        x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
        x2 = _mm_clmulepi64_si128(x2, x0, 0x11);
        x3 = _mm_clmulepi64_si128(x3, x0, 0x11);
        x4 = _mm_clmulepi64_si128(x4, x0, 0x11);
        y5 = _mm_loadu_si128((const __m128i *)(buf + 0x00));
        y6 = _mm_loadu_si128((const __m128i *)(buf + 0x10));
        y7 = _mm_loadu_si128((const __m128i *)(buf + 0x20));
        y8 = _mm_loadu_si128((const __m128i *)(buf + 0x30));
        x1 = _mm_xor_si128(_mm_xor_si128(x1, x5), y5);
        x2 = _mm_xor_si128(_mm_xor_si128(x2, x6), y6);
        x3 = _mm_xor_si128(_mm_xor_si128(x3, x7), y7);
        x4 = _mm_xor_si128(_mm_xor_si128(x4, x8), y8);
        buf += 64;
        len -= 64;
    }
    x0 = k3k4;
    x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
    x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
    x1 = _mm_xor_si128(_mm_xor_si128(x1, x2), x5);
    x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
    x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
    x1 = _mm_xor_si128(_mm_xor_si128(x1, x3), x5);
    x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
    x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
    x1 = _mm_xor_si128(_mm_xor_si128(x1, x4), x5);
    while (len >= 16) {
        x2 = _mm_loadu_si128((const __m128i *)buf);
        x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
        x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
        x1 = _mm_xor_si128(_mm_xor_si128(x1, x2), x5);
        buf += 16;
        len -= 16;
    }
    /* fold 128 bits to 64, then Barrett-reduce to 32 */
    x2 = _mm_clmulepi64_si128(x1, x0, 0x10);
    x3 = _mm_setr_epi32(~0, 0, ~0, 0);
    x1 = _mm_srli_si128(x1, 8);
    x1 = _mm_xor_si128(x1, x2);
    x0 = k5k0;
    x2 = _mm_srli_si128(x1, 4);
    x1 = _mm_and_si128(x1, x3);
    x1 = _mm_clmulepi64_si128(x1, x0, 0x00);
    x1 = _mm_xor_si128(x1, x2);
    x0 = poly;
    x2 = _mm_and_si128(x1, x3);
    x2 = _mm_clmulepi64_si128(x2, x0, 0x10);
    x2 = _mm_and_si128(x2, x3);
    x2 = _mm_clmulepi64_si128(x2, x0, 0x00);
    x1 = _mm_xor_si128(x1, x2);
    return ~(uint32_t)_mm_extract_epi32(x1, 1);
}

#endif
static int have_clmul = 0; /* the CPU runs crc32_fold (PCLMULQDQ and SSE4.1) */

static const char *kernel_names[] = {"scalar", "avx2", "avx512"};
static kernel_t kernel_functions[] = {
    rows_scalar,
#if HAVE_X86
    rows_avx2,
    rows_avx512,
#endif
};
static int kernels_here = 1; /* how many of kernel_functions the CPU and the OS support (the best is the last) */

PyDoc_STRVAR(checksums_doc, "checksums(src, out, kernel=-1, /)\n--\n\n"
                            "The row checksums of the bytes of `src` (a buffer of whole 4 KiB rows, any alignment)\n"
                            "written into `out` (a writable buffer of one int64 per row). `kernel` indexes\n"
                            "kernels() (-1: the best here). Runs without the GIL.");

static PyObject *
checksums(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 2 || nargs > 3) {
        PyErr_Format(PyExc_TypeError, "checksums() takes 2 or 3 arguments (%zd given)", nargs);
        return NULL;
    }
    long which = kernels_here - 1;
    if (nargs == 3) {
        long given = PyLong_AsLong(args[2]);
        if (given == -1 && PyErr_Occurred()) {
            return NULL;
        }
        which = given < 0 ? given + kernels_here : given;
        if (which < 0 || which >= kernels_here) {
            PyErr_Format(PyExc_ValueError, "`kernel` must index kernels() (%d here), got %ld", kernels_here, given);
            return NULL;
        }
    }
    Py_buffer src, out;
    if (PyObject_GetBuffer(args[0], &src, PyBUF_C_CONTIGUOUS) < 0) {
        return NULL;
    }
    if (PyObject_GetBuffer(args[1], &out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&src);
        return NULL;
    }
    Py_ssize_t rows = src.len / ROW_BYTES;
    PyObject *result = NULL;
    if (src.len % ROW_BYTES) {
        PyErr_Format(PyExc_ValueError, "`src` must hold whole rows of %d bytes, got %zd bytes", ROW_BYTES, src.len);
    } else if (out.len != 8 * rows) {
        PyErr_Format(PyExc_ValueError, "`out` must hold %zd bytes (8 per row of `src`), got %zd", 8 * rows, out.len);
    } else {
        kernel_t kernel = kernel_functions[which];
        uint64_t row_sum;
        Py_BEGIN_ALLOW_THREADS;
        if (((uintptr_t)out.buf) % 8) { /* an unaligned `out`: one row at a time through a word on the stack */
            for (Py_ssize_t r = 0; r < rows; r++) {
                kernel((const unsigned char *)src.buf + r * ROW_BYTES, &row_sum, 1);
                memcpy((char *)out.buf + 8 * r, &row_sum, 8);
            }
        } else {
            kernel((const unsigned char *)src.buf, (uint64_t *)out.buf, rows);
        }
        Py_END_ALLOW_THREADS;
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&out);
    PyBuffer_Release(&src);
    return result;
}

PyDoc_STRVAR(crc32_doc, "crc32(src, value=0, /)\n--\n\n"
                        "zlib.crc32 of the first `used` bytes of the buffer `src`, continuing from `value`, by\n"
                        "carry-less multiplication: returns (crc, used), used the largest multiple of 16 of its\n"
                        "length (0 below 64 bytes, or where the CPU lacks PCLMULQDQ: crc is then `value`); the\n"
                        "caller continues with zlib.crc32(src[used:], crc). Runs without the GIL.");

static PyObject *
crc32(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 2) {
        PyErr_Format(PyExc_TypeError, "crc32() takes 1 or 2 arguments (%zd given)", nargs);
        return NULL;
    }
    unsigned long value = 0;
    if (nargs == 2) {
        value = PyLong_AsUnsignedLong(args[1]);
        if (value == (unsigned long)-1 && PyErr_Occurred()) {
            return NULL;
        }
        if (value > 0xFFFFFFFFUL) {
            PyErr_SetString(PyExc_ValueError, "`value` must be a CRC-32 (0 to 2**32 - 1)");
            return NULL;
        }
    }
    Py_buffer src;
    if (PyObject_GetBuffer(args[0], &src, PyBUF_C_CONTIGUOUS) < 0) {
        return NULL;
    }
    uint32_t crc = (uint32_t)value;
    size_t used = (size_t)src.len & ~(size_t)15;
    if (!have_clmul || used < 64) {
        used = 0;
    }
#if HAVE_X86
    if (used) {
        Py_BEGIN_ALLOW_THREADS;
        crc = crc32_fold((const unsigned char *)src.buf, used, crc);
        Py_END_ALLOW_THREADS;
    }
#endif
    PyBuffer_Release(&src);
    return Py_BuildValue("(kn)", (unsigned long)crc, (Py_ssize_t)used);
}

PyDoc_STRVAR(kernels_doc, "kernels()\n--\n\n"
                          "The names of the kernels this CPU runs, the best (the one `checksums` uses) last.");

static PyObject *
kernels(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored))
{
    PyObject *names = PyList_New(kernels_here);
    for (int k = 0; names != NULL && k < kernels_here; k++) {
        PyObject *name = PyUnicode_FromString(kernel_names[k]);
        if (name == NULL) {
            Py_CLEAR(names);
            break;
        }
        PyList_SET_ITEM(names, k, name);
    }
    return names;
}

static PyMethodDef methods[] = {
    {"checksums", (PyCFunction)(void (*)(void))checksums, METH_FASTCALL, checksums_doc},
    {"kernels", (PyCFunction)kernels, METH_NOARGS, kernels_doc},
    {"crc32", (PyCFunction)(void (*)(void))crc32, METH_FASTCALL, crc32_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    "lightning_repro.checkpoint._rowsums",
    "The row checksums of checkpoint.hashing.row_checksums, in one pass over memory (see hashing).",
    -1,
    methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC
PyInit__rowsums(void)
{
    for (int c = 0; c < ROW_WORDS; c++) {
        weights[c] = splitmix64((uint64_t)c) | 1U;
#if HAVE_X86
        weights_high[c] = weights[c] >> 32;
#endif
    }
#if HAVE_X86
    __builtin_cpu_init();
    have_clmul = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
    if (__builtin_cpu_supports("avx2")) {
        kernels_here = 2;
        if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq")) {
            kernels_here = 3;
        }
    }
#endif
    return PyModule_Create(&module_def);
}
