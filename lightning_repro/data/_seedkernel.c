/*
 * lightning_repro.data._seedkernel: the states python's and numpy's global generators reach when seeded from a sample's
 * key, computed for a whole batch at once and written straight into the generators' memory.
 *
 * Sample-keyed access seeds python's `random` (`random.seed(z)`, ~3.8 us: CPython's init_by_array, 1,872 steps of a
 * dependent recurrence) and numpy's global generator (`np.random.seed(fold(z))`, ~1.1 us: init_genrand, 623 steps)
 * before every sample. One sample's recurrence cannot go faster (each step needs the previous word), but the
 * samples of a batch are independent: this module runs the recurrences of 16 samples side by side in vector lanes,
 * which costs about what one sample's costs alone. On x86-64 Linux the wide pass is compiled three times (AVX2,
 * SSE4.1, baseline SSE2: target_clones, chosen at load by the CPU): SSE2 has no 32-bit lane multiply, which the
 * recurrences are made of (~0.7 us a sample for all three streams with it, ~1.1 without). The states are kept as
 * rows (one word of every lane) and stored transposed, four words of a sample at a time. The states are bitwise
 * those of the library calls:
 *
 *   - python: CPython's random_seed() for a non-negative int `z` below 2**64: key = its 32-bit words from the low
 *     end (one word when z < 2**32, zero included), init_by_array(key), index = 624. The raw layout written is
 *     CPython's `int index; uint32_t state[624]` (2,500 bytes), found and checked by _fastrng.python_raw_layout().
 *   - numpy: RandomState.seed(s) with s = (z ^ (z >> 32)) & 0xFFFFFFFF (seeding.fold_seed32): mt19937_seed(s),
 *     i.e. `uint32_t key[624]; int pos = 624` (2,500 bytes, behind bit_generator.ctypes.state_address), and the
 *     RandomState's cached gaussian cleared (`int has_gauss = 0; double gauss = 0.0`, 16 bytes), as _reset_gauss().
 *
 *   - torch (optional, states() given buffers): what `torch.default_generator.get_state()` returns after
 *     `manual_seed(z)`, for `set_state()`: the seed (u64), left = 1 and seeded = 1 (i32 each), next = 0 (u64),
 *     the 624 words of init_genrand((uint32_t)z) as u64 each (5,016 bytes), zeros after them (no cached normal).
 *     `set_state()` of it costs a fraction of `manual_seed()`, whose 623 dependent steps ride here in the lanes.
 *
 * _fastrng checks all three against the library calls at import, and falls back to them on any difference; the
 * tests compare them over many keys. The addresses come from _fastrng's checked layouts (configure()); nothing is written
 * before configure() gave both. Every function runs with the GIL held, as the library calls do.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#if (defined(__GNUC__) || defined(__clang__)) && defined(__SSE2__)
#include <emmintrin.h>
#define TRANSPOSE 1 /* rows of words stored four words of a sample at a time (see store_rows) */
#endif

#define MT_N 624
#define BLOCK 2500         /* one stream's raw state */
#define SAMPLE (2 * BLOCK) /* a sample's states: python's block, then numpy's */
#define AUG 16             /* numpy's has_gauss (int, padded) and gauss (double) */
#define TORCH_WORDS 24     /* where the words start in torch's state: seed, left, seeded, next */
#define TORCH_MIN (TORCH_WORDS + 8 * MT_N)
/* torch's CPU generator in memory (at::CPUGeneratorImpl's engine and cached normals, found and checked by
 * _fastrng.torch_raw_layout): seed u64, left i32, seeded bool, next u32, the 624 words (u32), then
 * optional<float> and optional<double>, each a value and its flag. */
#define RAW_LEFT 8
#define RAW_SEEDED 12
#define RAW_NEXT 16
#define RAW_WORDS 20
#define RAW_FLOAT_FLAG 2524
#define RAW_DOUBLE_FLAG 2536
#define RAW_SIZE 2544                      /* what capture() copies of it */
#define SAMPLE_RAW (SAMPLE + 8 + 4 * MT_N) /* a states_raw() sample: python's, numpy's, torch's seed and words */
#define TORCH 4                            /* the stream mask of torch in put_raw() */

#if defined(__GNUC__) || defined(__clang__)
typedef uint32_t lanes_t __attribute__((vector_size(16))); /* four samples' words */
#define PER_LANES 4
#else
typedef uint32_t lanes_t;
#define PER_LANES 1
#endif
#if defined(__GNUC__) && defined(__x86_64__) && defined(__linux__)
#define CLONES __attribute__((target_clones("avx2", "sse4.1", "default")))
#else
#define CLONES
#endif
#define WIDE 16 /* samples per pass of the wide kernel: 4 vectors, enough independent chains to hide the latency */
#define GROUPS (WIDE / PER_LANES)
typedef struct {
    lanes_t g[GROUPS];
} row_t;

static uint32_t python_start[MT_N]; /* init_genrand(19650218): where CPython's init_by_array starts, every time */
static char *python_state;          /* &index of random._inst */
static char *numpy_state;           /* &key[0] of numpy's global MT19937 */
static char *numpy_aug;             /* &has_gauss of numpy's global RandomState */
static char *torch_engine;          /* &seed of torch.default_generator's engine (configure_torch), or NULL */

static void
write_int(unsigned char *out, int32_t value)
{
    memcpy(out, &value, sizeof value);
}

/* The fixed head of torch's state (seed, left, seeded, next) and zeros after its words, up to `size` bytes. */
static void
torch_frame(uint64_t z, unsigned char *torch, Py_ssize_t size)
{
    int32_t one = 1;
    uint64_t zero = 0;
    memcpy(torch, &z, 8);
    memcpy(torch + 8, &one, 4);
    memcpy(torch + 12, &one, 4);
    memcpy(torch + 16, &zero, 8);
    memset(torch + TORCH_MIN, 0, (size_t)(size - TORCH_MIN));
}

static void
torch_word(unsigned char *torch, int pos, uint32_t word)
{
    uint64_t wide = word;
    memcpy(torch + TORCH_WORDS + 8 * (size_t)pos, &wide, 8);
}

/* One sample, one lane: CPython's init_by_array and numpy's mt19937_seed, as written there (and torch's). */
static void
scalar_states(uint64_t z, unsigned char *out, unsigned char *torch, Py_ssize_t torch_size, int raw)
{
    uint32_t mt[MT_N];
    uint32_t key[2] = {(uint32_t)z, (uint32_t)(z >> 32)};
    size_t key_length = key[1] ? 2 : 1;
    size_t i = 1, j = 0, k;
    memcpy(mt, python_start, sizeof mt);
    for (k = MT_N; k; k--) {
        mt[i] = (mt[i] ^ ((mt[i - 1] ^ (mt[i - 1] >> 30)) * 1664525U)) + key[j] + (uint32_t)j;
        i++;
        j++;
        if (i >= MT_N) {
            mt[0] = mt[MT_N - 1];
            i = 1;
        }
        if (j >= key_length) {
            j = 0;
        }
    }
    for (k = MT_N - 1; k; k--) {
        mt[i] = (mt[i] ^ ((mt[i - 1] ^ (mt[i - 1] >> 30)) * 1566083941U)) - (uint32_t)i;
        i++;
        if (i >= MT_N) {
            mt[0] = mt[MT_N - 1];
            i = 1;
        }
    }
    mt[0] = 0x80000000U;
    write_int(out, MT_N);
    memcpy(out + 4, mt, sizeof mt);

    uint32_t s = (uint32_t)(z ^ (z >> 32));
    for (int pos = 0; pos < MT_N; pos++) {
        mt[pos] = s;
        s = 1812433253U * (s ^ (s >> 30)) + (uint32_t)(pos + 1);
    }
    memcpy(out + BLOCK, mt, sizeof mt);
    write_int(out + BLOCK + 4 * MT_N, MT_N);
    if (torch != NULL || raw) { /* torch's mt19937(seed): init_genrand of the seed's low word */
        uint32_t t = (uint32_t)z;
        if (torch != NULL) {
            torch_frame(z, torch, torch_size);
        }
        for (int pos = 0; pos < MT_N; pos++) {
            if (torch != NULL) {
                torch_word(torch, pos, t);
            } else {
                mt[pos] = t;
            }
            t = 1812433253U * (t ^ (t >> 30)) + (uint32_t)(pos + 1);
        }
        if (raw) {
            memcpy(out + SAMPLE, &z, 8);
            memcpy(out + SAMPLE + 8, mt, sizeof mt);
        }
    }
}

#ifndef TRANSPOSE
static void
scatter(const row_t *row, unsigned char *out, int used, size_t offset, size_t stride)
{
    uint32_t words[WIDE];
    memcpy(words, row, sizeof words);
    for (int l = 0; l < used; l++) {
        memcpy(out + (size_t)l * stride + offset, &words[l], 4);
    }
}

static void
scatter_torch(const row_t *row, unsigned char *const *torch, int used, int pos)
{
    uint32_t words[WIDE];
    memcpy(words, row, sizeof words);
    for (int l = 0; l < used; l++) {
        torch_word(torch[l], pos, words[l]);
    }
}
#endif

/* Words 0..MT_N-1 of each of `used` lanes, rows[q] holding word q of every lane: lane l's words go to
 * out + l * stride + offset (u32 each), or, `torch` not NULL, to torch[l]'s words (u64 each). With SSE2, four rows
 * and four lanes are transposed in registers and stored 16 bytes at a time (a fraction of the scalar stores). */
static void
store_rows(const row_t *rows, unsigned char *out, size_t offset, unsigned char *const *torch, int used,
           size_t stride)
{
#ifdef TRANSPOSE
    const __m128i zero = _mm_setzero_si128();
    for (int q = 0; q < MT_N; q += 4) {
        for (int c = 0; 4 * c < used; c++) { /* lanes 4c..4c+3: 16 bytes of each row (a row is WIDE words) */
            __m128i r0, r1, r2, r3;
            memcpy(&r0, (const unsigned char *)&rows[q] + 16 * c, 16);
            memcpy(&r1, (const unsigned char *)&rows[q + 1] + 16 * c, 16);
            memcpy(&r2, (const unsigned char *)&rows[q + 2] + 16 * c, 16);
            memcpy(&r3, (const unsigned char *)&rows[q + 3] + 16 * c, 16);
            __m128i t0 = _mm_unpacklo_epi32(r0, r1), t1 = _mm_unpacklo_epi32(r2, r3);
            __m128i t2 = _mm_unpackhi_epi32(r0, r1), t3 = _mm_unpackhi_epi32(r2, r3);
            __m128i lanes[4] = {_mm_unpacklo_epi64(t0, t1), _mm_unpackhi_epi64(t0, t1), _mm_unpacklo_epi64(t2, t3),
                                _mm_unpackhi_epi64(t2, t3)};
            for (int k = 0; k < 4 && 4 * c + k < used; k++) {
                int l = 4 * c + k;
                if (torch != NULL) {
                    unsigned char *at = torch[l] + TORCH_WORDS + 8 * (size_t)q;
                    _mm_storeu_si128((__m128i *)at, _mm_unpacklo_epi32(lanes[k], zero));
                    _mm_storeu_si128((__m128i *)(at + 16), _mm_unpackhi_epi32(lanes[k], zero));
                } else {
                    _mm_storeu_si128((__m128i *)(out + (size_t)l * stride + offset + 4 * (size_t)q), lanes[k]);
                }
            }
        }
    }
#else
    for (int q = 0; q < MT_N; q++) {
        if (torch != NULL) {
            scatter_torch(&rows[q], torch, used, q);
        } else {
            scatter(&rows[q], out, used, offset + 4 * (size_t)q, stride);
        }
    }
#endif
}

/* `used` (<= WIDE) samples side by side: the same recurrences, lane by lane; numpy's (and torch's, `torch` not
 * NULL: each lane's buffer) ride in python's first loop. `mt` has room for 3 * MT_N rows: python's words, then
 * numpy's and torch's rows, stored at the end (store_rows). */
CLONES static void
wide_states(const uint64_t *z, int used, unsigned char *out, row_t *mt, unsigned char *const *torch, int raw)
{
    size_t stride = raw ? SAMPLE_RAW : SAMPLE;
    row_t add_even, add_odd, numpy, torch_row;
    uint32_t even[WIDE], odd[WIDE], seed[WIDE], low_word[WIDE];
    for (int l = 0; l < WIDE; l++) {
        uint64_t v = z[l < used ? l : 0];
        uint32_t low = (uint32_t)v, high = (uint32_t)(v >> 32);
        even[l] = low;                  /* key[0] + 0 */
        odd[l] = high ? high + 1 : low; /* key[1] + 1, or key[0] + 0 again for a one-word key */
        seed[l] = (uint32_t)(v ^ (v >> 32));
        low_word[l] = low;
    }
    memcpy(&add_even, even, sizeof even);
    memcpy(&add_odd, odd, sizeof odd);
    memcpy(&numpy, seed, sizeof seed);
    memcpy(&torch_row, low_word, sizeof low_word);
    row_t *numpy_rows = mt + MT_N, *torch_rows = mt + 2 * MT_N;
    numpy_rows[0] = numpy;
    torch_rows[0] = torch_row;
    for (int q = 0; q < MT_N; q++) {
        for (int g = 0; g < GROUPS; g++) {
            mt[q].g[g] = (lanes_t){0} + python_start[q];
        }
    }
    row_t previous = mt[0];
    int i = 1;
    for (int step = 0; step < MT_N; step++) {
        const row_t *add = (step & 1) ? &add_odd : &add_even;
        row_t current = mt[i];
        for (int g = 0; g < GROUPS; g++) {
            lanes_t p = previous.g[g];
            current.g[g] = (current.g[g] ^ ((p ^ (p >> 30)) * 1664525U)) + add->g[g];
        }
        mt[i] = current;
        previous = current;
        if (step < MT_N - 1) { /* numpy's word step + 1 */
            for (int g = 0; g < GROUPS; g++) {
                lanes_t s = numpy.g[g];
                numpy.g[g] = 1812433253U * (s ^ (s >> 30)) + (uint32_t)(step + 1);
            }
            numpy_rows[step + 1] = numpy;
            if (torch != NULL || raw) { /* torch's word step + 1: the same recurrence from the seed's low word */
                for (int g = 0; g < GROUPS; g++) {
                    lanes_t t = torch_row.g[g];
                    torch_row.g[g] = 1812433253U * (t ^ (t >> 30)) + (uint32_t)(step + 1);
                }
                torch_rows[step + 1] = torch_row;
            }
        }
        if (++i >= MT_N) {
            mt[0] = mt[MT_N - 1];
            i = 1;
        }
    }
    for (int step = MT_N - 1; step; step--) {
        row_t current = mt[i];
        for (int g = 0; g < GROUPS; g++) {
            lanes_t p = previous.g[g];
            current.g[g] = (current.g[g] ^ ((p ^ (p >> 30)) * 1566083941U)) - (uint32_t)i;
        }
        mt[i] = current;
        previous = current;
        if (++i >= MT_N) {
            mt[0] = mt[MT_N - 1];
            i = 1;
        }
    }
    for (int g = 0; g < GROUPS; g++) {
        mt[0].g[g] = (lanes_t){0} + 0x80000000U;
    }
    store_rows(mt, out, 4, NULL, used, stride);
    store_rows(numpy_rows, out, BLOCK, NULL, used, stride);
    if (torch != NULL) {
        store_rows(torch_rows, NULL, 0, torch, used, stride);
    }
    if (raw) {
        store_rows(torch_rows, out, SAMPLE + 8, NULL, used, stride);
    }
    for (int l = 0; l < used; l++) {
        write_int(out + (size_t)l * stride, MT_N);
        write_int(out + (size_t)l * stride + BLOCK + 4 * MT_N, MT_N);
        if (raw) {
            memcpy(out + (size_t)l * stride + SAMPLE, &z[l], 8);
        }
    }
}

static int
read_seed(PyObject *item, uint64_t *z)
{
    if (!PyLong_Check(item)) {
        PyErr_Format(PyExc_TypeError, "a sample seed must be an int, got %.100s", Py_TYPE(item)->tp_name);
        return -1;
    }
    unsigned long long value = PyLong_AsUnsignedLongLong(item);
    if (value == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_OverflowError, "a sample seed must be in [0, 2**64), got %R", item);
        return -1;
    }
    *z = (uint64_t)value;
    return 0;
}

PyDoc_STRVAR(states_doc, "states(seeds, torch=None, /)\n--\n\n"
                         "Python's and numpy's raw states after seeding from each seed: len(seeds) * 5000 bytes.\n"
                         "torch: a sequence of at least len(seeds) writable buffers of 5016 bytes or more; buffer k\n"
                         "gets torch's get_state() after manual_seed(seeds[k]), zeros after its words.");

/* states() (raw = 0) and states_raw() (raw = 1: torch's seed and words in each sample, no buffers). */
static PyObject *
make_states(PyObject *const *args, Py_ssize_t nargs, int raw)
{
    size_t stride = raw ? SAMPLE_RAW : SAMPLE;
    if (raw ? nargs != 1 : nargs != 1 && nargs != 2) {
        PyErr_Format(PyExc_TypeError, raw ? "states_raw() takes 1 argument (%zd given)"
                                          : "states() takes 1 or 2 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *fast = PySequence_Fast(args[0], "states() takes a sequence of ints");
    if (fast == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    PyObject *result = NULL;
    PyObject *buffers = NULL;
    uint64_t *z = NULL;
    row_t *scratch = NULL;
    Py_buffer *views = NULL;
    unsigned char **torch = NULL;
    Py_ssize_t held = 0;
    if (n > PY_SSIZE_T_MAX / (Py_ssize_t)stride) {
        PyErr_SetString(PyExc_OverflowError, "too many seeds");
        goto done;
    }
    z = PyMem_Malloc(sizeof(uint64_t) * (size_t)(n ? n : 1));
    if (z == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        if (read_seed(items[k], &z[k]) < 0) {
            goto done;
        }
    }
    if (nargs == 2 && args[1] != Py_None) {
        buffers = PySequence_Fast(args[1], "states() takes a sequence of writable buffers for torch");
        if (buffers == NULL) {
            goto done;
        }
        if (PySequence_Fast_GET_SIZE(buffers) < n) {
            PyErr_Format(PyExc_ValueError, "states() got %zd torch buffers for %zd seeds",
                         PySequence_Fast_GET_SIZE(buffers), n);
            goto done;
        }
        views = PyMem_Malloc(sizeof(Py_buffer) * (size_t)(n ? n : 1));
        torch = PyMem_Malloc(sizeof(unsigned char *) * (size_t)(n ? n : 1));
        if (views == NULL || torch == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        for (; held < n; held++) {
            PyObject *buffer = PySequence_Fast_GET_ITEM(buffers, held);
            if (PyObject_GetBuffer(buffer, &views[held], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
                goto done;
            }
            if (views[held].len < TORCH_MIN) {
                PyErr_Format(PyExc_ValueError, "torch buffer %zd has %zd bytes, fewer than %d", held, views[held].len,
                             TORCH_MIN);
                PyBuffer_Release(&views[held]);
                goto done;
            }
            torch[held] = views[held].buf;
            torch_frame(z[held], torch[held], views[held].len);
        }
    }
    result = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)stride);
    if (result == NULL) {
        goto done;
    }
    unsigned char *out = (unsigned char *)PyBytes_AS_STRING(result);
    Py_ssize_t k = 0;
    if (n - k > 1) { /* two samples or more: one pass of the lanes costs less than two samples one at a time */
        scratch = PyMem_Malloc(sizeof(row_t) * 3 * MT_N);
        if (scratch == NULL) {
            Py_CLEAR(result);
            PyErr_NoMemory();
            goto done;
        }
        for (; n - k > 1; k += WIDE) {
            int used = n - k < WIDE ? (int)(n - k) : WIDE;
            wide_states(z + k, used, out + k * (Py_ssize_t)stride, scratch, torch != NULL ? torch + k : NULL, raw);
        }
    }
    for (; k < n; k++) {
        scalar_states(z[k], out + k * (Py_ssize_t)stride, torch != NULL ? torch[k] : NULL,
                      torch != NULL ? views[k].len : 0, raw);
    }
done:
    for (Py_ssize_t b = 0; b < held; b++) {
        PyBuffer_Release(&views[b]);
    }
    PyMem_Free(torch);
    PyMem_Free(views);
    Py_XDECREF(buffers);
    PyMem_Free(scratch);
    PyMem_Free(z);
    Py_DECREF(fast);
    return result;
}

/* A module function `name` taking the parameters after `call` and returning `call`: the plain and _raw forms. */
#define RAW_FORM(name, call, ...)                                                                                 \
    static PyObject *name(PyObject *Py_UNUSED(module), __VA_ARGS__)                                               \
    {                                                                                                             \
        return call;                                                                                              \
    }
#define FASTCALL PyObject *const *args, Py_ssize_t nargs

RAW_FORM(states, make_states(args, nargs, 0), FASTCALL)

PyDoc_STRVAR(states_raw_doc, "states_raw(seeds, /)\n--\n\n"
                             "states(seeds) with torch's state after manual_seed(seed) in each sample, for put_raw():\n"
                             "len(seeds) * 7504 bytes (python's 2500, numpy's 2500, torch's seed u64 and 624 words).");

RAW_FORM(states_raw, make_states(args, nargs, 1), FASTCALL)

static int
configured(void)
{
    if (python_state == NULL || numpy_state == NULL || numpy_aug == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "_seedkernel.configure() was not called with the generators' layouts");
        return 0;
    }
    return 1;
}

#define PYTHON 1 /* the stream masks of lightning_repro.data.usage */
#define NUMPY 2

static void
write_streams(const unsigned char *sample, long streams)
{
    static const unsigned char no_gauss[AUG] = {0};
    if (streams & TORCH) { /* as manual_seed: the engine of the seed, no cached normal */
        int32_t left = 1;
        uint32_t next = 0;
        memcpy(torch_engine, sample + SAMPLE, 8);
        memcpy(torch_engine + RAW_LEFT, &left, 4);
        torch_engine[RAW_SEEDED] = 1;
        memcpy(torch_engine + RAW_NEXT, &next, 4);
        memcpy(torch_engine + RAW_WORDS, sample + SAMPLE + 8, 4 * MT_N);
        torch_engine[RAW_FLOAT_FLAG] = 0;
        torch_engine[RAW_DOUBLE_FLAG] = 0;
    }
    if (streams & PYTHON) {
        memcpy(python_state, sample, BLOCK);
    }
    if (streams & NUMPY) {
        memcpy(numpy_state, sample + BLOCK, BLOCK);
        memcpy(numpy_aug, no_gauss, AUG);
    }
}

PyDoc_STRVAR(put_doc, "put(states, k, streams=3, /)\n--\n\n"
                      "Write sample k of states() into python's (streams & 1) and numpy's (streams & 2) generators.\n"
                      "Python's cached gaussian (random._inst.gauss_next) is the caller's to clear.");

static PyObject *
put_states(PyObject *const *args, Py_ssize_t nargs, int raw)
{
    long all = raw ? PYTHON | NUMPY | TORCH : PYTHON | NUMPY;
    Py_ssize_t stride = raw ? SAMPLE_RAW : SAMPLE;
    long streams = all;
    if (nargs != 2 && nargs != 3) {
        PyErr_Format(PyExc_TypeError, "put() takes 2 or 3 arguments (%zd given)", nargs);
        return NULL;
    }
    if (nargs == 3) {
        streams = PyLong_AsLong(args[2]);
        if (streams == -1 && PyErr_Occurred()) {
            return NULL;
        }
        if (streams & ~all) {
            PyErr_Format(PyExc_ValueError,
                         raw ? "streams must be a mask of 1 (python), 2 (numpy) and 4 (torch), got %ld"
                             : "streams must be a mask of 1 (python) and 2 (numpy), got %ld", streams);
            return NULL;
        }
    }
    if (!PyBytes_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "put() takes the bytes states() returned");
        return NULL;
    }
    Py_ssize_t k = PyLong_AsSsize_t(args[1]);
    if (k == -1 && PyErr_Occurred()) {
        return NULL;
    }
    Py_ssize_t n = PyBytes_GET_SIZE(args[0]) / stride;
    if (PyBytes_GET_SIZE(args[0]) % stride || k < 0 || k >= n) {
        PyErr_Format(PyExc_IndexError, "sample %zd is not in states of %zd bytes", k, PyBytes_GET_SIZE(args[0]));
        return NULL;
    }
    if (!configured()) {
        return NULL;
    }
    if ((streams & TORCH) && torch_engine == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "_seedkernel.configure_torch() was not given torch's layout");
        return NULL;
    }
    write_streams((const unsigned char *)PyBytes_AS_STRING(args[0]) + k * stride, streams);
    Py_RETURN_NONE;
}

RAW_FORM(put, put_states(args, nargs, 0), FASTCALL)

PyDoc_STRVAR(put_raw_doc, "put_raw(states, k, streams=7, /)\n--\n\n"
                          "Write sample k of states_raw() into python's (streams & 1), numpy's (streams & 2) and torch's\n"
                          "(streams & 4) generators. Python's cached gaussian is the caller's to clear.");

RAW_FORM(put_raw, put_states(args, nargs, 1), FASTCALL)

PyDoc_STRVAR(seed_doc, "seed(z, /)\n--\n\n"
                       "Seed python's and numpy's global generators from one sample seed, as states([z]) + put().\n"
                       "Python's cached gaussian is the caller's to clear.");

/* seed() (raw = 0) and seed_raw() (raw = 1: torch's too). */
static PyObject *
seed_one(PyObject *arg, int raw)
{
    uint64_t z;
    unsigned char sample[SAMPLE_RAW];
    if (read_seed(arg, &z) < 0 || !configured()) {
        return NULL;
    }
    if (raw && torch_engine == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "_seedkernel.configure_torch() was not given torch's layout");
        return NULL;
    }
    scalar_states(z, sample, NULL, 0, raw);
    write_streams(sample, raw ? PYTHON | NUMPY | TORCH : PYTHON | NUMPY);
    Py_RETURN_NONE;
}

RAW_FORM(seed, seed_one(arg, 0), PyObject *arg)

PyDoc_STRVAR(seed_raw_doc, "seed_raw(z, /)\n--\n\n"
                           "seed(z), and torch's generator as manual_seed(z) leaves it (configure_torch() first).\n"
                           "Python's cached gaussian is the caller's to clear.");

RAW_FORM(seed_raw, seed_one(arg, 1), PyObject *arg)

PyDoc_STRVAR(configure_torch_doc, "configure_torch(engine, /)\n--\n\n"
                                  "The checked address of torch.default_generator's engine (see _fastrng); 0 unsets it.\n"
                                  "capture() then takes torch's state too, and put_raw() and seed_raw() write it.");

static PyObject *
configure_torch(PyObject *Py_UNUSED(module), PyObject *arg)
{
    void *address = PyLong_AsVoidPtr(arg);
    if (address == NULL && PyErr_Occurred()) {
        return NULL;
    }
    torch_engine = address;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(configure_doc, "configure(python_state, numpy_state, numpy_aug, /)\n--\n\n"
                            "The checked addresses of the generators' raw states (see _fastrng); 0 unsets them.");

static PyObject *
configure(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    void *addresses[3];
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "configure() takes 3 arguments (%zd given)", nargs);
        return NULL;
    }
    for (int a = 0; a < 3; a++) {
        addresses[a] = PyLong_AsVoidPtr(args[a]);
        if (addresses[a] == NULL && PyErr_Occurred()) {
            return NULL;
        }
    }
    python_state = addresses[0];
    numpy_state = addresses[1];
    numpy_aug = addresses[2];
    Py_RETURN_NONE;
}

PyDoc_STRVAR(capture_doc, "capture()\n--\n\n"
                          "Python's and numpy's raw states, numpy's cached gaussian included, and torch's engine and\n"
                          "cached normals when configure_torch() gave them: bytes for restore().\n"
                          "Python's cached gaussian (random._inst.gauss_next) is the caller's to keep.");

static PyObject *
capture(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored))
{
    if (!configured()) {
        return NULL;
    }
    PyObject *result = PyBytes_FromStringAndSize(NULL, SAMPLE + AUG + (torch_engine != NULL ? RAW_SIZE : 0));
    if (result != NULL) {
        char *out = PyBytes_AS_STRING(result);
        memcpy(out, python_state, BLOCK);
        memcpy(out + BLOCK, numpy_state, BLOCK);
        memcpy(out + SAMPLE, numpy_aug, AUG);
        if (torch_engine != NULL) {
            memcpy(out + SAMPLE + AUG, torch_engine, RAW_SIZE);
        }
    }
    return result;
}

PyDoc_STRVAR(restore_doc, "restore(captured, /)\n--\n\n"
                          "Put back the states capture() returned.");

static PyObject *
restore(PyObject *Py_UNUSED(module), PyObject *captured)
{
    Py_ssize_t size = PyBytes_Check(captured) ? PyBytes_GET_SIZE(captured) : -1;
    if (size != SAMPLE + AUG && size != SAMPLE + AUG + RAW_SIZE) {
        PyErr_SetString(PyExc_TypeError, "restore() takes the bytes capture() returned");
        return NULL;
    }
    if (!configured()) {
        return NULL;
    }
    if (size > SAMPLE + AUG && torch_engine == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "restore() got torch's state, but configure_torch() unset it");
        return NULL;
    }
    const char *in = PyBytes_AS_STRING(captured);
    memcpy(python_state, in, BLOCK);
    memcpy(numpy_state, in + BLOCK, BLOCK);
    memcpy(numpy_aug, in + SAMPLE, AUG);
    if (size > SAMPLE + AUG) {
        memcpy(torch_engine, in + SAMPLE + AUG, RAW_SIZE);
    }
    Py_RETURN_NONE;
}

#define GOLDEN 0x9E3779B97F4A7C15ULL

PyDoc_STRVAR(item_seeds_doc, "item_seeds(pass_sample_seed, indices, /)\n--\n\n"
                             "lightning_repro.streams.item_seeds for int indices (exactly int): a list of ints.\n"
                             "TypeError for any other index: the caller falls back to streams.item_seeds.");

static PyObject *
item_seeds(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "item_seeds() takes 2 arguments (%zd given)", nargs);
        return NULL;
    }
    uint64_t base;
    if (read_seed(args[0], &base) < 0) {
        return NULL;
    }
    PyObject *fast = PySequence_Fast(args[1], "item_seeds() takes a sequence of indices");
    if (fast == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    PyObject *result = PyList_New(n);
    for (Py_ssize_t k = 0; result != NULL && k < n; k++) {
        if (!PyLong_CheckExact(items[k])) {
            PyErr_Format(PyExc_TypeError, "index %zd is a %.100s, not an int", k, Py_TYPE(items[k])->tp_name);
            Py_CLEAR(result);
            break;
        }
        uint64_t index = (uint64_t)PyLong_AsUnsignedLongLongMask(items[k]); /* modulo 2**64, as `& _MASK64` */
        if (index == (uint64_t)-1 && PyErr_Occurred()) {
            Py_CLEAR(result);
            break;
        }
        uint64_t z = base + (index + 1) * GOLDEN; /* streams.mix_seed: splitmix64's finalizer */
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
        PyObject *value = PyLong_FromUnsignedLongLong(z ^ (z >> 31));
        if (value == NULL) {
            Py_CLEAR(result);
            break;
        }
        PyList_SET_ITEM(result, k, value);
    }
    Py_DECREF(fast);
    return result;
}

static PyMethodDef methods[] = {
    {"states", (PyCFunction)(void (*)(void))states, METH_FASTCALL, states_doc},
    {"put", (PyCFunction)(void (*)(void))put, METH_FASTCALL, put_doc},
    {"seed", (PyCFunction)seed, METH_O, seed_doc},
    {"configure", (PyCFunction)(void (*)(void))configure, METH_FASTCALL, configure_doc},
    {"capture", (PyCFunction)capture, METH_NOARGS, capture_doc},
    {"restore", (PyCFunction)restore, METH_O, restore_doc},
    {"item_seeds", (PyCFunction)(void (*)(void))item_seeds, METH_FASTCALL, item_seeds_doc},
    {"states_raw", (PyCFunction)(void (*)(void))states_raw, METH_FASTCALL, states_raw_doc},
    {"put_raw", (PyCFunction)(void (*)(void))put_raw, METH_FASTCALL, put_raw_doc},
    {"seed_raw", (PyCFunction)seed_raw, METH_O, seed_raw_doc},
    {"configure_torch", (PyCFunction)configure_torch, METH_O, configure_torch_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    "lightning_repro.data._seedkernel",
    "Python's and numpy's seeded Mersenne Twister states, a batch of samples at a time (see _fastrng).",
    -1,
    methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC
PyInit__seedkernel(void)
{
    python_start[0] = 19650218U;
    for (int i = 1; i < MT_N; i++) {
        python_start[i] = 1812433253U * (python_start[i - 1] ^ (python_start[i - 1] >> 30)) + (uint32_t)i;
    }
    PyObject *module = PyModule_Create(&module_def);
    if (module != NULL && (PyModule_AddIntConstant(module, "SAMPLE_BYTES", SAMPLE) < 0 ||
                           PyModule_AddIntConstant(module, "TORCH_MIN_BYTES", TORCH_MIN) < 0 ||
                           PyModule_AddIntConstant(module, "SAMPLE_RAW_BYTES", SAMPLE_RAW) < 0 ||
                           PyModule_AddIntConstant(module, "TORCH_RAW_BYTES", RAW_SIZE) < 0)) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
