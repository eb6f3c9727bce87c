/* The CPU backend's kernels (see kernels.py, which builds and calls them).

   paged_attention is the algorithm of the Triton kernels (core/triton_attention.py) in a loop
   nest: one task per query token holds all its heads, walks the sequence's blocks through its
   block table in order (each key and value read once, where it lies in the cache) and folds
   each block into every head's running max m, sum l and output acc (online softmax). No
   gathered copy of the context and no mask exist. The others fuse what PyTorch runs as a chain
   of small operators (each with microseconds of dispatch: most of their time at decode sizes):
   RMSNorm with its residual add, rotary embedding, SiLU-and-multiply, and sampling.

   All tensors are float32 but the KV cache (float32, bfloat16 or FP8, `kv_kind`). Tasks run on
   `threads` threads: the caller and the library's own (`parallel`, below), not OpenMP's. Shapes
   as in core/attention.py. */
#define _GNU_SOURCE  /* pthread_setname_np */
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <sys/resource.h>

enum { MAX_HEADS = 64, MAX_HEAD_DIM = 256, MAX_BLOCK = 256, LANES = 8, CHUNK = 128 };
enum { PANEL = 2 * LANES, TILE_ROWS = 6, BLOCK_BYTES = 256 * 1024 };
typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
enum { KV_FLOAT32, KV_BFLOAT16, KV_FP8 };
/* elements under which a fused element-wise kernel runs on one thread (waking more costs more) */
#define PARALLEL_MIN 65536

/* ---- the library's threads ----
   Every kernel splits its work into tasks that `parallel` runs on the calling thread and on
   threads of this library's pool. Its own, not OpenMP's: how its threads wait between two
   kernels is then the engine's policy, whatever the process's OpenMP settings (which belong
   to the program: nanopaged changes none). A thread done with a kernel's tasks waits for the
   next one spinning, then asleep until the next kernel wakes it. Alone on its cores it spins
   up to SPIN_NS: a step calls its kernels microseconds apart, and waking a sleeping thread
   costs tens of microseconds each time (a step of 40 kernels: 10-15% of its time). While it
   spins it offers its core to any other thread that wants it (sched_yield); once one took
   it, the cores are shared with other busy threads (a second engine, a build), and for the
   next CONTENDED_MS the pool spins only CONTENDED_SPIN_NS, about what a wake-up costs: it
   would otherwise spin away the time of the threads it shares its cores with, and its own
   peers would wait for one that was descheduled (two engines with OpenMP's long spin each
   ran at a fifth of their speed alone, docs/cpu.md). */
enum { SPIN_NS = 2000000, CONTENDED_SPIN_NS = 50000, CONTENDED_MS = 100 };
/* a yield that returns later than TAKEN_NS may have given the core away (offer_core) */
enum { TAKEN_NS = 20000, TAKEN_TIMES = 3, TAKEN_WINDOW_NS = 10000000 };
enum { MAX_THREADS = 256 };
typedef void (*task_fn)(const void *args, long first, long end);

static struct {
    pthread_mutex_t lock;
    pthread_cond_t wake;
    int started, sleepers;   /* threads of the pool; those asleep (under `lock`) */
    atomic_flag busy;        /* a kernel is using the pool (another one runs alone) */
    atomic_long contended_until;  /* until when (now_ns) its cores are known shared */
    atomic_long first_taken;      /* when the latest window of taken yields began */
    atomic_int times_taken;       /* taken yields in that window */
    /* apart from what every thread reads while it waits: a claim writes it. The kernel
       being run, as one word: its number (one more for each kernel the pool runs) times
       MAX_THREADS, plus its helpers' count (see pool_thread) */
    _Alignas(64) atomic_long kernel;
    /* the kernel being run: its tasks, chunks of them claimed in turn by any thread */
    task_fn fn;
    const void *args;
    long tasks, chunk;
    atomic_int working;      /* helpers not yet done with this kernel */
    _Alignas(64) atomic_long next;  /* the first task of the next chunk to claim */
} pool = {.lock = PTHREAD_MUTEX_INITIALIZER, .wake = PTHREAD_COND_INITIALIZER,
          .busy = ATOMIC_FLAG_INIT};

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

static long now_ns(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return now.tv_sec * 1000000000L + now.tv_nsec;
}

/* How many times this thread lost its core to another one while it could run (-1 where
   not counted). */
static long switches_away(void) {
#ifdef RUSAGE_THREAD
    struct rusage usage;
    getrusage(RUSAGE_THREAD, &usage);
    return usage.ru_nivcsw;
#else
    return -1;
#endif
}

/* Offers this thread's core to any other runnable thread; notes it when one took it. A
   yield that returns late is no proof alone: a virtual machine's core is taken away from
   time to time, with no other thread involved (alone on a 2-core VM, a yield returned after
   20-100 us tens of times a second). Proof is a late yield that switched to another thread
   (the kernel counts it; where it does not, a late yield is proof enough), TAKEN_TIMES of
   them within TAKEN_WINDOW_NS. */
static void offer_core(void) {
    long switches = switches_away(), before = now_ns();
    sched_yield();
    long after = now_ns();
    if (after - before <= TAKEN_NS || (switches >= 0 && switches_away() == switches)) return;
    if (after - atomic_load(&pool.first_taken) > TAKEN_WINDOW_NS) {
        atomic_store(&pool.first_taken, after);
        atomic_store(&pool.times_taken, 1);
    } else if (atomic_fetch_add(&pool.times_taken, 1) + 1 >= TAKEN_TIMES) {
        atomic_store(&pool.contended_until, after + CONTENDED_MS * 1000000L);
    }
}

static void claim_chunks(void) {
    for (long first; (first = atomic_fetch_add(&pool.next, pool.chunk)) < pool.tasks;)
        pool.fn(pool.args, first, first + pool.chunk < pool.tasks ? first + pool.chunk
                                                                  : pool.tasks);
}

/* Waits until the pool's kernel is no longer `seen`, as the comment above says; returns
   the new one, as it read it once. */
static long await_kernel(long seen) {
    long start = now_ns();
    for (long spins = 1;; spins++) {
        long kernel = atomic_load(&pool.kernel);
        if (kernel != seen) return kernel;
        relax();
        if (spins % 64 == 0) {
            long now = now_ns();
            int shared = now < atomic_load(&pool.contended_until);
            if (now - start > (shared ? CONTENDED_SPIN_NS : SPIN_NS)) break;
            offer_core();
        }
    }
    long kernel;
    pthread_mutex_lock(&pool.lock);
    pool.sleepers++;
    while ((kernel = atomic_load(&pool.kernel)) == seen)
        pthread_cond_wait(&pool.wake, &pool.lock);
    pool.sleepers--;
    pthread_mutex_unlock(&pool.lock);
    return kernel;
}

/* Pool thread `index`: it takes part in every kernel after `born_after[index]` whose helpers
   it is one of. Which kernel and how many helpers it has come in one read of one word: read
   apart, a thread late between the two reads could take a later kernel's count for the one
   it saw, help that later kernel, then see it again as new and count itself done twice, so
   that the caller returns while a helper still writes. A helper of the kernel it read is
   counted in `working`: that kernel, and its fields, stay until this thread is done. */
static long born_after[MAX_THREADS];

static void *pool_thread(void *index) {
#ifdef __linux__
    pthread_setname_np(pthread_self(), "nanopaged-cpu");  /* as top -H and tests see it */
#endif
    for (long seen = born_after[(long)index];;) {
        seen = await_kernel(seen);
        if ((long)index < seen % MAX_THREADS) {
            claim_chunks();
            atomic_fetch_sub(&pool.working, 1);
        }
    }
    return NULL;
}

/* A child of fork has none of its parent's threads: its pool starts empty. */
static void forget_threads(void) {
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pool.started = pool.sleepers = 0;
    atomic_flag_clear(&pool.busy);
}

/* Whether the pool counts its cores shared with other busy threads now (offer_core). */
int cores_shared(void) { return now_ns() < atomic_load(&pool.contended_until); }

/* Runs fn(args, first, end) over the tasks [0, tasks) in chunks of `chunk`, on `threads`
   threads: the caller and threads - 1 of the pool (started on first need). Each chunk goes to
   whichever thread claims it first: a thread that is late (asleep, or descheduled by another
   process) leaves its share to the others. Returns once every task has run. */
static void parallel(long tasks, long chunk, int threads, task_fn fn, const void *args) {
    threads = threads < MAX_THREADS ? threads : MAX_THREADS;
    threads = tasks < threads ? (int)tasks : threads;
    if (threads <= 1 || atomic_flag_test_and_set(&pool.busy)) {
        fn(args, 0, tasks);  /* alone (or beside a kernel another thread runs) */
        return;
    }
    pthread_mutex_lock(&pool.lock);
    if (pool.started == 0) pthread_atfork(NULL, NULL, forget_threads);
    for (pthread_t thread; pool.started < threads - 1; pool.started++) {
        born_after[pool.started] = atomic_load(&pool.kernel);
        if (pthread_create(&thread, NULL, pool_thread, (void *)(long)pool.started)) break;
        pthread_detach(thread);
    }
    pool.fn = fn;
    pool.args = args;
    pool.tasks = tasks;
    pool.chunk = chunk;
    int helpers = threads - 1 < pool.started ? threads - 1 : pool.started;
    atomic_store(&pool.next, 0);
    atomic_store(&pool.working, helpers);
    /* published last, the kernel's fields above with it (helpers < MAX_THREADS) */
    atomic_store(&pool.kernel, (atomic_load(&pool.kernel) / MAX_THREADS + 1) * MAX_THREADS
                                   + helpers);
    if (pool.sleepers) pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    claim_chunks();
    for (long spins = 1; atomic_load(&pool.working) > 0; spins++) {
        relax();
        if (spins % 64 == 0) offer_core();  /* a helper descheduled on this core: let it run */
    }
    atomic_flag_clear(&pool.busy);
}

/* Tasks a chunk for a kernel whose tasks cost alike: a few chunks a thread, so that a thread
   descheduled in the middle of one holds up the kernel for a small part of it. */
static long even_chunk(long tasks, int threads) {
    return threads > 1 ? (tasks + 4 * threads - 1) / (4 * threads) : tasks;
}

/* a . b, n a multiple of LANES: LANES partial sums, one vector register that the compiler keeps
   (a single running sum would be a serial chain of scalar adds). */
static inline float dot(const float *a, const float *b, int n) {
    float part[LANES] = {0.0f}, sum = 0.0f;
    for (int i = 0; i < n; i += LANES)
        for (int j = 0; j < LANES; j++) part[j] += a[i + j] * b[i + j];
    for (int j = 0; j < LANES; j++) sum += part[j];
    return sum;
}

/* e^x for x <= 0, vectorizable: 2^(x log2 e) as 2^n (the exponent bits) times 2^f, |f| <= 1/2,
   by its Taylor polynomial (relative error under 2e-7: float's own). 0 under -126 log 2 (where
   float32 turns subnormal) and for -inf: a masked token's weight is exactly 0. */
static inline float exp_nonpositive(float x) {
    float y = x * 1.44269504088896341f;
    int underflow = y < -126.0f;
    y = underflow ? -126.0f : y;
    float n = __builtin_floorf(y + 0.5f), f = y - n;
    float p = 1.5252733e-5f;
    p = p * f + 1.5403530e-4f;
    p = p * f + 1.3333558e-3f;
    p = p * f + 9.6181291e-3f;
    p = p * f + 5.5504109e-2f;
    p = p * f + 2.4022651e-1f;
    p = p * f + 6.9314718e-1f;
    p = p * f + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return underflow ? 0.0f : p * two_n;
}

/* Row `index` of a cache as float32: in place for a float32 cache, else converted into
   `buffer` (bfloat16: the high half of a float's bits; FP8: through torch's own table). */
static const float *cache_row(const void *cache, int kv_kind, const float *fp8_table,
                              long index, int n, float *buffer) {
    if (kv_kind == KV_FLOAT32) return (const float *)cache + index;
    for (int i = 0; i < n; i++) {
        if (kv_kind == KV_FP8) {
            buffer[i] = fp8_table[((const uint8_t *)cache)[index + i]];
        } else {
            uint32_t bits = (uint32_t)((const uint16_t *)cache)[index + i] << 16;
            memcpy(buffer + i, &bits, sizeof bits);
        }
    }
    return buffer;
}

/* Asks for `n` elements of a cache from `index` on to be loaded into the caches: a block is
   elsewhere in memory than the one before it, which the CPU's own prefetcher cannot guess. As
   a decode reads a block's keys, a row at a time, it asks for the same row of the block's
   values (read next) and of the next block's keys: a whole block at once (256 lines) fills the
   few outstanding-miss slots a core has, and stalls it (20% slower). Asking for the values
   with the keys rather than the next block's values with these values reads a decode step's
   K/V in ~0.9x the time (48 sequences of 400 tokens), as then every block's values are asked
   for, the first one's too. */
static inline void prefetch(const void *cache, int kv_kind, long index, int n) {
    int size = kv_kind == KV_FLOAT32 ? 4 : kv_kind == KV_BFLOAT16 ? 2 : 1;
    const char *start = (const char *)cache + index * size;
    for (long byte = 0; byte < (long)n * size; byte += 64) __builtin_prefetch(start + byte);
}

/* The sequence whose queries include `token`: cu_seqlens_q is sorted. */
static int sequence_of(const int32_t *cu_seqlens_q, int num_seqs, int token) {
    int lo = 0, hi = num_seqs - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (cu_seqlens_q[mid] <= token) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

/* One query token, all its heads, over the keys first..last of its sequence. Inlined at each
   call with a constant head_dim where it is a common one: its loops then unroll (1.4x). */
static inline __attribute__((always_inline)) void attend(
        const float *q, const void *k_cache, const void *v_cache, int kv_kind,
        const float *fp8_table, const int32_t *block_table, int first, int last, int num_heads,
        int num_kv_heads, int head_dim, int block_size, float scale, float *out) {
    float m[MAX_HEADS], l[MAX_HEADS], acc[MAX_HEADS * MAX_HEAD_DIM], s[MAX_HEADS][MAX_BLOCK];
    float buffer[MAX_HEADS * MAX_HEAD_DIM];
    int group = num_heads / num_kv_heads, row = num_kv_heads * head_dim;  /* a token's K or V */
    for (int h = 0; h < num_heads; h++) {
        m[h] = -INFINITY;
        l[h] = 0.0f;
    }
    for (int i = 0; i < num_heads * head_dim; i++) acc[i] = 0.0f;
    for (int b = first / block_size; last >= 0 && b <= last / block_size; b++) {
        long base = (long)block_table[b] * block_size * row;
        int t0 = b == first / block_size ? first % block_size : 0;
        int t1 = b == last / block_size ? last % block_size + 1 : block_size;
        long next = b < last / block_size ? (long)block_table[b + 1] * block_size * row : -1;
        for (int t = t0; t < t1; t++) {  /* the block in order, each key read once */
            if (next >= 0) prefetch(k_cache, kv_kind, next + t * row, row);
            prefetch(v_cache, kv_kind, base + t * row, row);  /* read after the keys */
            const float *k = cache_row(k_cache, kv_kind, fp8_table, base + t * row, row, buffer);
            for (int h = 0; h < num_heads; h++)
                s[h][t] = dot(q + h * head_dim, k + h / group * head_dim, head_dim);
        }
        for (int h = 0; h < num_heads; h++) {
            float m_new = m[h], sum = 0.0f;
#pragma omp simd reduction(max : m_new)
            for (int t = t0; t < t1; t++) {
                s[h][t] *= scale;
                m_new = s[h][t] > m_new ? s[h][t] : m_new;
            }
#pragma omp simd
            for (int t = t0; t < t1; t++)
                s[h][t] = exp_nonpositive(s[h][t] - m_new);  /* now the weight p */
            for (int t = t0; t < t1; t++) sum += s[h][t];  /* in order: prefill's sum */
            float alpha = exp_nonpositive(m[h] - m_new);  /* 0 for the first block */
            l[h] = l[h] * alpha + sum;
            m[h] = m_new;
            for (int d = 0; d < head_dim; d++) acc[h * head_dim + d] *= alpha;
        }
        for (int t = t0; t < t1; t++) {
            const float *v = cache_row(v_cache, kv_kind, fp8_table, base + t * row, row, buffer);
            for (int h = 0; h < num_heads; h++) {
                const float *v_h = v + h / group * head_dim;
                float p = s[h][t], *acc_h = acc + h * head_dim;
                for (int d = 0; d < head_dim; d++) acc_h[d] += p * v_h[d];
            }
        }
    }
    for (int h = 0; h < num_heads; h++)
        for (int d = 0; d < head_dim; d++)
            out[h * head_dim + d] = l[h] > 0.0f ? acc[h * head_dim + d] / l[h] : 0.0f;
}

/* q, out (T, nh, hs), q's tokens q_stride apart; caches (num_blocks, block_size, nkv, hs);
   block_tables (B, max_blocks); context_lens (B,); cu_seqlens_q (B + 1,): sequence i runs the
   queries cu_seqlens_q[i]:cu_seqlens_q[i + 1], its last tokens; NULL: one each (a decode).
   window 0: every key up to the query; else its last `window` positions.
   Returns 0, or 1 for a shape over this file's limits (the caller computes it otherwise). */
/* The arguments of paged_attention and prefill_attention, for their tasks. */
struct attention_args {
    const float *q;
    long q_stride;
    const void *k_cache, *v_cache;
    int kv_kind;
    const float *fp8_table;
    const int32_t *block_tables;
    long block_table_stride;
    const int32_t *cu_seqlens_q, *context_lens;
    int num_seqs, num_heads, num_kv_heads, head_dim, block_size;
    float scale;
    int window;
    float *out;
    const long *first_task;  /* prefill_attention's: each sequence's first task */
};

static void attend_tokens(const void *args, long first_token, long end) {
    const struct attention_args *a = args;
    for (long token = first_token; token < end; token++) {
        const int32_t *cu = a->cu_seqlens_q;
        int seq = cu ? sequence_of(cu, a->num_seqs, (int)token) : (int)token;
        int start = cu ? cu[seq] : seq;
        int queries = cu ? cu[seq + 1] - start : 1;
        int last = a->context_lens[seq] - queries + ((int)token - start); /* its position */
        int first = a->window > 0 && last + 1 > a->window ? last + 1 - a->window : 0;
#define ATTEND(HEAD_DIM)                                                                    \
    attend(a->q + token * a->q_stride, a->k_cache, a->v_cache, a->kv_kind, a->fp8_table,    \
           a->block_tables + seq * a->block_table_stride, first, last, a->num_heads,        \
           a->num_kv_heads, HEAD_DIM, a->block_size, a->scale,                              \
           a->out + token * a->num_heads * a->head_dim)
        if (a->head_dim == 64) ATTEND(64);
        else if (a->head_dim == 128) ATTEND(128);
        else ATTEND(a->head_dim);
#undef ATTEND
    }
}

int paged_attention(const float *q, long q_stride, const void *k_cache, const void *v_cache,
                    int kv_kind, const float *fp8_table, const int32_t *block_tables,
                    long block_table_stride, const int32_t *cu_seqlens_q,
                    const int32_t *context_lens, int num_seqs, int num_heads, int num_kv_heads,
                    int head_dim, int block_size, float scale, int window, float *out,
                    int threads) {
    if (num_heads > MAX_HEADS || head_dim > MAX_HEAD_DIM || head_dim % LANES
        || block_size > MAX_BLOCK || num_heads % num_kv_heads) return 1;
    struct attention_args args = {q, q_stride, k_cache, v_cache, kv_kind, fp8_table,
                                  block_tables, block_table_stride, cu_seqlens_q, context_lens,
                                  num_seqs, num_heads, num_kv_heads, head_dim, block_size,
                                  scale, window, out, NULL};
    int num_tokens = cu_seqlens_q ? cu_seqlens_q[num_seqs] : num_seqs;
    parallel(num_tokens, 1, threads, attend_tokens, &args);  /* contexts differ: a token a claim */
    return 0;
}

/* RMSNorm of `rows` rows of n: row r at x + (r / inner) * outer_stride + (r % inner) * n (a
   (T, heads, n) view of a fused projection's output, or plain rows: inner 1). With a residual
   (rows, n): x + residual is normalised and written to `sum` first (the residual stream). */
struct norm_args {
    const float *x;
    long outer_stride;
    int inner;
    const float *residual, *weight;
    int n;
    float eps;
    float *out, *sum;
};

static void norm_rows(const void *args, long first, long end) {
    const struct norm_args *a = args;
    int n = a->n;
    for (long r = first; r < end; r++) {
        const float *x_r = a->x + r / a->inner * a->outer_stride + r % a->inner * n;
        float *o = a->out + r * n, squares = 0.0f;
        if (a->residual) {
            for (int i = 0; i < n; i++) a->sum[r * n + i] = x_r[i] + a->residual[r * n + i];
            x_r = a->sum + r * n;
        }
#pragma omp simd reduction(+ : squares)
        for (int i = 0; i < n; i++) squares += x_r[i] * x_r[i];
        float inv = 1.0f / sqrtf(squares / n + a->eps);
        for (int i = 0; i < n; i++) o[i] = a->weight[i] * (x_r[i] * inv);
    }
}

void rms_norm(const float *x, long outer_stride, int inner, const float *residual,
              const float *weight, long rows, int n, float eps, float *out, float *sum,
              int threads) {
    struct norm_args args = {x, outer_stride, inner, residual, weight, n, eps, out, sum};
    threads = rows * n >= PARALLEL_MIN ? threads : 1;
    parallel(rows, even_chunk(rows, threads), threads, norm_rows, &args);
}

/* Rotary embedding, rotate-half layout, of `heads` heads of dim n per token (token t's at
   x + t * stride, its heads n apart) -> out (T, heads, n); cos_sin (positions, n): cos | sin. */
struct rotary_args {
    const float *x;
    long stride;
    int heads, n;
    const int64_t *positions;
    const float *cos_sin;
    float *out;
};

static void rotate_tokens(const void *args, long first, long end) {
    const struct rotary_args *a = args;
    int heads = a->heads, n = a->n, half = n / 2;
    for (long t = first; t < end; t++) {
        const float *cos = a->cos_sin + a->positions[t] * n, *sin = cos + half;
        for (int h = 0; h < heads; h++) {
            const float *x1 = a->x + t * a->stride + h * n, *x2 = x1 + half;
            float *o = a->out + (t * heads + h) * n;
            for (int i = 0; i < half; i++) {
                o[i] = x1[i] * cos[i] - x2[i] * sin[i];
                o[half + i] = x2[i] * cos[i] + x1[i] * sin[i];
            }
        }
    }
}

void rotary(const float *x, long stride, int tokens, int heads, int n, const int64_t *positions,
            const float *cos_sin, float *out, int threads) {
    struct rotary_args args = {x, stride, heads, n, positions, cos_sin, out};
    threads = (long)tokens * heads * n >= PARALLEL_MIN ? threads : 1;
    parallel(tokens, even_chunk(tokens, threads), threads, rotate_tokens, &args);
}

/* gate_up (T, 2n): out (T, n) = silu(gate) * up, silu(x) = x sigmoid(x), the sigmoid from
   e^-|x| (never overflows). */
struct silu_args {
    const float *gate_up;
    int n;
    float *out;
};

static void silu_tokens(const void *args, long first, long end) {
    const struct silu_args *a = args;
    int n = a->n;
    for (long t = first; t < end; t++) {
        const float *gate = a->gate_up + t * 2 * n, *up = gate + n;
        float *out = a->out + t * n;
#pragma omp simd
        for (int i = 0; i < n; i++) {
            float e = exp_nonpositive(gate[i] > 0.0f ? -gate[i] : gate[i]);
            float sigmoid = gate[i] > 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
            out[i] = gate[i] * sigmoid * up[i];
        }
    }
}

void silu_and_mul(const float *gate_up, long tokens, int n, float *out, int threads) {
    struct silu_args args = {gate_up, n, out};
    threads = tokens * n >= PARALLEL_MIN ? threads : 1;
    parallel(tokens, even_chunk(tokens, threads), threads, silu_tokens, &args);
}

/* Each token's K and V rows (`row` bytes, in the cache's dtype; tokens k_stride and v_stride
   bytes apart) copied into their cache slots (a slot below 0: none, a step graph's padding row,
   as in the Triton kernel): index_copy_ took 30-70 us a layer for a decode step's few rows. */
struct store_args {
    const char *k;
    long k_stride;
    const char *v;
    long v_stride;
    long row;
    const int64_t *slots;
    char *k_cache, *v_cache;
};

static void store_tokens(const void *args, long first, long end) {
    const struct store_args *a = args;
    for (long t = first; t < end; t++) {
        if (a->slots[t] < 0)
            continue;
        memcpy(a->k_cache + a->slots[t] * a->row, a->k + t * a->k_stride, a->row);
        memcpy(a->v_cache + a->slots[t] * a->row, a->v + t * a->v_stride, a->row);
    }
}

void store_kv(const char *k, long k_stride, const char *v, long v_stride, long tokens, long row,
              const int64_t *slots, char *k_cache, char *v_cache, int threads) {
    struct store_args args = {k, k_stride, v, v_stride, row, slots, k_cache, v_cache};
    threads = tokens * row >= 4 * PARALLEL_MIN ? threads : 1;  /* PARALLEL_MIN floats */
    parallel(tokens, even_chunk(tokens, threads), threads, store_tokens, &args);
}

/* The first token of the largest logit, a NaN counting as +inf (0 when all are -inf). */
static int first_argmax(const float *x, int n) {
    int first = 0;
    float best = -INFINITY;
    for (int i = 0; i < n; i++) {
        float v = x[i] != x[i] ? INFINITY : x[i];
        if (v > best) {
            best = v;
            first = i;
        }
    }
    return first;
}

/* Per row of logits (rows, n): the first token whose cumulative weight under
   exp((logit - max) / T) exceeds uniform * total, in two levels: the weights' sums by chunks of
   CHUNK first (vectorized), then a scan of the one chunk found. The target stays under its
   chunk's mass, so a token of weight 0 (a logit of -inf) is never picked. A row that is no
   distribution (every logit -inf, or a +inf or NaN among them) gets its greedy token, the
   first of its largest logit with NaN as +inf, as the PyTorch sampler gives it. */
struct sample_args {
    const float *logits, *temperatures, *uniform;
    int n;
    int64_t *tokens;
};

static void sample_rows(const void *args, long first, long end) {
    const struct sample_args *a = args;
    int n = a->n;
    int64_t *tokens = a->tokens;
    for (long r = first; r < end; r++) {
        const float *x = a->logits + r * n;
        float max = -INFINITY, inv_t = 1.0f / a->temperatures[r];
#pragma omp simd reduction(max : max)
        for (int i = 0; i < n; i++) max = x[i] > max ? x[i] : max;
        double total = 0.0, target;
        float chunks[(n + CHUNK - 1) / CHUNK];
        for (int c = 0; c * CHUNK < n; c++) {
            int end = (c + 1) * CHUNK < n ? (c + 1) * CHUNK : n;
            float mass = 0.0f;
#pragma omp simd reduction(+ : mass)
            for (int i = c * CHUNK; i < end; i++) mass += exp_nonpositive((x[i] - max) * inv_t);
            chunks[c] = mass;
            total += mass;
        }
        if (!(max > -INFINITY && max < INFINITY) || total != total) {  /* a NaN: total too */
            tokens[r] = first_argmax(x, n);
            continue;
        }
        target = a->uniform[r] * total;
        int c = 0, found = -1;
        for (; c * CHUNK < n; c++) {
            found = chunks[c] > 0.0f ? c : found;
            if (chunks[c] > 0.0f && target < chunks[c]) break;
            target -= chunks[c];
        }
        if (c * CHUNK >= n) {  /* rounding ran past the end: the last token of positive weight */
            c = found < 0 ? 0 : found;
            target = chunks[c];
        }
        int end = (c + 1) * CHUNK < n ? (c + 1) * CHUNK : n, token = -1;
        double seen = 0.0;
        for (int i = c * CHUNK; i < end && (token < 0 || seen <= target); i++) {
            float w = exp_nonpositive((x[i] - max) * inv_t);
            if (w > 0.0f) token = i;  /* the last positive one, should rounding run out */
            seen += w;
        }
        tokens[r] = token < 0 ? 0 : token;  /* no weight anywhere (all -inf or NaN) */
    }
}

void sample(const float *logits, const float *temperatures, const float *uniform, long rows,
            int n, int64_t *tokens, int threads) {
    struct sample_args args = {logits, temperatures, uniform, n, tokens};
    threads = rows * n >= PARALLEL_MIN ? threads : 1;
    parallel(rows, even_chunk(rows, threads), threads, sample_rows, &args);
}

/* `rows` (at most TILE_ROWS) rows of x times one panel: rows x 2 vector sums in registers, each
   panel row loaded once for all the rows and each x element broadcast once for the panel. Each
   output is one sum over k in order, started from 0 (or from `out`, to accumulate): the same
   arithmetic whatever the rows beside it, so that a row's result never depends on its batch
   (batch invariance). */
static inline __attribute__((always_inline)) void panel_tile(
        const float *x, long x_stride, const float *panel, long panel_stride, int k_size,
        int rows, float *out, long out_stride, int accumulate, const float *ahead, int pace) {
    vec acc[TILE_ROWS][2];
    memset(acc, 0, sizeof acc);
    for (int i = 0; accumulate && i < rows; i++) {
        memcpy(&acc[i][0], out + i * out_stride, sizeof acc[i][0]);
        memcpy(&acc[i][1], out + i * out_stride + LANES, sizeof acc[i][1]);
    }
    for (int k = 0, countdown = pace; k < k_size; k++) {
        if (ahead && --countdown == 0) {  /* a cache line of `ahead` every `pace` k */
            __builtin_prefetch(ahead, 0, 2);
            ahead += PANEL;
            countdown = pace;
        }
        vec w0, w1;
        memcpy(&w0, panel + k * panel_stride, sizeof w0);
        memcpy(&w1, panel + k * panel_stride + LANES, sizeof w1);
        for (int i = 0; i < rows; i++) {
            float b = x[i * x_stride + k];
            acc[i][0] += b * w0;
            acc[i][1] += b * w1;
        }
    }
    for (int i = 0; i < rows; i++) {
        memcpy(out + i * out_stride, &acc[i][0], sizeof acc[i][0]);
        memcpy(out + i * out_stride + LANES, &acc[i][1], sizeof acc[i][1]);
    }
}

/* out (rows, PANEL) (+)= x (rows, k_size) times a panel (k_size, PANEL), its rows panel_stride
   apart: in tiles of at most TILE_ROWS rows, as even as can be (27 = 6+6+5+5+5), each with its
   row count a constant (its loops unrolled, its sums in registers). `next`, a panel (PANEL
   apart) to be read after this one, is asked for while this one computes, a cache line at a
   time, evenly over all the tiles' steps: the CPU's prefetcher stops at 4 KB pages and leaves
   a weight streamed from memory waiting for each panel, and prefetches asked for all at once
   stall the core until the memory answers (each tile's computing then waits for the memory
   instead of overlapping it). Paced, the LM head of a decode batch of 4-16 rows runs 1.3-1.5x
   faster than with a page asked for at the start of each tile. */
static inline __attribute__((always_inline)) void rows_times_panel(
        const float *x, long x_stride, const float *panel, long panel_stride, int k_size,
        long rows, float *out, long out_stride, int accumulate, const float *next) {
    long tiles = (rows + TILE_ROWS - 1) / TILE_ROWS;
    for (long t = 0, m = 0; t < tiles; t++) {
        int size = (int)((rows - m + tiles - t - 1) / (tiles - t));
        /* tile t asks for the t-th share of `next`, a line every `tiles` steps */
        const float *ahead = next ? next + t * k_size / tiles * PANEL : NULL;
        const float *x_m = x + m * x_stride;
        float *out_m = out + m * out_stride;
#define TILE(ROWS) panel_tile(x_m, x_stride, panel, panel_stride, k_size, ROWS, out_m, \
                              out_stride, accumulate, ahead, (int)tiles)
        switch (size) {
        case 1: TILE(1); break;
        case 2: TILE(2); break;
        case 3: TILE(3); break;
        case 4: TILE(4); break;
        case 5: TILE(5); break;
        default: TILE(6); break;
        }
#undef TILE
        m += size;
    }
}

/* out (M, N) = x (M, K) W^T, the weight W (N, K) packed in panels of PANEL output features,
   (N / PANEL, K, PANEL) (see cpu_kernels.pack_panels): for the LM head, whose weight is read
   from memory once a step for few rows (a decode batch), each panel read once for all of them.
   A prefill's rows go by blocks of at most BLOCK_BYTES of x, which stay in the core's L2 cache
   while every panel passes (all of x, megabytes, would come from L3 for each panel: 7% slower). */
struct matmul_args {
    const float *x;
    long x_stride;
    const float *panels;
    long rows;
    int k_size;
    long n, block_rows;
    float *out;
};

/* Tasks b * panels + p: rows block b times panel p; a chunk, consecutive panels of a block.
   The next panel is asked for only where the rows are one block (a decode step's): there each
   panel is read once, from memory. With several blocks (a prefill) each panel comes back for
   every block, from the caches, and asking costs only the asking: without it (a literal NULL,
   so the loop is compiled without the countdown) a prefill's matmuls take 0.75-0.9x the time. */
static void matmul_tasks(const void *args, long first_task, long end) {
    const struct matmul_args *a = args;
    long panels = a->n / PANEL;
    for (long task = first_task; task < end; task++) {
        long b = task / panels, p = task % panels, first = b * a->block_rows;
        long count = first + a->block_rows < a->rows ? a->block_rows : a->rows - first;
        const float *panel = a->panels + p * a->k_size * PANEL, *x = a->x + first * a->x_stride;
        float *out = a->out + first * a->n + p * PANEL;
        if (a->block_rows < a->rows || p + 1 == panels || task + 1 == end)
            rows_times_panel(x, a->x_stride, panel, PANEL, a->k_size, count, out, a->n, 0, NULL);
        else
            rows_times_panel(x, a->x_stride, panel, PANEL, a->k_size, count, out, a->n, 0,
                             panel + a->k_size * PANEL);
    }
}

void panel_matmul(const float *x, long x_stride, const float *panels, long rows, int k_size,
                  long n, float *out, int threads) {
    long blocks = (rows * k_size * (long)sizeof(float) + BLOCK_BYTES - 1) / BLOCK_BYTES;
    struct matmul_args args = {x, x_stride, panels, rows, k_size, n, (rows + blocks - 1) / blocks,
                               out};
    long tasks = blocks * (n / PANEL);
    parallel(tasks, even_chunk(tasks, threads), threads, matmul_tasks, &args);
}

/* The scores of a block's `count` keys (rows `stride` apart) against a tile's queries (`qt`,
   head_dim x PANEL, a query a column): st[t][r] = q_r . k_t, in `dot`'s order (LANES sums over
   d, by d mod LANES, then added up in order), as the decode kernel computes it: a query's
   scores, and so its attention, are the same bits whichever kernel runs it, and whatever runs
   beside it (batch invariance). */
static void key_scores(const float *keys, long stride, const float *qt, int head_dim, int count,
                       float *st) {
    for (int t = 0; t < count; t++) {
        vec part[LANES][2];  /* part[j]: the d = j mod LANES, PANEL queries in two vectors */
        memset(part, 0, sizeof part);
        const float *k = keys + t * stride;
        for (int d = 0; d < head_dim; d += LANES)
            for (int j = 0; j < LANES; j++) {
                vec q0, q1;
                memcpy(&q0, qt + (d + j) * PANEL, sizeof q0);
                memcpy(&q1, qt + (d + j) * PANEL + LANES, sizeof q1);
                part[j][0] += k[d + j] * q0;
                part[j][1] += k[d + j] * q1;
            }
        vec sum0, sum1;
        memset(&sum0, 0, sizeof sum0);
        memset(&sum1, 0, sizeof sum1);
        for (int j = 0; j < LANES; j++) {
            sum0 += part[j][0];
            sum1 += part[j][1];
        }
        memcpy(st + t * PANEL, &sum0, sizeof sum0);
        memcpy(st + t * PANEL + LANES, &sum1, sizeof sum1);
    }
}

/* prefill_attention's tasks: task i is one tile of PANEL rows of one K/V head of a sequence. */
static void attend_tiles(const void *args, long first_task, long end) {
    const struct attention_args *a = args;
    const float *q = a->q, *fp8_table = a->fp8_table;
    const void *k_cache = a->k_cache, *v_cache = a->v_cache;
    const int32_t *cu_seqlens_q = a->cu_seqlens_q, *context_lens = a->context_lens;
    long q_stride = a->q_stride;
    int kv_kind = a->kv_kind, num_heads = a->num_heads, head_dim = a->head_dim;
    int block_size = a->block_size, window = a->window;
    int group = num_heads / a->num_kv_heads, row = a->num_kv_heads * head_dim;
    float scale = a->scale;
    for (long task = first_task; task < end; task++) {
        int seq = 0;
        while (a->first_task[seq + 1] <= task) seq++;
        int queries = cu_seqlens_q[seq + 1] - cu_seqlens_q[seq];
        long tiles = ((long)queries * group + PANEL - 1) / PANEL, index = task - a->first_task[seq];
        int kv_head = (int)(index / tiles), first_row = (int)(index % tiles) * PANEL;
        int rows = queries * group - first_row < PANEL ? queries * group - first_row : PANEL;
        float qt[MAX_HEAD_DIM * PANEL], o[PANEL * MAX_HEAD_DIM], st[MAX_BLOCK * PANEL];
        float p[PANEL * MAX_BLOCK], m[PANEL], l[PANEL];
        float k_buffer[MAX_HEADS * MAX_HEAD_DIM], v_buffer[MAX_HEADS * MAX_HEAD_DIM];
        int position[PANEL];
        const float *q_row[PANEL];
        for (int r = 0; r < PANEL; r++) {  /* row r: token (first_row + r) / group's head */
            int token = (first_row + r) / group, head = kv_head * group + (first_row + r) % group;
            position[r] = context_lens[seq] - queries + token;
            q_row[r] = r < rows ? q + (cu_seqlens_q[seq] + token) * q_stride + head * head_dim
                                : q;  /* a row past the sequence's last: zeros below */
            m[r] = -INFINITY;
            l[r] = 0.0f;
        }
        for (int d = 0; d < head_dim; d++)
            for (int r = 0; r < PANEL; r++) qt[d * PANEL + r] = r < rows ? q_row[r][d] : 0;
        int lowest = position[0], highest = position[rows - 1];
        memset(o, 0, sizeof(float) * PANEL * head_dim);
        int first = window > 0 && lowest + 1 > window ? lowest + 1 - window : 0;
        const int32_t *block_table = a->block_tables + seq * a->block_table_stride;
        for (int b = first / block_size; b <= highest / block_size; b++) {
            int t0 = b == first / block_size ? first % block_size : 0;
            int t1 = b == highest / block_size ? highest % block_size + 1 : block_size;
            long base = (long)block_table[b] * block_size * row + (long)kv_head * head_dim;
            const float *keys = (const float *)k_cache + base;
            const float *values = (const float *)v_cache + base;
            long stride = row;
            if (kv_kind != KV_FLOAT32) {  /* the block's rows of this head, converted */
                for (int t = t0; t < t1; t++) {
                    cache_row(k_cache, kv_kind, fp8_table, base + t * row, head_dim,
                              k_buffer + t * head_dim);
                    cache_row(v_cache, kv_kind, fp8_table, base + t * row, head_dim,
                              v_buffer + t * head_dim);
                }
                keys = k_buffer;
                values = v_buffer;
                stride = head_dim;
            }
            key_scores(keys + t0 * stride, stride, qt, head_dim, t1 - t0, st);
            float m_new[PANEL], alpha[PANEL], sum[PANEL];
            for (int r = 0; r < PANEL; r++) {
                m_new[r] = m[r];
                sum[r] = 0.0f;
            }
            /* keys some row must not see: past the first row's position, or out of the last
               row's window (most blocks have none) */
            int masked = b * block_size + t1 - 1 > lowest
                         || (window > 0 && b * block_size + t0 <= highest - window);
            for (int t = t0; t < t1; t++) {
                int key = b * block_size + t;
                float *s = st + (t - t0) * PANEL;
                for (int r = 0; r < PANEL; r++) {
                    int hidden = key > position[r] || (window > 0 && key <= position[r] - window);
                    s[r] = masked && hidden ? -INFINITY : s[r] * scale;
                    m_new[r] = s[r] > m_new[r] ? s[r] : m_new[r];
                }
            }
            for (int t = t0; t < t1; t++) {
                const float *s = st + (t - t0) * PANEL;
#pragma omp simd
                for (int r = 0; r < PANEL; r++) {  /* no key yet (-inf): weight 0 */
                    float w = m_new[r] == -INFINITY ? 0.0f : exp_nonpositive(s[r] - m_new[r]);
                    p[r * block_size + t - t0] = w;
                    sum[r] += w;
                }
            }
            for (int r = 0; r < PANEL; r++) {
                alpha[r] = m_new[r] == -INFINITY ? 1.0f : exp_nonpositive(m[r] - m_new[r]);
                l[r] = l[r] * alpha[r] + sum[r];
                m[r] = m_new[r];
                if (alpha[r] != 1.0f)  /* the row's maximum grew */
                    for (int d = 0; d < head_dim; d++) o[r * head_dim + d] *= alpha[r];
            }
            for (int c = 0; c < head_dim; c += PANEL)
                rows_times_panel(p, block_size, values + t0 * stride + c, stride, t1 - t0, rows,
                                 o + c, head_dim, 1, NULL);
        }
        for (int r = 0; r < rows; r++) {
            int token = (first_row + r) / group, head = kv_head * group + (first_row + r) % group;
            float *dest = a->out + ((long)(cu_seqlens_q[seq] + token) * num_heads + head) * head_dim;
            for (int d = 0; d < head_dim; d++)
                dest[d] = l[r] > 0.0f ? o[r * head_dim + d] / l[r] : 0.0f;
        }
    }
}

/* Causal attention of prefills, many queries a sequence, as matrix products (the structure of
   the Triton prefill kernel): a task takes PANEL rows, (query token, head) pairs of one K/V
   head's group, their queries transposed once into a panel, and walks the sequence's blocks:
   S^T = K Q^T (the block's keys as rows, read in place), the online softmax vectorized over the
   rows, then O += P V (V's rows in place as a panel). Every row's arithmetic is the decode
   kernel's (`attend`), in its order: scores as `dot` sums them, then scaled; the weights'
   sum in key order; O scaled, then each key's p v added in order. So a query's output is the
   same bits from either kernel, in a prefill, a chunk or a decode step, beside any other
   (batch invariance). Arguments as paged_attention's, with cu_seqlens_q; head_dim a multiple
   of PANEL. Returns 0, or 1 for a shape over the limits. */
int prefill_attention(const float *q, long q_stride, const void *k_cache, const void *v_cache,
                      int kv_kind, const float *fp8_table, const int32_t *block_tables,
                      long block_table_stride, const int32_t *cu_seqlens_q,
                      const int32_t *context_lens, int num_seqs, int num_heads, int num_kv_heads,
                      int head_dim, int block_size, float scale, int window, float *out,
                      int threads) {
    if (head_dim > MAX_HEAD_DIM || head_dim % PANEL || block_size > MAX_BLOCK
        || block_size * head_dim > MAX_HEADS * MAX_HEAD_DIM || num_heads % num_kv_heads)
        return 1;
    int group = num_heads / num_kv_heads;
    long first_task[num_seqs + 1];  /* a sequence's tasks: K/V heads x tiles of its rows */
    first_task[0] = 0;
    for (int i = 0; i < num_seqs; i++) {
        long rows = (long)(cu_seqlens_q[i + 1] - cu_seqlens_q[i]) * group;
        first_task[i + 1] = first_task[i] + num_kv_heads * ((rows + PANEL - 1) / PANEL);
    }
    struct attention_args args = {q, q_stride, k_cache, v_cache, kv_kind, fp8_table,
                                  block_tables, block_table_stride, cu_seqlens_q, context_lens,
                                  num_seqs, num_heads, num_kv_heads, head_dim, block_size,
                                  scale, window, out, first_task};
    parallel(first_task[num_seqs], 1, threads, attend_tiles, &args);  /* a tile a claim */
    return 0;
}
