/* Row copies for the CPU engine (hicache/kernels/native.py builds this on first use).
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
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

int64_t hicache_rowcopy_abi(void) { return 2; }

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
