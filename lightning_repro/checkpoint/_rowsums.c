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
    if (__builtin_cpu_supports("avx2")) {
        kernels_here = 2;
        if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq")) {
            kernels_here = 3;
        }
    }
#endif
    return PyModule_Create(&module_def);
}
