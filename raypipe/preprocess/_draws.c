/* One sample's random-resized-crop plan, drawn as raypipe.preprocess.augment.plan draws
 * it from sample_rng(seed, epoch, key) = Generator(PCG64([seed, epoch, key])), in one
 * call: NumPy's SeedSequence and PCG64 seeding, then the same draws (uniform, integers,
 * random) with NumPy's arithmetic, bit for bit. augment.sample_plan calls it for
 * seed, epoch and key below 2**32, once augment has checked at import that it gives
 * NumPy's plans on this machine; else, and without this module, it draws through NumPy.
 *
 * Sources of the arithmetic: numpy/random/bit_generator.pyx (SeedSequence),
 * numpy/random/src/pcg64 (seeding, next64, the buffered next32),
 * numpy/random/src/distributions (next_double, random_uniform, the buffered Lemire
 * bounded integers of Generator.integers for ranges below 2**32).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>

typedef unsigned __int128 u128;

/* SeedSequence */
#define INIT_A 0x43b0d7e5u
#define MULT_A 0x931e8875u
#define INIT_B 0x8b51f9ddu
#define MULT_B 0x58f38dedu
#define MIX_MULT_L 0xca01f9ddu
#define MIX_MULT_R 0x4973f715u
#define POOL 4

static uint32_t hashmix(uint32_t value, uint32_t *hash_const) {
    value ^= *hash_const;
    *hash_const *= MULT_A;
    value *= *hash_const;
    return value ^ (value >> 16);
}

static uint32_t mix(uint32_t x, uint32_t y) {
    uint32_t r = MIX_MULT_L * x - MIX_MULT_R * y;
    return r ^ (r >> 16);
}

/* PCG64 (XSL RR 128/64) and the Generator's use of it */
struct pcg {
    u128 state, inc;
    int has_uint32;
    uint32_t uinteger;
};

#define PCG_MULT (((u128)0x2360ed051fc65da4ull << 64) | 0x4385df649fccf645ull)

static uint64_t next64(struct pcg *g) {
    g->state = g->state * PCG_MULT + g->inc;
    uint64_t x = (uint64_t)(g->state >> 64) ^ (uint64_t)g->state;
    unsigned rot = (unsigned)(g->state >> 122);
    return (x >> rot) | (x << ((-rot) & 63));
}

static uint32_t next32(struct pcg *g) {
    if (g->has_uint32) {
        g->has_uint32 = 0;
        return g->uinteger;
    }
    uint64_t next = next64(g);
    g->has_uint32 = 1;
    g->uinteger = (uint32_t)(next >> 32);
    return (uint32_t)next;
}

static double next_double(struct pcg *g) {
    return (double)(next64(g) >> 11) * (1.0 / 9007199254740992.0);
}

static double uniform(struct pcg *g, double low, double high) {
    double range = high - low;
    return low + range * next_double(g);
}

/* Generator.integers(0, n) for 1 <= n <= 2**32: 0 without a draw when n == 1 */
static uint32_t below(struct pcg *g, uint32_t n) {
    uint32_t rng = n - 1;
    if (rng == 0) return 0;
    if (rng == 0xFFFFFFFFu) return next32(g);
    uint32_t excl = rng + 1;
    uint64_t m = (uint64_t)next32(g) * excl;
    uint32_t leftover = (uint32_t)m;
    if (leftover < excl) {
        uint32_t threshold = (UINT32_MAX - rng) % excl;
        while (leftover < threshold) {
            m = (uint64_t)next32(g) * excl;
            leftover = (uint32_t)m;
        }
    }
    return (uint32_t)(m >> 32);
}

/* PCG64(SeedSequence([seed, epoch, key])), each below 2**32 */
static void seeded(struct pcg *g, uint32_t seed, uint32_t epoch, uint32_t key) {
    uint32_t entropy[POOL] = {seed, epoch, key, 0}, pool[POOL], hash_const = INIT_A;
    for (int i = 0; i < POOL; i++) pool[i] = hashmix(entropy[i], &hash_const);
    for (int src = 0; src < POOL; src++)
        for (int dst = 0; dst < POOL; dst++)
            if (src != dst) pool[dst] = mix(pool[dst], hashmix(pool[src], &hash_const));
    uint32_t words[8];
    hash_const = INIT_B;
    for (int i = 0; i < 8; i++) {
        uint32_t v = pool[i % POOL] ^ hash_const;
        hash_const *= MULT_B;
        v *= hash_const;
        words[i] = v ^ (v >> 16);
    }
    uint64_t w[4];
    for (int i = 0; i < 4; i++) w[i] = (uint64_t)words[2 * i] | ((uint64_t)words[2 * i + 1] << 32);
    u128 initstate = ((u128)w[0] << 64) | w[1], initseq = ((u128)w[2] << 64) | w[3];
    g->inc = (initseq << 1) | 1;
    g->state = (g->inc + initstate) * PCG_MULT + g->inc;
    g->has_uint32 = 0;
    g->uinteger = 0;
}

/* Python's round() of a float: half to even, as nearbyint in the default rounding mode */
static long long pyround(double x) { return (long long)nearbyint(x); }

static PyObject *rrc(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 10)
        return PyErr_Format(PyExc_TypeError, "rrc takes 10 arguments, not %zd", nargs);
    unsigned long long ids[3];
    for (int i = 0; i < 3; i++) {
        ids[i] = PyLong_AsUnsignedLongLong(args[i]);
        if (ids[i] == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
        if (ids[i] > 0xFFFFFFFFull)
            return PyErr_Format(PyExc_ValueError, "seed, epoch and key must be below 2**32");
    }
    long width = PyLong_AsLong(args[3]), height = PyLong_AsLong(args[4]);
    double s0 = PyFloat_AsDouble(args[5]), s1 = PyFloat_AsDouble(args[6]);
    double r0 = PyFloat_AsDouble(args[7]), r1 = PyFloat_AsDouble(args[8]);
    int flip = PyObject_IsTrue(args[9]);
    if (PyErr_Occurred() || flip < 0) return NULL;
    if (width < 1 || height < 1 || width > 0xFFFFFFFFL || height > 0xFFFFFFFFL)
        return PyErr_Format(PyExc_ValueError, "image size %ldx%ld", width, height);

    struct pcg g;
    seeded(&g, (uint32_t)ids[0], (uint32_t)ids[1], (uint32_t)ids[2]);
    double area = (double)((long long)width * height), lr0 = log(r0), lr1 = log(r1);
    long long left = -1, top = 0, w = 0, h = 0;
    for (int attempt = 0; attempt < 10; attempt++) {
        double target = area * uniform(&g, s0, s1);
        double aspect = exp(uniform(&g, lr0, lr1));
        w = pyround(sqrt(target * aspect));
        h = pyround(sqrt(target / aspect));
        if (0 < w && w <= width && 0 < h && h <= height) {
            top = below(&g, (uint32_t)(height - h + 1));
            left = below(&g, (uint32_t)(width - w + 1));
            break;
        }
    }
    if (left < 0) { /* no attempt fitted: the centre crop at the nearest allowed ratio */
        double in_ratio = (double)width / (double)height;
        if (in_ratio < r0) {
            w = width;
            h = pyround((double)width / r0);
            if (h < 1) h = 1; /* a thin image far from the ratio: a pixel at least */
        } else if (in_ratio > r1) {
            w = pyround((double)height * r1);
            if (w < 1) w = 1;
            h = height;
        } else {
            w = width;
            h = height;
        }
        left = (width - w) >= 0 ? (width - w) / 2 : -((w - width + 1) / 2);
        top = (height - h) >= 0 ? (height - h) / 2 : -((h - height + 1) / 2);
    }
    int flipped = flip && next_double(&g) < 0.5;
    return Py_BuildValue("(LLLLO)", left, top, w, h, flipped ? Py_True : Py_False);
}

static PyMethodDef methods[] = {
    {"rrc", (PyCFunction)(void (*)(void))rrc, METH_FASTCALL,
     "rrc(seed, epoch, key, width, height, scale0, scale1, ratio0, ratio1, flip)\n"
     "-> (left, top, width, height, flipped)\n\n"
     "augment.plan(width, height, train=True, ...) drawn from sample_rng(seed, epoch, key),\n"
     "bit for bit; seed, epoch and key below 2**32."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_draws",
    "A sample's crop plan from its seeded stream (see raypipe.preprocess.augment).", -1,
    methods,
};

PyMODINIT_FUNC PyInit__draws(void) { return PyModule_Create(&module); }
