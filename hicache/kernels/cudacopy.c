/* The copy loop of direct io on drivers without cuMemcpyBatchAsync (built on first use by
 * hicache/kernels/direct_copies.py, like the row copier).
 *
 * It takes the driver's cuMemcpyAsync as a function pointer (cuGetProcAddress, through
 * cuda-python), so it needs no CUDA header or library to build, and issues one asynchronous
 * copy per (dst, src, size) entry on `stream`: a transfer of many short runs costs the driver's
 * per-call time, not a Python call per run on top of it.
 */
#include <stddef.h>
#include <stdint.h>

int64_t hicache_cudacopy_abi(void) { return 1; }

/* CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream stream) */
typedef int (*memcpy_async_fn)(uint64_t dst, uint64_t src, size_t bytes, void *stream);

/* Issue copies 0..n-1 in order. Returns 0, or 1 + the index of the first copy the driver
 * refused (nothing after it is issued), its error code in *error. */
int64_t hicache_copy_loop(void *fn, const uint64_t *dsts, const uint64_t *srcs,
                          const uint64_t *sizes, int64_t n, void *stream, int64_t *error) {
    memcpy_async_fn copy = (memcpy_async_fn)fn;
    for (int64_t i = 0; i < n; i++) {
        int status = copy(dsts[i], srcs[i], (size_t)sizes[i], stream);
        if (status != 0) {
            *error = status;
            return i + 1;
        }
    }
    return 0;
}
