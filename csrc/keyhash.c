/* lmcache._keyhash: the native helpers of the key path (token ids -> chunk keys -> index probes).
 *
 * Optional CPython extension built by setup.py; every caller has a Python/numpy path that gives
 * the same results when it is missing (tests/keys/test_keyhash.py, tests/keys/test_key_ops.py).
 * Its eight entry points, by caller:
 *
 * Chunk hashing (lmcache/v1/token_database.py; off with LMCACHE_NATIVE_HASH=0):
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
 *   common_prefix(a, b) -> int
 *       Number of equal leading 4-byte items of two buffers (int32 token arrays): how much
 *       of a remembered sequence's digests a new one can reuse.
 *
 * Key hashing and equality (lmcache/v1/keys.py; off with LMCACHE_NATIVE_HASH=0 at import):
 *   KeyBase, register_key_type(cls, eq_fields, hash_fields)
 *       Base class of the key classes: __hash__ and __eq__ in C over the registered
 *       slots (see the section below).
 *
 * Token and slot scans (lmcache/v1/request.py; off with LMCACHE_NATIVE_SCANS=0):
 *   tokens_int32(tokens) -> bytearray | None
 *       An exact list/tuple of ints or a 1-D int64 buffer as little-endian int32, range
 *       checked in the same pass; None declines (the numpy path validates and raises).
 *   tokens_int32_at(address, n, itemsize) -> bytearray | None
 *       The same from n contiguous int32/int64 values at a tensor's data address.
 *   int_stats(address, n, itemsize) -> (max, index of the first negative or n)
 *       One pass over the first n > 0 values (slot-mapping checks).
 *
 * Resident-index probes (lmcache/v1/storage_backend/resident_index.py; always on when built):
 *   prefix_in(dict, keys, start=0) -> int
 *       Index of the first of keys[start:] that is not in dict (len(keys) if none): the
 *       resident indexes' prefix probe as one C loop.
 *
 * Thread: holds the GIL (it reads Python objects). Memory: digests is a new bytes object.
 * BLAKE2b follows RFC 7693 (unkeyed, 16-byte output).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>

/* ------------------------------------------------------------------ BLAKE2b-128 */

static const uint64_t B2_IV[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL, 0xa54ff53a5f1d36f1ULL,
    0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL, 0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL,
};

static inline uint64_t rotr64(uint64_t x, int n) { return (x >> n) | (x << (64 - n)); }

static inline uint64_t load64(const uint8_t *p) {
    uint64_t v; /* little-endian hosts only (checked at import) */
    memcpy(&v, p, 8);
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
    /* One macro per round with constant message indices (no table reads at run time). */
#define B2_ROUND(s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14, s15) \
    do {                                                                           \
        B2_G(0, 4, 8, 12, m[s0], m[s1]);                                            \
        B2_G(1, 5, 9, 13, m[s2], m[s3]);                                            \
        B2_G(2, 6, 10, 14, m[s4], m[s5]);                                           \
        B2_G(3, 7, 11, 15, m[s6], m[s7]);                                           \
        B2_G(0, 5, 10, 15, m[s8], m[s9]);                                           \
        B2_G(1, 6, 11, 12, m[s10], m[s11]);                                         \
        B2_G(2, 7, 8, 13, m[s12], m[s13]);                                          \
        B2_G(3, 4, 9, 14, m[s14], m[s15]);                                          \
    } while (0)
    B2_ROUND(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    B2_ROUND(14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3);
    B2_ROUND(11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4);
    B2_ROUND(7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8);
    B2_ROUND(9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13);
    B2_ROUND(2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9);
    B2_ROUND(12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11);
    B2_ROUND(13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10);
    B2_ROUND(6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5);
    B2_ROUND(10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0);
    B2_ROUND(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    B2_ROUND(14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3);
#undef B2_ROUND
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
        if ((size_t)(size + 1) <= 2) { /* every int has one digit allocated; size 0 ignores it */
            *out = (int32_t)size * (int32_t)((PyLongObject *)item)->ob_digit[0];
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

/* src -> dst as int32 in one branch-free pass (the compiler vectorises it); 0 when a value
 * does not fit int32 (dst is then garbage). */
static int narrow_i64(const int64_t *src, int32_t *dst, Py_ssize_t n) {
    int64_t lo = 0, hi = 0;
    for (Py_ssize_t i = 0; i < n; ++i) {
        int64_t v = src[i];
        lo = v < lo ? v : lo;
        hi = v > hi ? v : hi;
        dst[i] = (int32_t)v;
    }
    return lo >= INT32_MIN && hi <= INT32_MAX;
}

/* tokens_int32(tokens) -> bytearray of little-endian int32, or None (declined: the caller's
 * Python path validates and raises). Takes an exact list / tuple of exact ints, or a 1-D
 * C-contiguous buffer of int64 (a numpy array or a CPU tensor's numpy view); one pass that
 * checks the int32 range while it converts. */
static PyObject *tokens_int32(PyObject *self, PyObject *tokens) {
    (void)self;
    if (PyList_CheckExact(tokens) || PyTuple_CheckExact(tokens)) {
        PyObject **items = PySequence_Fast_ITEMS(tokens);
        Py_ssize_t n = PySequence_Fast_GET_SIZE(tokens);
        PyObject *out = PyByteArray_FromStringAndSize(NULL, 4 * n);
        if (out == NULL) return NULL;
        int32_t *dst = (int32_t *)PyByteArray_AS_STRING(out);
        for (Py_ssize_t i = 0; i < n; ++i) {
            if (!read_token(items[i], &dst[i])) {
                Py_DECREF(out);
                if (PyErr_Occurred()) PyErr_Clear();
                Py_RETURN_NONE;
            }
        }
        return out; /* little-endian hosts only (checked at import) */
    }
    Py_buffer view;
    if (PyObject_GetBuffer(tokens, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    const char *f = view.format ? view.format : "B";
    int is_i8 = view.itemsize == 8 && view.ndim == 1 &&
                (strcmp(f, "q") == 0 || strcmp(f, "<q") == 0 || strcmp(f, "=q") == 0 || strcmp(f, "l") == 0 ||
                 strcmp(f, "<l") == 0 || strcmp(f, "=l") == 0);
    if (!is_i8) {
        PyBuffer_Release(&view);
        Py_RETURN_NONE;
    }
    Py_ssize_t n = view.shape ? view.shape[0] : view.len / 8;
    PyObject *out = PyByteArray_FromStringAndSize(NULL, 4 * n);
    if (out == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    int fits = narrow_i64((const int64_t *)view.buf, (int32_t *)PyByteArray_AS_STRING(out), n);
    PyBuffer_Release(&view);
    if (!fits) {
        Py_DECREF(out);
        Py_RETURN_NONE;
    }
    return out;
}

/* The buffer behind a caller-validated tensor: n contiguous int32/int64 values at address
 * (torch's data_ptr() of a contiguous 1-D CPU tensor). Reading it directly skips building a
 * numpy view, which costs more than the scan itself when the interpreter's caches are cold. */
static int parse_int_buffer(PyObject *args, const char *fn, const void **buf, Py_ssize_t *n, int *itemsize) {
    unsigned long long addr;
    if (!PyArg_ParseTuple(args, "Kni", &addr, n, itemsize)) return 0;
    if (addr == 0 || *n < 0 || (*itemsize != 4 && *itemsize != 8)) {
        PyErr_Format(PyExc_ValueError, "%s: expected a non-null address, n >= 0 and itemsize 4 or 8", fn);
        return 0;
    }
    *buf = (const void *)(uintptr_t)addr;
    return 1;
}

/* tokens_int32_at(address, n, itemsize) -> bytearray of little-endian int32, or None when a
 * value does not fit int32 (the caller's Python path raises). */
static PyObject *tokens_int32_at(PyObject *self, PyObject *args) {
    (void)self;
    const void *buf;
    Py_ssize_t n;
    int itemsize;
    if (!parse_int_buffer(args, "tokens_int32_at", &buf, &n, &itemsize)) return NULL;
    PyObject *out = PyByteArray_FromStringAndSize(NULL, 4 * n);
    if (out == NULL) return NULL;
    int32_t *dst = (int32_t *)PyByteArray_AS_STRING(out);
    if (itemsize == 4) {
        memcpy(dst, buf, (size_t)(4 * n));
        return out;
    }
    if (!narrow_i64((const int64_t *)buf, dst, n)) {
        Py_DECREF(out);
        Py_RETURN_NONE;
    }
    return out;
}

/* int_stats(address, n, itemsize) -> (max, index of the first negative value or n), n > 0. */
static PyObject *int_stats(PyObject *self, PyObject *args) {
    (void)self;
    const void *buf;
    Py_ssize_t n;
    int itemsize;
    if (!parse_int_buffer(args, "int_stats", &buf, &n, &itemsize)) return NULL;
    if (n == 0) {
        PyErr_SetString(PyExc_ValueError, "int_stats: n must be positive");
        return NULL;
    }
    int64_t lo = INT64_MAX, hi = INT64_MIN;
    Py_ssize_t neg = n;
/* min/max in one branch-free pass (vectorised), then the first negative only if there is one */
#define LMC_SCAN(T)                                    \
    do {                                               \
        const T *v = (const T *)buf;                   \
        for (Py_ssize_t i = 0; i < n; ++i) {           \
            lo = v[i] < lo ? v[i] : lo;                \
            hi = v[i] > hi ? v[i] : hi;                \
        }                                              \
        if (lo < 0)                                    \
            for (neg = 0; v[neg] >= 0; ++neg) {        \
            }                                          \
    } while (0)
    if (itemsize == 8)
        LMC_SCAN(int64_t);
    else
        LMC_SCAN(int32_t);
#undef LMC_SCAN
    return Py_BuildValue("(Ln)", (long long)hi, neg);
}

/* common_prefix(a, b) -> number of equal leading 4-byte items of two byte buffers (int32
 * token arrays or their bytes), up to the shorter one. One memcmp-speed pass. */
static PyObject *common_prefix(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer a, b;
    if (!PyArg_ParseTuple(args, "y*y*", &a, &b)) return NULL;
    Py_ssize_t n = (a.len < b.len ? a.len : b.len) / 4, i = 0;
    const uint8_t *pa = (const uint8_t *)a.buf, *pb = (const uint8_t *)b.buf;
    while (i + 64 <= n && memcmp(pa + 4 * i, pb + 4 * i, 256) == 0) i += 64;
    while (i < n && memcmp(pa + 4 * i, pb + 4 * i, 4) == 0) ++i;
    PyBuffer_Release(&a);
    PyBuffer_Release(&b);
    return PyLong_FromSsize_t(i);
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
                memcpy(dst + 4 * i, &v, 4); /* little-endian hosts only (checked at import) */
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
        PyObject *h = _PyLong_FromByteArray(d + 16 * i, 16, 1, 0); /* little-endian unsigned */
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

/* ------------------------------------------------------------------ key hash / equality
 *
 * KeyBase: a base class without state whose __hash__ and __eq__ run in C, so that dict and
 * set probes with keys never call Python code. A key class registers which of its slots
 * equality compares and which the hash folds in (register_key_type); a subclass that is not
 * registered itself uses its nearest registered ancestor's fields (as Python methods
 * inherited from that ancestor would). Equality needs the same class on both sides
 * (NotImplemented otherwise). The hash is CPython's tuple hash of the hashed fields, i.e.
 * hash(key) == hash((field, ...)): the value the pure-Python keys compute. */

#define KEY_MAX_TYPES 16
#define KEY_MAX_FIELDS 8

typedef struct {
    PyTypeObject *type; /* strong reference */
    int n_eq, n_hash;
    Py_ssize_t eq_off[KEY_MAX_FIELDS];
    Py_ssize_t hash_off[KEY_MAX_FIELDS];
} KeySpec;

static KeySpec key_specs[KEY_MAX_TYPES];
static int key_nspecs;

static const KeySpec *key_spec_of(PyTypeObject *t) {
    for (; t != NULL; t = t->tp_base)
        for (int i = 0; i < key_nspecs; ++i)
            if (key_specs[i].type == t) return &key_specs[i];
    return NULL;
}

static inline PyObject *key_field(PyObject *self, Py_ssize_t off) {
    PyObject *v = *(PyObject **)((char *)self + off);
    if (v == NULL) PyErr_SetString(PyExc_AttributeError, "cache key field is not set");
    return v;
}

#if SIZEOF_PY_UHASH_T > 4
#define KH_PRIME_1 ((Py_uhash_t)11400714785074694791ULL)
#define KH_PRIME_2 ((Py_uhash_t)14029467366897019727ULL)
#define KH_PRIME_5 ((Py_uhash_t)2870177450012600261ULL)
#define KH_ROTATE(x) ((x << 31) | (x >> 33))
#else
#define KH_PRIME_1 ((Py_uhash_t)2654435761UL)
#define KH_PRIME_2 ((Py_uhash_t)2246822519UL)
#define KH_PRIME_5 ((Py_uhash_t)374761393UL)
#define KH_ROTATE(x) ((x << 13) | (x >> 19))
#endif

static Py_hash_t key_hash(PyObject *self) {
    const KeySpec *spec = key_spec_of(Py_TYPE(self));
    if (spec == NULL) {
        PyErr_Format(PyExc_TypeError, "%s: key class not registered with lmcache._keyhash", Py_TYPE(self)->tp_name);
        return -1;
    }
    Py_uhash_t acc = KH_PRIME_5;
    for (int i = 0; i < spec->n_hash; ++i) {
        PyObject *v = key_field(self, spec->hash_off[i]);
        if (v == NULL) return -1;
        Py_INCREF(v);
        Py_hash_t lane = PyObject_Hash(v);
        Py_DECREF(v);
        if (lane == -1) return -1;
        acc += (Py_uhash_t)lane * KH_PRIME_2;
        acc = KH_ROTATE(acc);
        acc *= KH_PRIME_1;
    }
    acc += (Py_uhash_t)spec->n_hash ^ (KH_PRIME_5 ^ 3527539UL);
    if (acc == (Py_uhash_t)-1) return 1546275796;
    return (Py_hash_t)acc;
}

static PyObject *key_richcompare(PyObject *a, PyObject *b, int op) {
    if ((op != Py_EQ && op != Py_NE) || Py_TYPE(a) != Py_TYPE(b)) Py_RETURN_NOTIMPLEMENTED;
    int same = 1;
    if (a != b) {
        const KeySpec *spec = key_spec_of(Py_TYPE(a));
        if (spec == NULL) Py_RETURN_NOTIMPLEMENTED;
        for (int i = 0; i < spec->n_eq && same; ++i) {
            PyObject *x = key_field(a, spec->eq_off[i]);
            PyObject *y = x ? key_field(b, spec->eq_off[i]) : NULL;
            if (y == NULL) return NULL;
            Py_INCREF(x); /* held across a comparison that may run Python code */
            Py_INCREF(y);
            int r = PyObject_RichCompareBool(x, y, Py_EQ);
            Py_DECREF(x);
            Py_DECREF(y);
            if (r < 0) return NULL;
            same = r;
        }
    }
    return PyBool_FromLong(op == Py_EQ ? same : !same);
}

static PyType_Slot key_base_slots[] = {
    {Py_tp_doc, "Stateless base of the cache key classes: __hash__ and __eq__ in C (see register_key_type)."},
    {Py_tp_hash, key_hash},
    {Py_tp_richcompare, key_richcompare},
    {0, NULL},
};

static PyType_Spec key_base_spec = {"lmcache._keyhash.KeyBase", sizeof(PyObject), 0,
                                    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE, key_base_slots};

/* Offsets of the object slots named by member descriptors `descrs` of `cls`; -1 on error. */
static int key_offsets(PyTypeObject *cls, PyObject *descrs, Py_ssize_t *out, const char *what) {
    if (!PyTuple_Check(descrs) || PyTuple_GET_SIZE(descrs) < 1 || PyTuple_GET_SIZE(descrs) > KEY_MAX_FIELDS) {
        PyErr_Format(PyExc_ValueError, "register_key_type: %s must be a tuple of 1 to %d slot descriptors", what,
                     KEY_MAX_FIELDS);
        return -1;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(descrs); ++i) {
        PyObject *d = PyTuple_GET_ITEM(descrs, i);
        if (!PyObject_TypeCheck(d, &PyMemberDescr_Type)) {
            PyErr_Format(PyExc_ValueError, "register_key_type: %s[%zd] is not a slot descriptor", what, i);
            return -1;
        }
        PyMemberDescrObject *md = (PyMemberDescrObject *)d;
        if (md->d_member->type != T_OBJECT_EX || !PyType_IsSubtype(cls, PyDescr_TYPE(d))) {
            PyErr_Format(PyExc_ValueError, "register_key_type: %s[%zd] is not an object slot of %s", what, i,
                         cls->tp_name);
            return -1;
        }
        out[i] = md->d_member->offset;
    }
    return (int)PyTuple_GET_SIZE(descrs);
}

static PyObject *register_key_type(PyObject *self, PyObject *args) {
    PyTypeObject *cls;
    PyObject *eq, *hashed;
    if (!PyArg_ParseTuple(args, "O!OO", &PyType_Type, &cls, &eq, &hashed)) return NULL;
    PyObject *base = PyObject_GetAttrString(self, "KeyBase");
    if (base == NULL) return NULL;
    int sub = PyType_IsSubtype(cls, (PyTypeObject *)base);
    Py_DECREF(base);
    if (!sub) {
        PyErr_Format(PyExc_TypeError, "register_key_type: %s does not derive from KeyBase", cls->tp_name);
        return NULL;
    }
    KeySpec spec;
    memset(&spec, 0, sizeof spec);
    if ((spec.n_eq = key_offsets(cls, eq, spec.eq_off, "eq_fields")) < 0) return NULL;
    if ((spec.n_hash = key_offsets(cls, hashed, spec.hash_off, "hash_fields")) < 0) return NULL;
    int slot = key_nspecs;
    for (int i = 0; i < key_nspecs; ++i)
        if (key_specs[i].type == cls) slot = i;
    if (slot == KEY_MAX_TYPES) {
        PyErr_SetString(PyExc_RuntimeError, "register_key_type: too many key classes");
        return NULL;
    }
    Py_INCREF(cls);
    spec.type = cls;
    if (slot < key_nspecs) Py_DECREF(key_specs[slot].type);
    key_specs[slot] = spec;
    if (slot == key_nspecs) ++key_nspecs;
    Py_RETURN_NONE;
}

/* Number of leading items of a list/tuple `keys` (from index `start` on) that are keys of
 * dict `mapping`, plus start: the index of the first absent one. */
static PyObject *prefix_in(PyObject *self, PyObject *args) {
    PyObject *mapping, *keys;
    Py_ssize_t start = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "O!O|n", &PyDict_Type, &mapping, &keys, &start)) return NULL;
    if (!PyList_CheckExact(keys) && !PyTuple_CheckExact(keys)) {
        PyErr_SetString(PyExc_TypeError, "prefix_in: keys must be a list or a tuple");
        return NULL;
    }
    if (start < 0) start = 0;
    if (start > PySequence_Fast_GET_SIZE(keys)) start = PySequence_Fast_GET_SIZE(keys);
    Py_ssize_t i = start;
    /* a list is re-read every step: a __hash__/__eq__ of a foreign key may run Python code */
    while (i < PySequence_Fast_GET_SIZE(keys)) {
        PyObject *key = PySequence_Fast_GET_ITEM(keys, i);
        Py_INCREF(key);
        int r = PyDict_Contains(mapping, key);
        Py_DECREF(key);
        if (r < 0) return NULL;
        if (!r) break;
        ++i;
    }
    return PyLong_FromSsize_t(i);
}

static PyMethodDef methods[] = {
    {"hash_chunks", hash_chunks, METH_VARARGS, "(tokens, seed, chunk_size, partial) -> (n, digests) or None"},
    {"tokens_int32", tokens_int32, METH_O, "(tokens) -> bytearray of little-endian int32, or None (declined)"},
    {"tokens_int32_at", tokens_int32_at, METH_VARARGS,
     "(address, n, itemsize) -> bytearray of little-endian int32 from a contiguous int32/int64 buffer, or None"},
    {"int_stats", int_stats, METH_VARARGS, "(address, n, itemsize) -> (max, first negative index or n), n > 0"},
    {"common_prefix", common_prefix, METH_VARARGS, "(a, b) -> equal leading 4-byte items of two buffers"},
    {"make_keys", make_keys, METH_VARARGS, "(key_type, fields, hash_field, digests, first) -> list of keys"},
    {"register_key_type", register_key_type, METH_VARARGS,
     "(cls, eq_fields, hash_fields): slot descriptors compared by KeyBase.__eq__ / folded in by KeyBase.__hash__"},
    {"prefix_in", prefix_in, METH_VARARGS, "(dict, keys, start=0) -> index of the first key (from start) not in dict"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_keyhash",
                                    "Native helpers of lmcache's key path (hashing, key ops, token scans).", -1,
                                    methods};

PyMODINIT_FUNC PyInit__keyhash(void) {
    const uint16_t probe = 1;
    if (*(const uint8_t *)&probe != 1) {
        PyErr_SetString(PyExc_ImportError, "lmcache._keyhash: big-endian host (the Python path is used)");
        return NULL;
    }
    PyObject *mod = PyModule_Create(&module);
    if (mod == NULL) return NULL;
    PyObject *base = PyType_FromSpec(&key_base_spec);
    if (base == NULL || PyModule_AddObject(mod, "KeyBase", base) != 0) {
        Py_XDECREF(base);
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
