/*
 * C ABI of lmcache's native paged-KV copy kernels (CPU: paged_copy.cpp, CUDA: paged_copy_cuda.cu).
 *
 * Python binds these through ctypes (lmcache/v1/gpu_connector/native.py); ctypes releases the
 * GIL for the duration of every call. The caller owns every buffer before and after a call;
 * nothing is retained.
 *
 * One call copies a whole batch of chunks, all layers, all components (K and V, or the single
 * MLA latent):
 *
 *   gather  (direction 0): paged KV  -> cache memory
 *   scatter (direction 1): cache memory -> paged KV
 *
 * Paged side. Layer l starts at layer_ptrs[l]. Component c's element (block b, token-in-block n,
 * head h, dim d) sits at element index
 *     comps[c].offset + b*block_stride + n*token_stride + h*head_stride + d*dim_stride
 * (the ComponentView of lmcache/v1/gpu_connector/layouts.py), every layer with the same strides.
 * Token i of the request lives in slot slots[i] = block*block_size + n; negative slots are skipped.
 * Layer l holds layer_blocks[l] blocks (<= num_blocks); layers may differ. Every run of slots is
 * checked against every layer's block count before anything is copied (once per run, not per
 * element): a slot outside any layer fails the call with LMC_ERR_SLOT and nothing is written.
 *
 * Memory side. Chunk k holds tokens [start_k, start_k + count_k) of the request. Its element
 * (c, l, t, h*head_size + d) sits at element index c*stride_c + l*stride_l + t*stride_t + h*D + d
 * from mem_ptrs[k] (a 4-D [C, L, T, hidden] view whose last dim is contiguous: KV_2LTD,
 * KV_MLA_FMT, or a KV_T2D object seen as [2, 1, T, hidden] with stride_t = 2*hidden).
 *
 * All strides are in elements; all pointers and strides are 64-bit.
 */
#ifndef LMCACHE_PAGED_COPY_H_
#define LMCACHE_PAGED_COPY_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped whenever LmcCopyArgs or a function signature changes; native.py refuses a mismatch. */
#define LMC_ABI_VERSION 2

#define LMC_GATHER 0
#define LMC_SCATTER 1

/* flags */
#define LMC_FLAG_NT_AUTO 0      /* non-temporal stores when the call moves many bytes */
#define LMC_FLAG_NT_ALWAYS 1    /* always (tests use it to cover that path on small shapes) */
#define LMC_FLAG_NT_NEVER 2

/* return codes */
#define LMC_OK 0
#define LMC_ERR_ARGS 1          /* malformed arguments (sizes, element size, chunk range) */
#define LMC_ERR_SLOT 2          /* a slot outside some layer's blocks; error_info = {index, slot} */
#define LMC_ERR_BOUNDS 3        /* bounds-checked build only: an access left its buffer */
#define LMC_ERR_CUDA 4          /* CUDA launch failure; see lmc_cuda_last_error() */
#define LMC_ERR_NOMEM 5         /* could not allocate the small per-call work arrays */

typedef struct LmcCopyArgs {
  int64_t direction;     /* LMC_GATHER or LMC_SCATTER */
  int64_t elem_size;     /* bytes per element: 1, 2, 4 or 8 */
  int64_t num_layers;
  int64_t num_comps;     /* 2 (K, V) or 1 (MLA) */
  int64_t num_chunks;
  int64_t num_blocks;
  int64_t block_size;
  int64_t num_heads;
  int64_t head_size;
  int64_t num_slots;     /* length of slots */
  int64_t num_threads;   /* CPU only: worker threads (1 = the calling thread only) */
  int64_t flags;         /* LMC_FLAG_NT_* (CPU only) */
  int64_t unit_bytes;    /* CUDA only: bytes moved per load/store (1..16, divides every offset) */
  int64_t total_tokens;  /* CUDA only: sum of chunk counts */
  const int64_t* comps;        /* [num_comps][5]: offset, block_stride, token_stride, head_stride, dim_stride */
  const uint64_t* layer_ptrs;  /* [num_layers] */
  const int64_t* slots;        /* [num_slots] */
  const int64_t* chunk_info;   /* [num_chunks][5]: start, count, stride_c, stride_l, stride_t */
  const uint64_t* mem_ptrs;    /* [num_chunks] */
  const int64_t* chunk_prefix; /* CUDA only: [num_chunks + 1] running sum of counts */
  const uint64_t* layer_bounds; /* bounds-checked build: [num_layers][2] byte range [lo, hi) */
  const uint64_t* mem_bounds;   /* bounds-checked build: [num_chunks][2] byte range [lo, hi) */
  int64_t* error_info;          /* [2] out, may be NULL (CUDA: device memory, {1, slot} when a slot was skipped) */
  const int64_t* layer_blocks;  /* [num_layers] blocks of each layer (NULL: num_blocks for all) */
} LmcCopyArgs;

int lmc_abi_version(void);
/* 1 when compiled with LMC_BOUNDS_CHECK (every access checked against the bounds arrays). */
int lmc_bounds_checked(void);
/* Blocking CPU copy; returns LMC_OK or an LMC_ERR_* code. */
int lmc_paged_copy(const LmcCopyArgs* args);

/* CUDA library only. Pointer fields point to device (or host-mapped) memory; the scalar fields
 * are read on the host. Enqueues one kernel on `stream` (a cudaStream_t) and returns without
 * waiting. */
int lmc_paged_copy_cuda(const LmcCopyArgs* args, int device, void* stream);
const char* lmc_cuda_last_error(void);

#ifdef __cplusplus
}
#endif

#endif /* LMCACHE_PAGED_COPY_H_ */
