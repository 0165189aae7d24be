// CUDA gather/scatter between paged KV layers and cache memory (contract: paged_copy.h).
//
// Mirrors paged_copy.cpp: one launch copies a batch of chunks, all layers and components.
// Grid: x = token of the batch, y = (layer, component). Each block moves one token vector
// (num_heads x head_size elements) in units of unit_bytes (up to 16-byte vector loads, chosen
// by the caller so every address stays aligned). Works for any ComponentView strides; a
// component whose head_size axis is strided (the vllm-cpu K page) moves one element per unit.
// Memory objects may be device memory or pinned host memory (unified addressing).
// Slots < 0 are skipped. A slot outside a layer's blocks (layer_blocks[layer], or num_blocks) is
// never copied: the kernel skips it and records {1, slot} in error_info (device memory), which the
// caller reads after the stream is synchronised. Callers validate slots before launching.

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

#include "paged_copy.h"

#define LMC_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

thread_local char g_last_error[256] = "";

template <typename U>
__global__ void paged_copy_kernel(LmcCopyArgs a) {
  const int64_t j = blockIdx.x;
  int64_t lo = 0, hi = a.num_chunks;  // chunk of batch token j: last k with prefix[k] <= j
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (a.chunk_prefix[mid] <= j)
      lo = mid;
    else
      hi = mid;
  }
  const int64_t* ci = a.chunk_info + 5 * lo;
  const int64_t t = j - a.chunk_prefix[lo];
  const int64_t slot = a.slots[ci[0] + t];
  if (slot < 0) return;
  const int64_t layer = blockIdx.y / a.num_comps, c = blockIdx.y % a.num_comps;
  const int64_t blocks = a.layer_blocks != nullptr ? a.layer_blocks[layer] : a.num_blocks;
  if (slot / a.block_size >= blocks || slot / a.block_size >= a.num_blocks) {
    if (threadIdx.x == 0 && a.error_info != nullptr) {
      a.error_info[1] = slot;
      a.error_info[0] = 1;
    }
    return;
  }

  const int64_t* comp = a.comps + 5 * c;
  const int64_t es = a.elem_size;
  char* paged = reinterpret_cast<char*>(a.layer_ptrs[layer]) +
                (comp[0] + (slot / a.block_size) * comp[1] + (slot % a.block_size) * comp[2]) * es;
  char* mem = reinterpret_cast<char*>(a.mem_ptrs[lo]) + (c * ci[2] + layer * ci[3] + t * ci[4]) * es;

  const int64_t per_unit = static_cast<int64_t>(sizeof(U)) / es;  // elements per unit
  const int64_t units_per_head = a.head_size / per_unit;
  const int64_t head_bytes = comp[3] * es, unit_bytes = comp[4] * es * per_unit;
  for (int64_t k = threadIdx.x; k < a.num_heads * units_per_head; k += blockDim.x) {
    const int64_t h = k / units_per_head, u = k - h * units_per_head;
    U* p = reinterpret_cast<U*>(paged + h * head_bytes + u * unit_bytes);
    U* m = reinterpret_cast<U*>(mem) + k;
    if (a.direction == LMC_GATHER)
      *m = *p;
    else
      *p = *m;
  }
}

template <typename U>
cudaError_t launch(const LmcCopyArgs& a, cudaStream_t stream) {
  const int64_t units = a.num_heads * a.head_size * a.elem_size / static_cast<int64_t>(sizeof(U));
  int threads = static_cast<int>((units + 31) / 32 * 32);
  threads = threads < 32 ? 32 : (threads > 256 ? 256 : threads);
  dim3 grid(static_cast<unsigned>(a.total_tokens), static_cast<unsigned>(a.num_layers * a.num_comps));
  paged_copy_kernel<U><<<grid, threads, 0, stream>>>(a);
  return cudaGetLastError();
}

int fail(const char* what, cudaError_t err) {
  std::snprintf(g_last_error, sizeof(g_last_error), "%s: %s", what, cudaGetErrorString(err));
  return LMC_ERR_CUDA;
}

}  // namespace

LMC_EXPORT int lmc_abi_version(void) { return LMC_ABI_VERSION; }

LMC_EXPORT const char* lmc_cuda_last_error(void) { return g_last_error; }

LMC_EXPORT int lmc_paged_copy_cuda(const LmcCopyArgs* args, int device, void* stream) {
  if (args == nullptr) return LMC_ERR_ARGS;
  const LmcCopyArgs& a = *args;
  const int64_t es = a.elem_size, u = a.unit_bytes;
  if ((es != 1 && es != 2 && es != 4 && es != 8) || (a.direction != LMC_GATHER && a.direction != LMC_SCATTER))
    return LMC_ERR_ARGS;
  if (u < es || u > 16 || (u & (u - 1)) != 0 || (a.head_size * es) % u != 0) return LMC_ERR_ARGS;
  if (a.num_layers <= 0 || a.num_comps <= 0 || a.num_layers * a.num_comps > 65535 || a.total_tokens < 0 ||
      a.total_tokens > 0x7fffffff || a.block_size <= 0 || a.num_heads <= 0 || a.head_size <= 0)
    return LMC_ERR_ARGS;
  if (a.num_chunks == 0 || a.total_tokens == 0) return LMC_OK;
  // The caller's current device is restored afterwards: torch and vLLM keep their own
  // notion of it on this thread.
  int previous = -1;
  cudaError_t err = cudaGetDevice(&previous);
  if (err != cudaSuccess) return fail("cudaGetDevice", err);
  if (previous != device && (err = cudaSetDevice(device)) != cudaSuccess) return fail("cudaSetDevice", err);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (u) {
    case 1: err = launch<uint8_t>(a, s); break;
    case 2: err = launch<uint16_t>(a, s); break;
    case 4: err = launch<uint32_t>(a, s); break;
    case 8: err = launch<uint2>(a, s); break;
    default: err = launch<uint4>(a, s); break;
  }
  if (previous != device) cudaSetDevice(previous);
  if (err != cudaSuccess) return fail("paged_copy_kernel launch", err);
  return LMC_OK;
}
