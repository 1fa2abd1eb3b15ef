/* Work split for the one-token GEMVs (ggml_cpu.c, ggml_q8.c): contiguous shares, stolen from the
 * back. Included by each kernel file (each also compiles alone in the tests). */
#ifndef AXON_WORK_SHARES_H
#define AXON_WORK_SHARES_H

#include <stdint.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* A thread's share of the units, [front, back), packed in one word so that its owner (taking
 * the front) and a thief (taking the back) agree on every unit with one compare-and-swap; a
 * cache line each. */
typedef struct {
    uint64_t span;
    char pad[56];
} __attribute__((aligned(64))) Share;

static inline uint64_t span_of(uint64_t front, uint64_t back) { return front << 32 | back; }

/* Units [0, units) split into `threads` contiguous shares. */
static inline void shares_init(Share *shares, int threads, int64_t units) {
    for (int t = 0; t < threads; t++)
        shares[t].span = span_of((uint64_t)(units * t / threads), (uint64_t)(units * (t + 1) / threads));
}

/* The next unit of share s, from its front (own) or back (stolen); -1 when it is empty. */
static inline int64_t take(Share *s, int from_back) {
    uint64_t span = __atomic_load_n(&s->span, __ATOMIC_RELAXED);
    for (;;) {
        const uint64_t front = span >> 32, back = span & 0xffffffffu;
        if (front >= back) return -1;
        const uint64_t next = from_back ? span_of(front, back - 1) : span_of(front + 1, back);
        if (__atomic_compare_exchange_n(&s->span, &span, next, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
            return from_back ? (int64_t)back - 1 : (int64_t)front;
    }
}

/* Thread me's next unit: from its own share's front while it lasts, then from the back of the
 * others' in turn (with fewer threads than shares, the missing ones' shares are all taken by
 * the rest); -1 when every share is empty. *k (0 at first) is where it is in that walk. */
static inline int64_t next_unit(Share *shares, int threads, int me, int *k) {
    for (; *k < threads; ++*k) {
        const int64_t u = take(shares + (me + *k) % threads, *k > 0);
        if (u >= 0) return u;
    }
    return -1;
}

/* Units [0, units) of work, run(ctx, u) each: thread t runs share t in order, then takes units
 * from the back of the other shares. A thread descheduled mid-call (another process woke on its
 * core: the HTTP process between tokens, a busy machine) does not hold the call up by its whole
 * share: the others finish it. Each thread still streams contiguous rows while nobody is
 * descheduled. Returns 0 when a unit failed (run returned 0). */
static int run_shares(int64_t units, int threads, int (*run)(const void *, int64_t), const void *ctx) {
    if (threads > units) threads = (int)units;
    if (threads <= 1) {
        for (int64_t u = 0; u < units; u++)
            if (!run(ctx, u)) return 0;
        return 1;
    }
    Share shares[threads];
    shares_init(shares, threads, units);
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
#ifdef _OPENMP
        const int me = omp_get_thread_num();
#else
        const int me = 0;
#endif
        int k = 0;
        for (int64_t u; (u = next_unit(shares, threads, me, &k)) >= 0;) failed |= !run(ctx, u);
    }
    return !failed;
}

#endif
