// SPDX-License-Identifier: LGPL-2.1-or-later
// Batched chunk copies on the GPU: one launch moves many (src, dst, len) chunks. Pack
// (gather the pages of one layer group into a contiguous staging buffer) and unpack
// (scatter them back) are this kernel with a contiguous destination or source; the
// copy engine path uses it too when a batch has many small chunks. Built by nvcc into a
// fatbin that gpu/pack.c loads with cuModuleLoadData; the descriptor layout is
// GpuChunk in gpu/pack.h.

struct EpdChunk {
        unsigned long long src;
        unsigned long long dst;
        unsigned long long len;
};

#define UNROLL 4

// blockIdx.y picks a chunk (looping when there are more than gridDim.y), blockIdx.x a tile
// of tile_words 16-byte words of it: every block moves at most one tile, so the work is
// spread in small even pieces whatever the chunk sizes (no wave of long blocks leaving
// SMs idle at the end), and blocks past a short chunk's end return at once.
extern "C" __global__ void __launch_bounds__(256)
epd_copy_chunks(const EpdChunk *__restrict__ chunks, unsigned n_chunks, unsigned tile_words) {
        for (unsigned c = blockIdx.y; c < n_chunks; c += gridDim.y) {
                const EpdChunk e = chunks[c];
                const unsigned long long begin = (unsigned long long)blockIdx.x * tile_words;

                if (((e.src | e.dst | e.len) & 15ULL) == 0) {
                        const uint4 *__restrict__ s = (const uint4 *)e.src;
                        uint4 *__restrict__ d = (uint4 *)e.dst;
                        const unsigned long long n = e.len / 16;
                        if (begin >= n)
                                continue;
                        const unsigned long long end = min(begin + tile_words, n);
                        unsigned long long i = begin + threadIdx.x;

                        /* UNROLL independent 16-byte loads in flight per thread. */
                        for (; i + (UNROLL - 1) * 256 < end; i += UNROLL * 256) {
                                uint4 v[UNROLL];
#pragma unroll
                                for (int u = 0; u < UNROLL; u++)
                                        v[u] = __ldcs(s + i + u * 256);
#pragma unroll
                                for (int u = 0; u < UNROLL; u++)
                                        __stcs(d + i + u * 256, v[u]);
                        }
                        for (; i < end; i += 256)
                                __stcs(d + i, __ldcs(s + i));
                } else {
                        const unsigned char *s = (const unsigned char *)e.src;
                        unsigned char *d = (unsigned char *)e.dst;
                        const unsigned long long b0 = begin * 16;
                        if (b0 >= e.len)
                                continue;
                        const unsigned long long end = min(b0 + 16ULL * tile_words, e.len);
                        for (unsigned long long i = b0 + threadIdx.x; i < end; i += 256)
                                d[i] = s[i];
                }
        }
}

// A batch whose chunks all have one length, 16-byte aligned (the same layer group of
// every page, or whole pages): tile t of the batch is tile t % tiles_per_chunk of chunk
// t / tiles_per_chunk, and block b moves tiles b, b + gridDim.x, b + 2 gridDim.x, ...
// The blocks resident at any moment work on neighbouring tiles, so few chunks (and few
// pages of either arena, few TLB entries) are touched at once, as in one contiguous copy.
extern "C" __global__ void __launch_bounds__(256)
epd_copy_uniform(const EpdChunk *__restrict__ chunks, unsigned n_chunks, unsigned long long len_words) {
        const unsigned long long tile = 256 * UNROLL;
        const unsigned long long tiles_per_chunk = (len_words + tile - 1) / tile;
        const unsigned long long n_tiles = tiles_per_chunk * n_chunks;

        for (unsigned long long t = blockIdx.x; t < n_tiles; t += gridDim.x) {
                const EpdChunk e = chunks[t / tiles_per_chunk];
                const unsigned long long begin = (t % tiles_per_chunk) * tile;
                const uint4 *__restrict__ s = (const uint4 *)e.src;
                uint4 *__restrict__ d = (uint4 *)e.dst;
                const unsigned long long i = begin + threadIdx.x;

                if (begin + tile <= len_words) {
                        uint4 v[UNROLL];
#pragma unroll
                        for (int u = 0; u < UNROLL; u++)
                                v[u] = __ldcs(s + i + u * 256);
#pragma unroll
                        for (int u = 0; u < UNROLL; u++)
                                __stcs(d + i + u * 256, v[u]);
                } else {
                        for (unsigned long long k = i; k < len_words; k += 256)
                                __stcs(d + k, __ldcs(s + k));
                }
        }
}

// One layer's K and V between a (1, H, S, D) cache tensor pair and KV pages (kvcopy.h; head
// and token strides in 16-byte words). blockIdx.x picks a page (its tokens [x T, x T + T)
// clipped to the sequence), blockIdx.y K or V and a head: the block moves that head's rows
// of those tokens, T rows of words_per_row words (16 tokens of 256-byte rows: 4 KiB, one
// word a thread). Inside a page a layer's K (or V) is token-major, (T, H, row), so the
// block's rows are heads x row apart there and token_words apart in the tensor; a row is
// contiguous on both sides (coalesced). Index arithmetic is 32-bit, one division a word:
// the grid-stride form before it divided 64-bit indices three times a word. pages[]
// holds each page's address.
__device__ __forceinline__ void
kv_rows_copy(const unsigned long long *__restrict__ pages, unsigned long long k, unsigned long long v,
             unsigned long long tokens, unsigned heads, unsigned words_per_row, unsigned tokens_per_page,
             unsigned long long k_offset, unsigned long long v_offset, unsigned long long head_words,
             unsigned long long token_words, int to_pages) {
        const unsigned kv = blockIdx.y / heads, h = blockIdx.y - kv * heads;
        const unsigned long long first = (unsigned long long)blockIdx.x * tokens_per_page;
        if (first >= tokens)
                return;
        const unsigned long long left = tokens - first;
        const unsigned n_tok = left < tokens_per_page ? (unsigned)left : tokens_per_page;
        const unsigned n = n_tok * words_per_row, page_token = heads * words_per_row;
        uint4 *__restrict__ page = (uint4 *)(pages[blockIdx.x] + (kv ? v_offset : k_offset)) +
                                   (unsigned long long)h * words_per_row;
        uint4 *__restrict__ tensor = (uint4 *)(kv ? v : k) + (unsigned long long)h * head_words +
                                     first * token_words;

        for (unsigned i = threadIdx.x; i < n; i += blockDim.x) {
                const unsigned t = i / words_per_row, w = i - t * words_per_row;
                uint4 *p = page + (unsigned long long)t * page_token + w;
                uint4 *r = tensor + (unsigned long long)t * token_words + w;
                if (to_pages)
                        __stcs(p, __ldcs(r));
                else
                        __stcs(r, __ldcs(p));
        }
}

extern "C" __global__ void __launch_bounds__(256)
epd_kv_rows(const unsigned long long *__restrict__ pages, unsigned long long k, unsigned long long v,
            unsigned long long tokens, unsigned heads, unsigned words_per_row, unsigned tokens_per_page,
            unsigned long long k_offset, unsigned long long v_offset, unsigned long long head_words,
            unsigned long long token_words, int to_pages) {
        kv_rows_copy(pages, k, v, tokens, heads, words_per_row, tokens_per_page, k_offset, v_offset, head_words,
                     token_words, to_pages);
}

// Several layers' K and V in one launch (kvcopy.h: gpu_kv_rows_copy_many): layers of one
// model share the tensors' shape and strides, the row size and the page geometry, and
// differ in their tensors' addresses and their rows' offsets in a page. blockIdx.z picks
// the layer, the rest is epd_kv_rows. The table travels as the launch's parameter
// (__grid_constant__: read in place from the parameter bank, never copied per thread),
// so nothing is uploaded and nothing outlives the launch. Mirrors GpuKvLayers (pack.h).
#define EPD_KV_LAYERS_MAX 64

struct EpdKvLayer {
        unsigned long long k, v, k_offset, v_offset;
};

struct EpdKvLayers {
        unsigned long long tokens, head_words, token_words;
        unsigned heads, words_per_row, tokens_per_page, n_layers;
        int to_pages;
        unsigned pad;
        EpdKvLayer layer[EPD_KV_LAYERS_MAX];
};

extern "C" __global__ void __launch_bounds__(256)
epd_kv_layers(const unsigned long long *__restrict__ pages, const __grid_constant__ EpdKvLayers p) {
        const EpdKvLayer &l = p.layer[blockIdx.z];
        kv_rows_copy(pages, l.k, l.v, p.tokens, p.heads, p.words_per_row, p.tokens_per_page, l.k_offset, l.v_offset,
                     p.head_words, p.token_words, p.to_pages);
}
