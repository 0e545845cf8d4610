/* Chained page hashes in one call: out[i] = SHA-256(out[i-1] || page i), out[-1] = `prior`
 * (prior_len bytes, 0 or 32). The SHA-256 is the process's libcrypto (the one hashlib uses),
 * reached through the three function addresses the caller passes, so nothing links here. */
#include <stdint.h>
#include <string.h>

typedef int (*sha_init_fn)(void *ctx);
typedef int (*sha_update_fn)(void *ctx, const void *data, size_t len);
typedef int (*sha_final_fn)(unsigned char *md, void *ctx);

int64_t hicache_pagehash_abi(void) { return 1; }

int64_t hicache_chain_sha256(void *init_addr, void *update_addr, void *final_addr,
                             const unsigned char *prior, int64_t prior_len,
                             const unsigned char *raw, int64_t stride, int64_t pages,
                             unsigned char *out) {
    sha_init_fn init = (sha_init_fn)init_addr;
    sha_update_fn update = (sha_update_fn)update_addr;
    sha_final_fn final = (sha_final_fn)final_addr;
    _Alignas(16) unsigned char ctx[512]; /* SHA256_CTX is 112 bytes */
    const unsigned char *prev = prior;
    int64_t prev_len = prior_len;
    for (int64_t i = 0; i < pages; i++) {
        if (!init(ctx)) return i + 1;
        if (prev_len && !update(ctx, prev, (size_t)prev_len)) return i + 1;
        if (!update(ctx, raw + i * stride, (size_t)stride)) return i + 1;
        if (!final(out + 32 * i, ctx)) return i + 1;
        prev = out + 32 * i;
        prev_len = 32;
    }
    return 0;
}
