/* bistat.engines.embedded._rowgemm: the embedded engine's batch-invariant float32 GEMM.
 *
 *     out[i, j] = fma(x[i, K-1], w[K-1, j], ... fma(x[i, 1], w[1, j], fma(x[i, 0], w[0, j], 0.0f)))
 *
 * Every output element is ONE chain of K fused multiply-adds in the order k = 0, 1, ..., K-1,
 * started from +0.0f, each rounded once to float32 (IEEE 754 fusedMultiplyAdd, roundTiesToEven).
 * Nothing else touches the value: no partial sums, no second accumulator, no alpha/beta, no
 * K-blocking. So the bits of out[i, j] are a function of x[i, :] and w[:, j] alone. Which kernel
 * computes the element (how many rows or panels it handles at once), which vector lane it sits in
 * (8-wide AVX2, 16-wide AVX-512 or the scalar fmaf of the portable path), which thread runs it,
 * and how many other rows share the call cannot change them: each of those paths issues the same
 * K fma operations on the same operands in the same order, and vector FMA instructions are lane-wise
 * IEEE fma (Intel SDM, VFMADD231PS: "... performs a set of SIMD multiply-add computation ... with a
 * single rounding"; C11 7.12.13.1 fmaf: "rounded as one ternary operation").
 *
 * The weight [K, N] is packed once (rowgemm_pack) into panels of 16 columns: panel q holds columns
 * 16q .. 16q+15 as K consecutive rows of 16 floats (the last panel zero-padded), so a kernel reads a
 * panel as one contiguous stream, as BLAS packs its operand on every call. Packing copies values
 * and so cannot change them.
 *
 * Work is shared by panels: the caller and the pool's worker threads take chunks of panels from
 * one counter until none is left; a chunk's columns are computed whole by whichever thread took
 * it, so the split (and a descheduled worker, whose share the caller then takes) changes timing
 * only. Floating-point environment (rounding mode, and on x86 MXCSR's flush-to-zero and
 * denormals-are-zero bits): a worker computes every chunk of a job in the caller's environment,
 * taken when the job is published (fegetenv / fesetenv), so a chunk's bits cannot depend on which
 * thread took it. Under the default environment (round to nearest even, no flushing) the chain
 * above is exactly what is computed.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <fenv.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define ROWGEMM_X86 1
#define CPU_RELAX() _mm_pause()
#else
#define ROWGEMM_X86 0
#define CPU_RELAX() ((void)0)
#endif

#define PANEL 16 /* columns per packed panel */
#define MAX_THREADS 64

typedef ptrdiff_t idx;

/* One GEMM: x [m, k] (row stride k) times the packed weight (npanels panels) into out [m, ldo]. */
typedef struct {
    const float *x;
    const float *wp;
    float *out;
    idx m, k, n, ldo, npanels;
} gemm_args;

/* computes panels [q0, q1) for every row */
typedef void (*panels_fn)(const gemm_args *a, idx q0, idx q1);

/* ------------------------------------------------------------------------------ portable path */
/* c[r, 0:cols] of rows r < rows, from panel pp (k rows of 16), one fmaf chain per element */
static void chain_generic(const float *x, idx k, const float *pp, float *c, idx ldc, idx rows,
                          idx cols) {
    for (idx r = 0; r < rows; r++)
        for (idx j = 0; j < cols; j++) {
            float acc = 0.0f;
            for (idx p = 0; p < k; p++) acc = fmaf(x[r * k + p], pp[p * PANEL + j], acc);
            c[r * ldc + j] = acc;
        }
}

static void panels_generic(const gemm_args *a, idx q0, idx q1) {
    for (idx q = q0; q < q1; q++) {
        idx j = q * PANEL, cols = a->n - j < PANEL ? a->n - j : PANEL;
        chain_generic(a->x, a->k, a->wp + q * a->k * PANEL, a->out + j, a->ldo, a->m, cols);
    }
}

#if ROWGEMM_X86
/* ------------------------------------------------------------------------------------ AVX2 */
#define AVX2 __attribute__((target("avx2,fma")))

/* R rows x P panels: 2P ymm accumulators per row, one chain of k vfmadd231ps per lane.
 * c: [R, 16P] with row stride ldc. */
#define AVX2_KERNEL(R, P)                                                                          \
    AVX2 static void avx2_##R##x##P(const float *x, idx k, const float *pp, idx pstride, float *c, \
                                    idx ldc) {                                                     \
        __m256 acc[R][2 * P];                                                                      \
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++)                                       \
            _Pragma("GCC unroll 16") for (int v = 0; v < 2 * P; v++) acc[r][v] = _mm256_setzero_ps(); \
        for (idx p = 0; p < k; p++) {                                                              \
            __m256 b[2 * P];                                                                       \
            _Pragma("GCC unroll 16") for (int v = 0; v < 2 * P; v++)                               \
                b[v] = _mm256_loadu_ps(pp + (v / 2) * pstride + p * PANEL + 8 * (v % 2));          \
            _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {                                 \
                __m256 s = _mm256_broadcast_ss(x + r * k + p);                                     \
                _Pragma("GCC unroll 16") for (int v = 0; v < 2 * P; v++)                           \
                    acc[r][v] = _mm256_fmadd_ps(s, b[v], acc[r][v]);                               \
            }                                                                                      \
        }                                                                                          \
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++)                                       \
            _Pragma("GCC unroll 16") for (int v = 0; v < 2 * P; v++)                               \
                _mm256_storeu_ps(c + r * ldc + 8 * v, acc[r][v]);                                  \
    }
AVX2_KERNEL(6, 1)
AVX2_KERNEL(5, 1)
AVX2_KERNEL(4, 1)
AVX2_KERNEL(3, 1)
AVX2_KERNEL(2, 1)
AVX2_KERNEL(1, 1)
AVX2_KERNEL(2, 2)
AVX2_KERNEL(1, 4)

typedef void (*avx2_kernel)(const float *, idx, const float *, idx, float *, idx);
static const avx2_kernel avx2_rows[7] = {NULL, avx2_1x1, avx2_2x1, avx2_3x1, avx2_4x1, avx2_5x1,
                                         avx2_6x1};

/* rows [i0, m) of one panel q with kernels of <= 6 rows; a partial last panel goes through a
 * 16-column scratch tile (its padding columns are computed and dropped). */
AVX2 static void avx2_panel_rows(const gemm_args *a, idx q, idx i0) {
    const float *pp = a->wp + q * a->k * PANEL;
    idx j = q * PANEL, cols = a->n - j;
    for (idx i = i0; i < a->m; i += 6) {
        idx rows = a->m - i < 6 ? a->m - i : 6;
        if (cols >= PANEL) {
            avx2_rows[rows](a->x + i * a->k, a->k, pp, a->k * PANEL, a->out + i * a->ldo + j, a->ldo);
        } else {
            float tile[6 * PANEL];
            avx2_rows[rows](a->x + i * a->k, a->k, pp, a->k * PANEL, tile, PANEL);
            for (idx r = 0; r < rows; r++)
                memcpy(a->out + (i + r) * a->ldo + j, tile + r * PANEL, (size_t)cols * sizeof(float));
        }
    }
}

AVX2 static void panels_avx2(const gemm_args *a, idx q0, idx q1) {
    idx q = q0, full = a->n / PANEL; /* panels [0, full) have 16 valid columns */
    if (a->m == 1) /* one row: 4 panels at once, 8 independent chains in flight */
        for (; q + 4 <= q1 && q + 4 <= full; q += 4)
            avx2_1x4(a->x, a->k, a->wp + q * a->k * PANEL, a->k * PANEL, a->out + q * PANEL, a->ldo);
    else if (a->m == 2)
        for (; q + 2 <= q1 && q + 2 <= full; q += 2)
            avx2_2x2(a->x, a->k, a->wp + q * a->k * PANEL, a->k * PANEL, a->out + q * PANEL, a->ldo);
    for (; q < q1; q++) avx2_panel_rows(a, q, 0);
}

/* --------------------------------------------------------------------------------- AVX-512 */
#define AVX512 __attribute__((target("avx512f,fma")))

/* R rows x P panels: P zmm accumulators per row. */
#define AVX512_KERNEL(R, P)                                                                        \
    AVX512 static void avx512_##R##x##P(const float *x, idx k, const float *pp, idx pstride,     \
                                        float *c, idx ldc) {                                       \
        __m512 acc[R][P];                                                                          \
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++)                                       \
            _Pragma("GCC unroll 16") for (int v = 0; v < P; v++) acc[r][v] = _mm512_setzero_ps();  \
        for (idx p = 0; p < k; p++) {                                                              \
            __m512 b[P];                                                                           \
            _Pragma("GCC unroll 16") for (int v = 0; v < P; v++)                                   \
                b[v] = _mm512_loadu_ps(pp + v * pstride + p * PANEL);                              \
            _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {                                 \
                __m512 s = _mm512_set1_ps(x[r * k + p]);                                           \
                _Pragma("GCC unroll 16") for (int v = 0; v < P; v++)                               \
                    acc[r][v] = _mm512_fmadd_ps(s, b[v], acc[r][v]);                               \
            }                                                                                      \
        }                                                                                          \
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++)                                       \
            _Pragma("GCC unroll 16") for (int v = 0; v < P; v++)                                   \
                _mm512_storeu_ps(c + r * ldc + PANEL * v, acc[r][v]);                              \
    }
AVX512_KERNEL(8, 2)
AVX512_KERNEL(7, 2)
AVX512_KERNEL(6, 2)
AVX512_KERNEL(5, 2)
AVX512_KERNEL(4, 2)
AVX512_KERNEL(3, 2)
AVX512_KERNEL(2, 4)
AVX512_KERNEL(1, 8)
AVX512_KERNEL(8, 1)
AVX512_KERNEL(7, 1)
AVX512_KERNEL(6, 1)
AVX512_KERNEL(5, 1)
AVX512_KERNEL(4, 1)
AVX512_KERNEL(3, 1)
AVX512_KERNEL(2, 1)
AVX512_KERNEL(1, 1)

typedef void (*avx512_kernel)(const float *, idx, const float *, idx, float *, idx);
static const avx512_kernel avx512_rows1[9] = {NULL, avx512_1x1, avx512_2x1, avx512_3x1, avx512_4x1,
                                              avx512_5x1, avx512_6x1, avx512_7x1, avx512_8x1};
static const avx512_kernel avx512_rows2[9] = {NULL, NULL, NULL, avx512_3x2, avx512_4x2,
                                              avx512_5x2, avx512_6x2, avx512_7x2, avx512_8x2};

AVX512 static void avx512_panel_rows(const gemm_args *a, idx q, idx i0) {
    const float *pp = a->wp + q * a->k * PANEL;
    idx j = q * PANEL, cols = a->n - j;
    for (idx i = i0; i < a->m; i += 8) {
        idx rows = a->m - i < 8 ? a->m - i : 8;
        if (cols >= PANEL) {
            avx512_rows1[rows](a->x + i * a->k, a->k, pp, a->k * PANEL, a->out + i * a->ldo + j, a->ldo);
        } else {
            float tile[8 * PANEL];
            avx512_rows1[rows](a->x + i * a->k, a->k, pp, a->k * PANEL, tile, PANEL);
            for (idx r = 0; r < rows; r++)
                memcpy(a->out + (i + r) * a->ldo + j, tile + r * PANEL, (size_t)cols * sizeof(float));
        }
    }
}

AVX512 static void panels_avx512(const gemm_args *a, idx q0, idx q1) {
    idx q = q0, full = a->n / PANEL;
    if (a->m == 1) {
        for (; q + 8 <= q1 && q + 8 <= full; q += 8)
            avx512_1x8(a->x, a->k, a->wp + q * a->k * PANEL, a->k * PANEL, a->out + q * PANEL, a->ldo);
    } else if (a->m == 2) {
        for (; q + 4 <= q1 && q + 4 <= full; q += 4)
            avx512_2x4(a->x, a->k, a->wp + q * a->k * PANEL, a->k * PANEL, a->out + q * PANEL, a->ldo);
    } else {
        /* two panels at a time: rows in blocks of 8 (a last block of 1-2 rows per panel) */
        for (; q + 2 <= q1 && q + 2 <= full; q += 2) {
            const float *pp = a->wp + q * a->k * PANEL;
            idx i = 0;
            for (; i < a->m && a->m - i >= 3; i += 8) {
                idx rows = a->m - i < 8 ? a->m - i : 8;
                avx512_rows2[rows](a->x + i * a->k, a->k, pp, a->k * PANEL,
                                   a->out + i * a->ldo + q * PANEL, a->ldo);
            }
            if (i < a->m) {
                avx512_panel_rows(a, q, i);
                avx512_panel_rows(a, q + 1, i);
            }
        }
    }
    for (; q < q1; q++) avx512_panel_rows(a, q, 0);
}
#endif /* ROWGEMM_X86 */

/* ------------------------------------------------------------------------------------ ISAs */
enum { ISA_GENERIC = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };
static const char *const isa_names[] = {"generic", "avx2", "avx512"};
static const panels_fn isa_fns[] = {
    panels_generic,
#if ROWGEMM_X86
    panels_avx2, panels_avx512,
#else
    NULL, NULL,
#endif
};

static int isa_supported(int isa) {
#if ROWGEMM_X86
    __builtin_cpu_init();
    if (isa == ISA_AVX512) return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma");
    if (isa == ISA_AVX2) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
    return isa == ISA_GENERIC;
}

/* ----------------------------------------------------------------------------- thread pool */
/* A job is published by one release store of `state` = (generation << 32) | chunks. A thread takes
 * a chunk by a compare-and-swap from (g, r) to (g, r - 1), r > 0, and then computes chunk r - 1. The
 * job's fields are written before that store and read only after a successful take, and the caller
 * writes the next job's fields only once every chunk taken is done: so a worker that wakes late and
 * still looks at generation g can take nothing once its chunks are gone, and never reads a job
 * half rewritten. */
static struct {
    pthread_mutex_t mu;
    pthread_cond_t wake;
    pthread_mutex_t busy; /* one GEMM at a time through the pool; others run on their caller */
    _Atomic uint64_t state;
    _Atomic idx done; /* chunks finished in the current generation */
    _Atomic int sleepers;
    gemm_args job;
    panels_fn fn;
    fenv_t env; /* the caller's floating-point environment, for the workers */
    idx chunk;
    int nworkers;
    pid_t pid;
    pthread_t threads[MAX_THREADS];
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_MUTEX_INITIALIZER};

/* How long a worker watches for the next job before it sleeps: the engine's GEMMs come a few
 * hundred microseconds apart, and waking a sleeping thread takes tens of them. Past the first
 * SPIN_PAUSE_NS it yields between looks, so it gives the core away when others want it. */
#define SPIN_NS 200000
#define SPIN_PAUSE_NS 20000

static int take_chunk(uint32_t gen, idx *chunk) {
    uint64_t s = atomic_load_explicit(&pool.state, memory_order_acquire);
    for (;;) {
        if ((uint32_t)(s >> 32) != gen || (uint32_t)s == 0) return 0;
        if (atomic_compare_exchange_weak_explicit(&pool.state, &s, s - 1, memory_order_acq_rel,
                                                  memory_order_acquire)) {
            *chunk = (idx)(uint32_t)s - 1;
            return 1;
        }
    }
}

static void run_chunks(uint32_t gen, int worker) {
    idx c;
    for (int first = 1; take_chunk(gen, &c); first = 0) {
        if (worker && first) fesetenv(&pool.env);
        idx q0 = c * pool.chunk, q1 = q0 + pool.chunk;
        pool.fn(&pool.job, q0, q1 < pool.job.npanels ? q1 : pool.job.npanels);
        atomic_fetch_add_explicit(&pool.done, 1, memory_order_release);
    }
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static uint32_t generation(void) {
    return (uint32_t)(atomic_load_explicit(&pool.state, memory_order_acquire) >> 32);
}

static void *worker_main(void *arg) {
    (void)arg;
    uint32_t seen = generation();
    for (;;) {
        uint32_t gen = generation();
        int64_t start = now_ns(), t = start;
        for (; gen == seen && t - start < SPIN_NS; gen = generation(), t = now_ns()) {
            if (t - start < SPIN_PAUSE_NS)
                for (int i = 0; i < 64; i++) CPU_RELAX();
            else
                sched_yield();
        }
        if (gen == seen) {
            pthread_mutex_lock(&pool.mu);
            atomic_fetch_add(&pool.sleepers, 1);
            while ((gen = generation()) == seen) pthread_cond_wait(&pool.wake, &pool.mu);
            atomic_fetch_sub(&pool.sleepers, 1);
            pthread_mutex_unlock(&pool.mu);
        }
        seen = gen;
        run_chunks(gen, 1);
    }
    return NULL;
}

static void pool_after_fork_in_child(void) {
    /* the workers do not exist in the child; start afresh (they are made again on demand) */
    pthread_mutex_init(&pool.mu, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pthread_mutex_init(&pool.busy, NULL);
    atomic_store(&pool.sleepers, 0);
    pool.nworkers = 0;
    pool.pid = getpid();
}

/* make workers until there are `want` (>= 0); returns how many exist */
static int pool_grow(int want) {
    if (pool.pid != getpid()) pool_after_fork_in_child();
    if (want > MAX_THREADS) want = MAX_THREADS;
    while (pool.nworkers < want) {
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int rc = pthread_create(&pool.threads[pool.nworkers], &attr, worker_main, NULL);
        pthread_attr_destroy(&attr);
        if (rc != 0) break;
        pool.nworkers++;
    }
    return pool.nworkers;
}

/* Panels per chunk: about four chunks per thread, in whole groups of 8, 4 or 2 panels (the
 * kernels' widths) where that still leaves a chunk for every thread. */
static idx chunk_panels(idx npanels, idx threads) {
    idx chunk = (npanels + 4 * threads - 1) / (4 * threads);
    for (idx g = 8; g >= 2; g /= 2) {
        idx c = (chunk + g - 1) / g * g;
        if ((npanels + c - 1) / c >= threads) return c;
    }
    return chunk;
}

/* out = x @ w over `threads` threads (the caller and threads - 1 workers) */
static void gemm_run(const gemm_args *a, panels_fn fn, int threads) {
    if (a->m == 0 || a->npanels == 0) return;
    if (threads <= 1 || a->npanels < 2 || pthread_mutex_trylock(&pool.busy) != 0) {
        fn(a, 0, a->npanels); /* same elements, same chains: only slower */
        return;
    }
    int workers = pool_grow(threads - 1);
    if (workers == 0) {
        pthread_mutex_unlock(&pool.busy);
        fn(a, 0, a->npanels);
        return;
    }
    idx chunk = chunk_panels(a->npanels, (idx)workers + 1);
    idx nchunks = (a->npanels + chunk - 1) / chunk;
    pool.job = *a;
    pool.fn = fn;
    fegetenv(&pool.env);
    pool.chunk = chunk;
    atomic_store_explicit(&pool.done, 0, memory_order_relaxed);
    uint32_t gen = generation() + 1;
    /* sequentially consistent, as is the workers' sleepers count: either this thread sees a
     * worker that is going to sleep, or that worker sees the new generation before it sleeps */
    atomic_store(&pool.state, ((uint64_t)gen << 32) | (uint64_t)nchunks);
    if (atomic_load(&pool.sleepers) > 0) {
        pthread_mutex_lock(&pool.mu);
        pthread_cond_broadcast(&pool.wake);
        pthread_mutex_unlock(&pool.mu);
    }
    run_chunks(gen, 0);
    /* every chunk is taken now; wait for those the workers are still computing */
    for (unsigned spins = 0; atomic_load_explicit(&pool.done, memory_order_acquire) < nchunks;
         spins++) {
        if (spins < 1u << 14) CPU_RELAX();
        else sched_yield();
    }
    pthread_mutex_unlock(&pool.busy);
}

/* ------------------------------------------------------------------------------ Python API */
static int isa_default = ISA_GENERIC;

static int get_f32(PyObject *obj, Py_buffer *view, int writable, const char *what) {
    int flags = PyBUF_FORMAT | PyBUF_ND | PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) != 0) return -1;
    if (view->itemsize != 4 || view->format == NULL || strcmp(view->format, "f") != 0) {
        PyErr_Format(PyExc_TypeError, "_rowgemm: %s must be C-contiguous float32", what);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static idx packed_size(idx k, idx n) { return (n + PANEL - 1) / PANEL * PANEL * k; }

PyDoc_STRVAR(pack_doc, "pack(w, wp): copy w [K, N] (float32, C-contiguous) into wp (float32, "
                       "packed_size(K, N) elements) as panels of 16 columns, the last zero-padded.");
static PyObject *py_pack(PyObject *self, PyObject *args) {
    PyObject *wo, *wpo;
    if (!PyArg_ParseTuple(args, "OO", &wo, &wpo)) return NULL;
    Py_buffer w, wp;
    if (get_f32(wo, &w, 0, "w") != 0) return NULL;
    if (get_f32(wpo, &wp, 1, "wp") != 0) {
        PyBuffer_Release(&w);
        return NULL;
    }
    PyObject *ret = NULL;
    if (w.ndim != 2) {
        PyErr_SetString(PyExc_ValueError, "_rowgemm.pack: w must be 2-D [K, N]");
    } else {
        idx k = w.shape[0], n = w.shape[1];
        if (wp.len / 4 != packed_size(k, n)) {
            PyErr_Format(PyExc_ValueError, "_rowgemm.pack: wp has %zd floats, expected %zd",
                         (Py_ssize_t)(wp.len / 4), (Py_ssize_t)packed_size(k, n));
        } else {
            const float *src = (const float *)w.buf;
            float *dst = (float *)wp.buf;
            Py_BEGIN_ALLOW_THREADS
            for (idx j = 0; j < n; j += PANEL) {
                idx cols = n - j < PANEL ? n - j : PANEL;
                float *panel = dst + j * k;
                for (idx p = 0; p < k; p++) {
                    memcpy(panel + p * PANEL, src + p * n + j, (size_t)cols * sizeof(float));
                    for (idx c = cols; c < PANEL; c++) panel[p * PANEL + c] = 0.0f;
                }
            }
            Py_END_ALLOW_THREADS
            ret = Py_NewRef(Py_None);
        }
    }
    PyBuffer_Release(&w);
    PyBuffer_Release(&wp);
    return ret;
}

PyDoc_STRVAR(gemm_doc, "gemm(x, wp, n, out, threads, isa=None): out[M, N] = x[M, K] @ w[K, N] "
                       "from w packed by pack(); one fma chain per element in k order.");
static PyObject *py_gemm(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"x", "wp", "n", "out", "threads", "isa", NULL};
    PyObject *xo, *wpo, *outo, *isao = Py_None;
    Py_ssize_t n;
    int threads;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOnOi|O", kwlist, &xo, &wpo, &n, &outo,
                                     &threads, &isao))
        return NULL;
    int isa = isa_default;
    if (isao != Py_None) {
        const char *name = PyUnicode_AsUTF8(isao);
        if (name == NULL) return NULL;
        for (isa = 0; isa < 3 && strcmp(name, isa_names[isa]) != 0; isa++) {}
        if (isa == 3 || !isa_supported(isa)) {
            PyErr_Format(PyExc_ValueError, "_rowgemm.gemm: isa %R is not one this CPU runs", isao);
            return NULL;
        }
    }
    Py_buffer x, wp, out;
    if (get_f32(xo, &x, 0, "x") != 0) return NULL;
    if (get_f32(wpo, &wp, 0, "wp") != 0) {
        PyBuffer_Release(&x);
        return NULL;
    }
    if (get_f32(outo, &out, 1, "out") != 0) {
        PyBuffer_Release(&x);
        PyBuffer_Release(&wp);
        return NULL;
    }
    PyObject *ret = NULL;
    if (x.ndim != 2 || out.ndim != 2 || n < 0) {
        PyErr_SetString(PyExc_ValueError, "_rowgemm.gemm: x and out must be 2-D, n >= 0");
    } else if (out.shape[0] != x.shape[0] || out.shape[1] != n) {
        PyErr_SetString(PyExc_ValueError, "_rowgemm.gemm: out must be [M, N]");
    } else if (wp.len / 4 != packed_size(x.shape[1], n)) {
        PyErr_Format(PyExc_ValueError, "_rowgemm.gemm: wp has %zd floats, a packed [%zd, %zd] "
                     "weight has %zd", (Py_ssize_t)(wp.len / 4), (Py_ssize_t)x.shape[1], n,
                     (Py_ssize_t)packed_size(x.shape[1], n));
    } else {
        gemm_args a = {(const float *)x.buf, (const float *)wp.buf, (float *)out.buf,
                       x.shape[0], x.shape[1], n, n, (n + PANEL - 1) / PANEL};
        panels_fn fn = isa_fns[isa];
        if (a.k == 0) {
            memset(out.buf, 0, (size_t)out.len); /* the empty chain: +0.0f */
        } else {
            Py_BEGIN_ALLOW_THREADS
            gemm_run(&a, fn, threads);
            Py_END_ALLOW_THREADS
        }
        ret = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&x);
    PyBuffer_Release(&wp);
    PyBuffer_Release(&out);
    return ret;
}

PyDoc_STRVAR(packed_size_doc, "packed_size(K, N): floats in a packed [K, N] weight.");
static PyObject *py_packed_size(PyObject *self, PyObject *args) {
    Py_ssize_t k, n;
    if (!PyArg_ParseTuple(args, "nn", &k, &n)) return NULL;
    return PyLong_FromSsize_t(packed_size(k, n));
}

PyDoc_STRVAR(isas_doc, "isas(): the instruction sets this CPU runs the kernels in, best last.");
static PyObject *py_isas(PyObject *self, PyObject *unused) {
    PyObject *lst = PyList_New(0);
    for (int i = 0; lst != NULL && i < 3; i++)
        if (isa_supported(i)) {
            PyObject *s = PyUnicode_FromString(isa_names[i]);
            if (s == NULL || PyList_Append(lst, s) != 0) Py_CLEAR(lst);
            Py_XDECREF(s);
        }
    return lst;
}

static PyMethodDef methods[] = {
    {"pack", py_pack, METH_VARARGS, pack_doc},
    {"gemm", (PyCFunction)(void (*)(void))py_gemm, METH_VARARGS | METH_KEYWORDS, gemm_doc},
    {"packed_size", py_packed_size, METH_VARARGS, packed_size_doc},
    {"isas", py_isas, METH_NOARGS, isas_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_rowgemm",
    "The embedded engine's batch-invariant float32 GEMM (see the C source's header).", -1, methods,
};

PyMODINIT_FUNC PyInit__rowgemm(void) {
    for (int i = 2; i >= 0; i--)
        if (isa_fns[i] != NULL && isa_supported(i)) {
            isa_default = i;
            break;
        }
    pool.pid = getpid();
    pthread_atfork(NULL, NULL, pool_after_fork_in_child);
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    /* bumped with every change to the kernels or this API; bistat.engines.embedded.ops checks it */
    if (PyModule_AddIntConstant(m, "VERSION", 1) != 0
        || PyModule_AddIntConstant(m, "PANEL", PANEL) != 0
        || PyModule_AddStringConstant(m, "ISA", isa_names[isa_default]) != 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
