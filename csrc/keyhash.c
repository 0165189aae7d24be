/* lmcache._keyhash: chained chunk hashes of a token sequence in one native pass.
 *
 * Optional CPython extension built by setup.py; lmcache/v1/token_database.py falls back to
 * hashlib when it is missing and both produce identical keys (tests/v1/test_keyhash.py).
 *
 *   hash_chunks(tokens, seed, chunk_size, partial) -> (num_tokens, digests) | None
 *       tokens: a list or tuple of Python ints, or a C-contiguous 1-D buffer of
 *       little-endian int32 (numpy "<i4"). Chunk i's digest is
 *       BLAKE2b-128(digest_{i-1} || tokens[i*C:(i+1)*C] as int32 LE), digest_{-1} = seed.
 *       A trailing partial chunk is hashed only when partial is true. Returns None (the
 *       caller then takes the validating Python path) when an item is not an exact int,
 *       an int is outside int32, or the buffer is not int32: this module never decides
 *       what is an error.
 *   make_keys(key_type, fields, hash_field, digests, first) -> list
 *       One key_type instance per 16-byte digest from index first on: allocated with
 *       tp_alloc and filled through the slot descriptors, fields being ((descriptor,
 *       value), ...) shared by every key, hash_field the descriptor that receives the
 *       digest as a little-endian unsigned int. The caller passes already-normalised
 *       values (the same the dataclass __init__ would store).
 *
 * Thread: holds the GIL (it reads Python objects). Memory: digests is a new bytes object.
 * BLAKE2b follows RFC 7693 (unkeyed, 16-byte output).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* ------------------------------------------------------------------ BLAKE2b-128 */

static const uint64_t B2_IV[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL, 0xa54ff53a5f1d36f1ULL,
    0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL, 0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL,
};

static const uint8_t B2_SIGMA[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
};

static inline uint64_t rotr64(uint64_t x, int n) { return (x >> n) | (x << (64 - n)); }

static inline uint64_t load64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
    return v;
}

#define B2_G(a, b, c, d, x, y)          \
    do {                                \
        v[a] = v[a] + v[b] + (x);       \
        v[d] = rotr64(v[d] ^ v[a], 32); \
        v[c] = v[c] + v[d];             \
        v[b] = rotr64(v[b] ^ v[c], 24); \
        v[a] = v[a] + v[b] + (y);       \
        v[d] = rotr64(v[d] ^ v[a], 16); \
        v[c] = v[c] + v[d];             \
        v[b] = rotr64(v[b] ^ v[c], 63); \
    } while (0)

static void b2_compress(uint64_t h[8], const uint8_t block[128], uint64_t counter, int last) {
    uint64_t m[16], v[16];
    for (int i = 0; i < 16; ++i) m[i] = load64(block + 8 * i);
    for (int i = 0; i < 8; ++i) {
        v[i] = h[i];
        v[i + 8] = B2_IV[i];
    }
    v[12] ^= counter; /* inputs here are far below 2^64 bytes: the high counter word stays 0 */
    if (last) v[14] = ~v[14];
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC unroll 12
#endif
    for (int r = 0; r < 12; ++r) {
        const uint8_t *s = B2_SIGMA[r]; /* fully unrolled: constant message indices */
        B2_G(0, 4, 8, 12, m[s[0]], m[s[1]]);
        B2_G(1, 5, 9, 13, m[s[2]], m[s[3]]);
        B2_G(2, 6, 10, 14, m[s[4]], m[s[5]]);
        B2_G(3, 7, 11, 15, m[s[6]], m[s[7]]);
        B2_G(0, 5, 10, 15, m[s[8]], m[s[9]]);
        B2_G(1, 6, 11, 12, m[s[10]], m[s[11]]);
        B2_G(2, 7, 8, 13, m[s[12]], m[s[13]]);
        B2_G(3, 4, 9, 14, m[s[14]], m[s[15]]);
    }
    for (int i = 0; i < 8; ++i) h[i] ^= v[i] ^ v[i + 8];
}

/* BLAKE2b with a 16-byte digest of data[0:len] (unkeyed). */
static void b2_128(const uint8_t *data, size_t len, uint8_t out[16]) {
    uint64_t h[8];
    memcpy(h, B2_IV, sizeof h);
    h[0] ^= 0x01010000ULL ^ 16ULL; /* depth 1, fanout 1, no key, 16-byte output */
    size_t done = 0;
    while (len - done > 128) {
        done += 128;
        b2_compress(h, data + done - 128, (uint64_t)done, 0);
    }
    uint8_t last[128];
    memset(last, 0, sizeof last);
    memcpy(last, data + done, len - done);
    b2_compress(h, last, (uint64_t)len, 1);
    for (int i = 0; i < 16; ++i) out[i] = (uint8_t)(h[i / 8] >> (8 * (i % 8)));
}

/* ------------------------------------------------------------------ token reading */

static inline void store_le32(uint8_t *p, int32_t v) {
    uint32_t u = (uint32_t)v;
    p[0] = (uint8_t)u;
    p[1] = (uint8_t)(u >> 8);
    p[2] = (uint8_t)(u >> 16);
    p[3] = (uint8_t)(u >> 24);
}

/* Token items[i] as int32 into *out; 0 = declined (not an exact int or out of range). */
static inline int read_token(PyObject *item, int32_t *out) {
    if (!PyLong_CheckExact(item)) return 0; /* bool, numpy scalars, subclasses: Python path */
#if PY_VERSION_HEX >= 0x030C0000
    if (PyUnstable_Long_IsCompact((PyLongObject *)item)) {
        Py_ssize_t c = PyUnstable_Long_CompactValue((PyLongObject *)item); /* |c| < 2^30: fits */
        *out = (int32_t)c;
        return 1;
    }
#elif PY_VERSION_HEX >= 0x030B0000
    {
        /* CPython 3.11 layout: a size of -1/0/1 holds one 30-bit digit (|v| < 2^30). */
        Py_ssize_t size = Py_SIZE(item);
        if (size >= -1 && size <= 1) {
            int32_t d = size == 0 ? 0 : (int32_t)((PyLongObject *)item)->ob_digit[0];
            *out = size < 0 ? -d : d;
            return 1;
        }
    }
#endif
    int overflow = 0;
    long v = PyLong_AsLongAndOverflow(item, &overflow);
    if (overflow || v < INT32_MIN || v > INT32_MAX) return 0;
    *out = (int32_t)v;
    return 1;
}

static PyObject *hash_chunks(PyObject *self, PyObject *args) {
    PyObject *tokens;
    Py_buffer seed;
    Py_ssize_t chunk;
    int partial;
    (void)self;
    if (!PyArg_ParseTuple(args, "Oy*np", &tokens, &seed, &chunk, &partial)) return NULL;
    if (seed.len != 16 || chunk <= 0 || chunk > (PY_SSIZE_T_MAX - 16) / 4) {
        PyBuffer_Release(&seed);
        PyErr_SetString(PyExc_ValueError, "hash_chunks: seed must be 16 bytes and chunk_size positive");
        return NULL;
    }
    PyObject **items = NULL;
    const uint8_t *raw = NULL;
    Py_buffer view;
    int have_view = 0;
    Py_ssize_t n;
    if (PyList_CheckExact(tokens) || PyTuple_CheckExact(tokens)) {
        items = PySequence_Fast_ITEMS(tokens);
        n = PySequence_Fast_GET_SIZE(tokens);
    } else {
        if (PyObject_GetBuffer(tokens, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) {
            PyErr_Clear();
            PyBuffer_Release(&seed);
            Py_RETURN_NONE;
        }
        have_view = 1;
        const char *f = view.format ? view.format : "B";
        int is_i4 = view.itemsize == 4 && view.ndim == 1 &&
                    (strcmp(f, "i") == 0 || strcmp(f, "<i") == 0 || strcmp(f, "=i") == 0 || strcmp(f, "l") == 0);
        if (!is_i4) {
            PyBuffer_Release(&view);
            PyBuffer_Release(&seed);
            Py_RETURN_NONE;
        }
        raw = (const uint8_t *)view.buf;
        n = view.shape ? view.shape[0] : view.len / 4;
    }
    Py_ssize_t nchunks = n / chunk + ((partial && n % chunk) ? 1 : 0);
    PyObject *digests = PyBytes_FromStringAndSize(NULL, nchunks * 16);
    uint8_t *scratch = digests ? (uint8_t *)PyMem_Malloc((size_t)(16 + 4 * chunk)) : NULL;
    if (digests == NULL || scratch == NULL) {
        Py_XDECREF(digests);
        if (have_view) PyBuffer_Release(&view);
        PyBuffer_Release(&seed);
        return PyErr_NoMemory();
    }
    uint8_t *out = (uint8_t *)PyBytes_AS_STRING(digests);
    memcpy(scratch, seed.buf, 16);
    PyBuffer_Release(&seed);
    int declined = 0;
    for (Py_ssize_t c = 0; c < nchunks && !declined; ++c) {
        Py_ssize_t start = c * chunk;
        Py_ssize_t len = n - start < chunk ? n - start : chunk;
        uint8_t *dst = scratch + 16;
        if (items != NULL) {
            for (Py_ssize_t i = 0; i < len; ++i) {
                int32_t v;
                if (!read_token(items[start + i], &v)) {
                    declined = 1;
                    break;
                }
                store_le32(dst + 4 * i, v);
            }
        } else {
            memcpy(dst, raw + 4 * start, (size_t)(4 * len)); /* little-endian hosts only (checked at import) */
        }
        if (declined) break;
        b2_128(scratch, (size_t)(16 + 4 * len), out + 16 * c);
        memcpy(scratch, out + 16 * c, 16);
    }
    /* Tokens after the last hashed chunk must still be valid for identical behaviour. */
    if (!declined && items != NULL) {
        for (Py_ssize_t i = nchunks * chunk; i < n; ++i) {
            int32_t v;
            if (!read_token(items[i], &v)) {
                declined = 1;
                break;
            }
        }
    }
    PyMem_Free(scratch);
    if (have_view) PyBuffer_Release(&view);
    if (declined) {
        Py_DECREF(digests);
        Py_RETURN_NONE;
    }
    PyObject *res = Py_BuildValue("(nN)", n, digests);
    return res;
}

static PyObject *make_keys(PyObject *self, PyObject *args) {
    PyTypeObject *type;
    PyObject *fields, *hash_field;
    Py_buffer digests;
    Py_ssize_t first;
    (void)self;
    if (!PyArg_ParseTuple(args, "O!O!Oy*n", &PyType_Type, &type, &PyTuple_Type, &fields, &hash_field, &digests,
                          &first))
        return NULL;
    descrsetfunc hset = Py_TYPE(hash_field)->tp_descr_set;
    Py_ssize_t nf = PyTuple_GET_SIZE(fields);
    int ok = hset != NULL && digests.len % 16 == 0 && first >= 0;
    for (Py_ssize_t j = 0; ok && j < nf; ++j) {
        PyObject *pair = PyTuple_GET_ITEM(fields, j);
        ok = PyTuple_Check(pair) && PyTuple_GET_SIZE(pair) == 2 &&
             Py_TYPE(PyTuple_GET_ITEM(pair, 0))->tp_descr_set != NULL;
    }
    if (!ok) {
        PyBuffer_Release(&digests);
        PyErr_SetString(PyExc_ValueError, "make_keys: expected slot descriptors and 16-byte digests");
        return NULL;
    }
    Py_ssize_t count = digests.len / 16 - first;
    if (count < 0) count = 0;
    PyObject *list = PyList_New(count);
    if (list == NULL) {
        PyBuffer_Release(&digests);
        return NULL;
    }
    const uint8_t *d = (const uint8_t *)digests.buf + 16 * first;
    for (Py_ssize_t i = 0; i < count; ++i) {
        PyObject *obj = type->tp_alloc(type, 0);
        if (obj == NULL) goto fail;
        PyList_SET_ITEM(list, i, obj);
        for (Py_ssize_t j = 0; j < nf; ++j) {
            PyObject *pair = PyTuple_GET_ITEM(fields, j);
            PyObject *descr = PyTuple_GET_ITEM(pair, 0);
            if (Py_TYPE(descr)->tp_descr_set(descr, obj, PyTuple_GET_ITEM(pair, 1)) != 0) goto fail;
        }
        uint64_t lo = 0, hi = 0;
        for (int b = 7; b >= 0; --b) {
            lo = (lo << 8) | d[16 * i + b];
            hi = (hi << 8) | d[16 * i + 8 + b];
        }
        PyObject *h;
        if (hi == 0) {
            h = PyLong_FromUnsignedLongLong(lo);
        } else {
            PyObject *ph = PyLong_FromUnsignedLongLong(hi), *pl = PyLong_FromUnsignedLongLong(lo);
            PyObject *sh = PyLong_FromLong(64);
            PyObject *shifted = (ph && sh) ? PyNumber_Lshift(ph, sh) : NULL;
            h = (shifted && pl) ? PyNumber_Or(shifted, pl) : NULL;
            Py_XDECREF(ph);
            Py_XDECREF(pl);
            Py_XDECREF(sh);
            Py_XDECREF(shifted);
        }
        if (h == NULL) goto fail;
        int rc = hset(hash_field, obj, h);
        Py_DECREF(h);
        if (rc != 0) goto fail;
    }
    PyBuffer_Release(&digests);
    return list;
fail:
    PyBuffer_Release(&digests);
    Py_DECREF(list);
    return NULL;
}

static PyMethodDef methods[] = {
    {"hash_chunks", hash_chunks, METH_VARARGS, "(tokens, seed, chunk_size, partial) -> (n, digests) or None"},
    {"make_keys", make_keys, METH_VARARGS, "(key_type, fields, hash_field, digests, first) -> list of keys"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_keyhash", "Native chunk hashing for lmcache keys.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__keyhash(void) {
    const uint16_t probe = 1;
    if (*(const uint8_t *)&probe != 1) {
        PyErr_SetString(PyExc_ImportError, "lmcache._keyhash: big-endian host (the Python path is used)");
        return NULL;
    }
    return PyModule_Create(&module);
}
