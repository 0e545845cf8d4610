/* Row copies for the CPU engine (hicache/kernels/native/rowcopy.py builds this on first use).
 *
 * One call moves a batch of equally long rows between two row grids: row i goes from
 * src + src_row(i) * row_bytes to dst + dst_row(i) * row_bytes, where a NULL row table means
 * consecutive rows from `first`. Rows outside [0, limit) are skipped and counted (the caller
 * raises): a planning bug must not become a write to foreign memory. Why not memcpy per row: glibc switches to `rep movsb` at
 * 2 KiB, which some CPUs (and VMs) run at a third of their bandwidth, and a transfer's rows
 * are typically 256 B - 32 KiB. With `streaming`, aligned destinations take non-temporal
 * stores: a large transfer's destination is not read back soon, and skipping the
 * read-for-ownership is what lets a gather keep up with a plain memcpy of the same bytes.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

int64_t hicache_rowcopy_abi(void) { return 6; }

static inline void copy_row(char *d, const char *s, int64_t n, int streaming) {
    int64_t j = 0;
#if defined(__SSE2__)
    if (streaming && (((uintptr_t)d) & 15) == 0) {
        for (; j + 64 <= n; j += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)(s + j));
            __m128i b = _mm_loadu_si128((const __m128i *)(s + j + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(s + j + 32));
            __m128i e = _mm_loadu_si128((const __m128i *)(s + j + 48));
            _mm_stream_si128((__m128i *)(d + j), a);
            _mm_stream_si128((__m128i *)(d + j + 16), b);
            _mm_stream_si128((__m128i *)(d + j + 32), c);
            _mm_stream_si128((__m128i *)(d + j + 48), e);
        }
    }
#endif
    for (; j + 64 <= n; j += 64) __builtin_memcpy(d + j, s + j, 64);
    if (j < n) memcpy(d + j, s + j, (size_t)(n - j));
}

int64_t hicache_copy_rows(char *dst, int64_t dst_limit, const char *src, int64_t src_limit,
                          const int64_t *dst_rows, int64_t dst_first,
                          const int64_t *src_rows, int64_t src_first,
                          int64_t n, int64_t row_bytes, int streaming) {
    int64_t skipped = 0;
    if (row_bytes <= 0) return 0; /* nothing to move */
    /* Scattered rows are latency-bound: each starts a fresh 4 KiB page, where hardware
       prefetchers stop. Ask for the whole source row (up to 4 KiB) about 8 KiB ahead, into
       L2 (prefetcht1): measured best over nta, shorter rows and other distances here. */
    const int64_t lines = row_bytes < 4096 ? row_bytes : 4096;
    const int64_t ahead = row_bytes >= 4096 ? 2 : (8192 / row_bytes > 16 ? 16 : 8192 / row_bytes);
    for (int64_t i = 0; i < n; i++) {
        if (i + ahead < n) {
            int64_t p = src_rows ? src_rows[i + ahead] : src_first + i + ahead;
            if (p >= 0 && p < src_limit)
                for (int64_t j = 0; j < lines; j += 64) __builtin_prefetch(src + p * row_bytes + j, 0, 2);
        }
        int64_t d = dst_rows ? dst_rows[i] : dst_first + i;
        int64_t s = src_rows ? src_rows[i] : src_first + i;
        if (d < 0 || d >= dst_limit || s < 0 || s >= src_limit) {
            skipped++;
            continue;
        }
        copy_row(dst + d * row_bytes, src + s * row_bytes, row_bytes, streaming);
    }
#if defined(__SSE2__)
    if (streaming) _mm_sfence(); /* streamed stores visible before the caller reports the copy done */
#endif
    return skipped;
}


/* Page-structured copies: page pair i moves rows `dst_pages[i] * dst_page_rows + run_dst[r] + k`
 * <- `src_pages[i] * src_page_rows + run_src[r] + k` for every run r and k < run_len[r]. The runs
 * (one page's row pattern, the same for every page) are computed once per pair of row grids, so
 * a transfer needs no per-row table: planning is O(pages) and the loop reads no index per row.
 * A page any of whose rows would fall outside [0, limit) on either side is skipped whole and
 * its rows counted (the caller raises). `prefetch` (byte offsets of source lines within a page,
 * `nprefetch` of them) is touched for the page `ahead` pairs further on: each page starts at a
 * fresh, unpredictable address. */
static inline void copy_small(char *d, const char *s, int64_t n, int streaming) {
    switch (n) {
    case 8: __builtin_memcpy(d, s, 8); return;
    case 16: __builtin_memcpy(d, s, 16); return;
    case 32: __builtin_memcpy(d, s, 32); return;
    case 64: __builtin_memcpy(d, s, 64); return;
    default: copy_row(d, s, n, streaming);
    }
}

int64_t hicache_copy_pages(char *dst, int64_t dst_limit, const char *src, int64_t src_limit,
                           const int64_t *dst_pages, int64_t dst_page_rows,
                           const int64_t *src_pages, int64_t src_page_rows, int64_t npages,
                           const int64_t *run_dst, const int64_t *run_src, const int64_t *run_len,
                           int64_t nruns, int64_t row_bytes, const int64_t *prefetch,
                           int64_t nprefetch, int streaming) {
    int64_t skipped = 0, rows = 0;
    int64_t dlo = INT64_MAX, dhi = INT64_MIN, slo = INT64_MAX, shi = INT64_MIN;
    if (row_bytes <= 0 || nruns <= 0) return 0;
    for (int64_t r = 0; r < nruns; r++) {
        rows += run_len[r];
        if (run_dst[r] < dlo) dlo = run_dst[r];
        if (run_dst[r] + run_len[r] > dhi) dhi = run_dst[r] + run_len[r];
        if (run_src[r] < slo) slo = run_src[r];
        if (run_src[r] + run_len[r] > shi) shi = run_src[r] + run_len[r];
    }
    const int64_t ahead = 2;
    int64_t uniform = run_len[0] * row_bytes; /* the bytes of every run, or 0 if they differ */
    for (int64_t r = 1; r < nruns; r++)
        if (run_len[r] * row_bytes != uniform) uniform = 0;
    if (streaming && uniform >= 64) uniform = 0; /* copy_row streams those */
    for (int64_t i = 0; i < npages; i++) {
        if (nprefetch && i + ahead < npages) {
            int64_t q = src_pages[i + ahead];
            if (q >= 0 && q * src_page_rows + shi <= src_limit) {
                const char *base = src + q * src_page_rows * row_bytes;
                for (int64_t j = 0; j < nprefetch; j++) __builtin_prefetch(base + prefetch[j], 0, 2);
            }
        }
        int64_t d0 = dst_pages[i] * dst_page_rows, s0 = src_pages[i] * src_page_rows;
        if (dst_pages[i] < 0 || src_pages[i] < 0 || d0 + dlo < 0 || d0 + dhi > dst_limit ||
            s0 + slo < 0 || s0 + shi > src_limit) {
            skipped += rows;
            continue;
        }
        char *d = dst + d0 * row_bytes;
        const char *s = src + s0 * row_bytes;
        /* Runs of one short fixed length (page_first's per-token K and V rows: 16 B) copy with
           a constant-size move each: the generic switch per run cost more than the bytes. */
        switch (uniform) {
#define FIXED(N) \
        case N: \
            for (int64_t r = 0; r < nruns; r++) \
                __builtin_memcpy(d + run_dst[r] * row_bytes, s + run_src[r] * row_bytes, N); \
            break;
        FIXED(8) FIXED(16) FIXED(32) FIXED(64)
#undef FIXED
        default:
            for (int64_t r = 0; r < nruns; r++)
                copy_small(d + run_dst[r] * row_bytes, s + run_src[r] * row_bytes,
                           run_len[r] * row_bytes, streaming);
        }
    }
#if defined(__SSE2__)
    if (streaming) _mm_sfence();
#endif
    return skipped;
}

/* The page of one page's run of slots (page_size consecutive slots from a multiple of
 * page_size, inside [0, size)), or -1. */
static inline int64_t run_page(const int64_t *run, int64_t page_size, int64_t size) {
    int64_t first = run[0], diff = 0;
    if (first < 0 || first % page_size || first > size - page_size) return -1;
    for (int64_t j = 1; j < page_size; j++) diff |= run[j] ^ (first + j); /* vectorizes */
    return diff ? -1 : first / page_size;
}

/* The page numbers of a slot array, or an error: slots must be whole pages (`page_size`
 * consecutive slots from a multiple of `page_size`), inside [0, size), no page twice. `seen`
 * is zeroed scratch of size / page_size bytes, left zeroed. Returns 0 with `pages` filled, or
 * 1 at the first problem (the caller finds and names it). */
int64_t hicache_slot_pages(const int64_t *slots, int64_t n, int64_t page_size, int64_t size,
                           unsigned char *seen, int64_t *pages) {
    if (page_size <= 0 || n % page_size) return 1;
    int64_t count = n / page_size, done = 0, bad = 0;
    for (; done < count; done++) {
        int64_t page = run_page(slots + done * page_size, page_size, size);
        if (page < 0 || seen[page]) { bad = 1; break; }
        seen[page] = 1;
        pages[done] = page;
    }
    for (int64_t i = 0; i < done; i++) seen[pages[i]] = 0;
    return bad;
}

/* Token ids as uint32: dst[i] = src[i] for n int64 ids, all of which must be in [0, 2**32).
 * Returns -1, or the index of the first id out of range (dst is then partly written). One pass
 * where numpy takes three (min, max, astype). */
int64_t hicache_u32_ids(const int64_t *src, int64_t n, uint32_t *dst) {
    uint64_t bad = 0;
    for (int64_t i = 0; i < n; i++) {
        bad |= (uint64_t)src[i] >> 32; /* a negative id has its top bits set */
        dst[i] = (uint32_t)src[i];
    }
    if (!bad) return -1;
    for (int64_t i = 0; i < n; i++)
        if ((uint64_t)src[i] >> 32) return i;
    return -1;
}

/* Whether int64 token ids equal uint32 ones, id by id (an id outside [0, 2**32) never does):
 * a cache call given the tokens its match converted reuses that conversion. */
int64_t hicache_u32_same(const int64_t *src, int64_t n, const uint32_t *have) {
    uint64_t diff = 0;
    for (int64_t i = 0; i < n; i++) diff |= (uint64_t)src[i] ^ (uint64_t)have[i]; /* vectorizes */
    return diff == 0;
}

/* A slot ledger's free: `slots` (n, whole aligned pages inside [0, size)) go back on the free
 * stack `free_pages` above `top`, reversed (the next alloc hands them back in order), and
 * their pages stop being held. Every page must be held (1 in `held`) and listed once. Returns
 * the new top, or -1 with nothing changed (the caller finds and names the problem). */
int64_t hicache_ledger_free(const int64_t *slots, int64_t n, int64_t page_size, int64_t size,
                            unsigned char *held, int64_t *free_pages, int64_t top) {
    if (page_size <= 0 || n % page_size) return -1;
    int64_t count = n / page_size, done = 0, bad = 0;
    for (; done < count; done++) {
        int64_t page = run_page(slots + done * page_size, page_size, size);
        if (page < 0 || held[page] != 1) { bad = 1; break; }
        held[page] = 2; /* taken by this call: listed again, it fails the check above */
    }
    if (bad) {
        for (int64_t i = 0; i < done; i++) held[slots[i * page_size] / page_size] = 1;
        return -1;
    }
    for (int64_t i = 0; i < count; i++) {
        int64_t page = slots[i * page_size] / page_size;
        held[page] = 0;
        free_pages[top + count - 1 - i] = page;
    }
    return top + count;
}

/* A slot ledger's alloc: the `count` pages below `top` of the free stack, top first, become
 * held and their slots are written to `out` (count * page_size). The caller checked count. */
void hicache_ledger_alloc(const int64_t *free_pages, int64_t top, int64_t count,
                          int64_t page_size, unsigned char *held, int64_t *out) {
    for (int64_t i = 0; i < count; i++) {
        int64_t page = free_pages[top - 1 - i];
        held[page] = 1;
        int64_t first = page * page_size;
        int64_t *o = out + i * page_size;
        for (int64_t j = 0; j < page_size; j++) o[j] = first + j;
    }
}

/* A copy thread: `hicache_copy_pages` jobs run in submission order on a thread of their own,
 * beside the caller (the event loop), as a GPU's copy engine runs beside the host. A job's
 * `result` is two int64: the rows it skipped, then 1 once done (stored with release order;
 * `hicache_copy_done` reads it with acquire order). The caller keeps every array a job reads
 * or writes alive until the job is done; `hicache_copier_stop` runs what is queued, then
 * joins the thread, so nothing is touched after it returns. */
typedef struct {
    char *dst;
    int64_t dst_limit;
    const char *src;
    int64_t src_limit;
    const int64_t *dst_pages, *src_pages, *run_dst, *run_src, *run_len, *prefetch;
    int64_t dst_page_rows, src_page_rows, npages, nruns, row_bytes, nprefetch;
    int streaming;
    int64_t *result;
} page_job;

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t wake;
    pthread_t thread;
    page_job *ring;
    int64_t cap, head, count; /* jobs waiting: ring[head], ... (count of them) */
    int stop;
} copier;

static void *copier_main(void *arg) {
    copier *c = (copier *)arg;
    pthread_mutex_lock(&c->mu);
    for (;;) {
        while (!c->count && !c->stop) pthread_cond_wait(&c->wake, &c->mu);
        if (!c->count) break; /* stopping, and nothing left to run */
        page_job job = c->ring[c->head];
        pthread_mutex_unlock(&c->mu);
        int64_t skipped = hicache_copy_pages(
            job.dst, job.dst_limit, job.src, job.src_limit, job.dst_pages, job.dst_page_rows,
            job.src_pages, job.src_page_rows, job.npages, job.run_dst, job.run_src, job.run_len,
            job.nruns, job.row_bytes, job.prefetch, job.nprefetch, job.streaming);
        job.result[0] = skipped;
        __atomic_store_n(&job.result[1], 1, __ATOMIC_RELEASE);
        pthread_mutex_lock(&c->mu);
        c->head = (c->head + 1) % c->cap;
        c->count--;
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

/* A started copy thread with room for `cap` waiting jobs, or NULL (out of memory, no thread). */
void *hicache_copier_start(int64_t cap) {
    if (cap < 1) return NULL;
    copier *c = (copier *)calloc(1, sizeof(copier));
    if (!c) return NULL;
    c->ring = (page_job *)calloc((size_t)cap, sizeof(page_job));
    c->cap = cap;
    if (!c->ring || pthread_mutex_init(&c->mu, NULL)) goto fail;
    if (pthread_cond_init(&c->wake, NULL)) goto fail_mu;
    if (pthread_create(&c->thread, NULL, copier_main, c)) goto fail_cond;
    return c;
fail_cond:
    pthread_cond_destroy(&c->wake);
fail_mu:
    pthread_mutex_destroy(&c->mu);
fail:
    free(c->ring);
    free(c);
    return NULL;
}

/* Queue a `hicache_copy_pages` job (same arguments, then `result`); 0, or -1 when the ring is
 * full or the thread stopping (nothing queued: the caller copies itself). */
int64_t hicache_copier_submit(void *handle, char *dst, int64_t dst_limit, const char *src,
                              int64_t src_limit, const int64_t *dst_pages, int64_t dst_page_rows,
                              const int64_t *src_pages, int64_t src_page_rows, int64_t npages,
                              const int64_t *run_dst, const int64_t *run_src,
                              const int64_t *run_len, int64_t nruns, int64_t row_bytes,
                              const int64_t *prefetch, int64_t nprefetch, int streaming,
                              int64_t *result) {
    copier *c = (copier *)handle;
    pthread_mutex_lock(&c->mu);
    if (c->stop || c->count == c->cap) {
        pthread_mutex_unlock(&c->mu);
        return -1;
    }
    page_job *job = &c->ring[(c->head + c->count) % c->cap];
    job->dst = dst, job->dst_limit = dst_limit, job->src = src, job->src_limit = src_limit;
    job->dst_pages = dst_pages, job->dst_page_rows = dst_page_rows;
    job->src_pages = src_pages, job->src_page_rows = src_page_rows, job->npages = npages;
    job->run_dst = run_dst, job->run_src = run_src, job->run_len = run_len, job->nruns = nruns;
    job->row_bytes = row_bytes, job->prefetch = prefetch, job->nprefetch = nprefetch;
    job->streaming = streaming, job->result = result;
    result[0] = 0;
    result[1] = 0;
    c->count++;
    pthread_cond_signal(&c->wake);
    pthread_mutex_unlock(&c->mu);
    return 0;
}

/* A job's skipped rows once it is done, else -1. */
int64_t hicache_copy_done(const int64_t *result) {
    return __atomic_load_n(&result[1], __ATOMIC_ACQUIRE) ? result[0] : -1;
}

/* Run what is queued, stop the thread, free the copier. */
void hicache_copier_stop(void *handle) {
    copier *c = (copier *)handle;
    pthread_mutex_lock(&c->mu);
    c->stop = 1;
    pthread_cond_signal(&c->wake);
    pthread_mutex_unlock(&c->mu);
    pthread_join(c->thread, NULL);
    pthread_cond_destroy(&c->wake);
    pthread_mutex_destroy(&c->mu);
    free(c->ring);
    free(c);
}
