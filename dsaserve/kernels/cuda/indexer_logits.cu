// FP8 indexer logits of prefill tiles on Hopper (sm_90a), with the tensor cores driven directly
// (wgmma from shared memory) and the epilogue written out by hand.
//
// The Triton and Gluon kernels (dsaserve/kernels/triton/indexer*.py) compute the same thing and
// are issue-bound: per page of 64 keys and 256 query rows each warp issues ~506 instructions
// against 554 cycles of tensor-core work, of which 256 are the irreducible ReLU and weighted head
// sum and the rest the compilers' reductions (a full butterfly per value), layout round trips for
// the group maxima and per-element masks. Here a consumer warp issues 226 (64 heads) or 247 (32
// heads) per page and 128 query rows, 131 of them the ReLU, the weighted sum and the group
// maxima; with LIN, 163 or 183 (docs/kernels.md has the counts):
//
//   block of (CONSUMERS + 1) · 128 threads = one tile of up to CONSUMERS · BT tokens of one
//   request (BT = N / H), and one chunk of the request's key pages
//     warp 4·CONSUMERS (producer): copies each live page of the chunk (64 keys: 8 KB of e4m3
//       rows, then 64 fp32 scales) into a ring of kStages slots with cp.async, the rows into the
//       128-byte swizzle wgmma reads; once a page has landed it fences it for the async proxy
//       and arrives on the slot's `full` barrier (the other three warps leave at once)
//     warpgroup c < CONSUMERS (consumer): quantizes its BT tokens' queries (N rows) into shared
//       memory (a power-of-two scale per (token, head) row, folded into the head weight), then
//       per page: S = K·Qᵀ [64 keys, N rows] by four m64nNk32 e4m3 wgmmas (keys as M, (token,
//       head) as N), frees the slot (one arrival per warp on `empty`), and reduces ReLU(S)·w
//       over the heads in registers (an FMNMX and an FFMA per product; with LIN one FFMA of
//       |S|, and the linear half from 8 more MMA rows: see 1b), then a reduce-scatter across
//       the quad of lanes that shares two key rows (each lane ends with BT / 2 of the sums, not
//       all of them), · k_scale, −inf at and past each token's causal limit (only on pages some
//       token of the consumer does not wholly see), stored through per-token row pointers; the
//       max of every 8 keys by one shuffle chain for both groups a lane's rows fall in, stored
//       by one lane of eight. With DEPTH = 2 it issues page b + 1's MMA before it reduces page b.
//
// The consumers share each page: a page's 8.25 KB are read once from L2 for CONSUMERS · N query
// rows, and while one warpgroup reduces the others' wgmmas keep the tensor cores busy.

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

#include "mbarrier.cuh"

// wgmma and the 128-byte swizzle are sm_90a features: other targets build a stub that traps.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define DSASERVE_SM90A 1
#endif

namespace {

constexpr int kDim = 128;                        // index head dim: bytes of an e4m3 key row
constexpr int kBlock = 64;                       // keys per cache page
constexpr int kValueBytes = kBlock * kDim;       // a page: e4m3 rows ...
constexpr int kPageBytes = kBlock * (kDim + 4);  // ... then one fp32 scale per key
constexpr int kGroup = 8;                        // keys per group maximum (row_topk.GROUP)
constexpr int kStages = 12;                      // pages in the ring
constexpr int kLag = 5;  // pages in flight before the producer waits for the oldest to land
constexpr float kFp8Max = 448.f;
constexpr float kMinAmax = 1e-4f;  // formats.INDEX_MIN_AMAX

template <int CONSUMERS, int N>  // N: the MMA's N, query rows per consumer (+ 8 linear rows)
struct Shared {
  uint8_t keys[kStages][kValueBytes];  // 128-byte swizzled rows (1024-byte aligned tiles)
  uint8_t q[CONSUMERS][N * kDim];      // the same layout
  float scales[kStages][kBlock];
  float w[CONSUMERS][N];  // head weight · the row's q scale
  float lin[CONSUMERS][8][2];  // per token: the scales of its linear rows' two parts
  uint64_t full[kStages];
  uint64_t empty[kStages];
};

// Threads: CONSUMERS warpgroups, then a producer warpgroup of which one warp works. The producer
// gives back registers (setmaxnreg) so that the consumers can hold their accumulators, weights
// and sums: 3 consumers would have 128 registers each otherwise, and spill.
template <int CONSUMERS>
__host__ __device__ constexpr int threads() {
  return (CONSUMERS + 1) * 128;
}
constexpr int kProducerRegs = 56;
template <int CONSUMERS>
__host__ __device__ constexpr int consumer_regs() {  // 64K less the producer's, by 8s
  constexpr int regs = (65536 / 128 - kProducerRegs) / CONSUMERS / 8 * 8;
  return regs < 232 ? regs : 232;
}

template <int CONSUMERS, int N>
constexpr size_t smem_bytes() {
  return sizeof(Shared<CONSUMERS, N>);
}

#ifdef DSASERVE_SM90A
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(dst)), "l"(src)
               : "memory");
}

// Shared-memory writes of the generic proxy (st.shared, cp.async) made visible to the async
// proxy (wgmma reads its operands through it); the writer fences, then synchronizes.
__device__ __forceinline__ void fence_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// wgmma operand descriptor of a K-major tile in the 128-byte swizzle: rows of 128 bytes, row r's
// 16-byte chunk c stored at chunk c ^ (r % 8), groups of 8 rows 1024 bytes apart. The high word
// (8-row stride, swizzle mode) is the same for every tile; the low word is the address / 16 (and
// an unused leading offset of 1), so a k-step of 32 bytes adds 2 to it: 32-bit arithmetic only.
__device__ __forceinline__ uint32_t desc_lo(const void* tile) {
  return (smem_addr(tile) >> 4) | (1u << 16);
}

__device__ __forceinline__ uint64_t kmajor_desc(uint32_t lo) {
  constexpr uint32_t kHi = (1024 >> 4) | (1u << 30);
  uint64_t desc;
  asm("mov.b64 %0, {%1, %2};" : "=l"(desc) : "r"(lo), "r"(kHi));
  return desc;
}

// The accumulators are live across the asynchronous MMA: keep the compiler from moving their
// reads or writes over the fence, the issue or the wait.
template <int N>
__device__ __forceinline__ void pin(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

template <int PENDING>
__device__ __forceinline__ void wgmma_wait() {  // until at most PENDING groups are in flight
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(PENDING) : "memory");
}

// d [64 keys, N rows] (+)= A [64, 32] · B [N, 32]ᵀ (N = 128 or 256), e4m3 operands in shared
// memory, fp32 accumulators in the wgmma fragment: thread (warp v, lane l) of the warpgroup holds
// rows 16v + l/4 (d[4i], d[4i+1]) and 16v + l/4 + 8 (d[4i+2], d[4i+3]), columns 8i + 2(l%4) +
// {0, 1}. Inline PTX names every accumulator register: the lists below serve both shapes.
#define DSASERVE_REGS_0_63 \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, " \
  "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, " \
  "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, " \
  "%53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define DSASERVE_ACC8(i)                                                                     \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
      "+f"(d[i + 6]), "+f"(d[i + 7])
#define DSASERVE_ACC64(i)                                                                 \
  DSASERVE_ACC8(i), DSASERVE_ACC8(i + 8), DSASERVE_ACC8(i + 16), DSASERVE_ACC8(i + 24),   \
      DSASERVE_ACC8(i + 32), DSASERVE_ACC8(i + 40), DSASERVE_ACC8(i + 48), DSASERVE_ACC8(i + 56)

__device__ __forceinline__ void wgmma_m64n128k32(float (&d)[64], uint64_t a, uint64_t b,
                                                 int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
      "{" DSASERVE_REGS_0_63 "}, %64, %65, p, 1, 1;\n}\n"
      : DSASERVE_ACC64(0)
      : "l"(a), "l"(b), "r"(accumulate));
}
__device__ __forceinline__ void wgmma_m64n136k32(float (&d)[68], uint64_t a, uint64_t b,
                                                 int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %70, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n136k32.f32.e4m3.e4m3 "
      "{" DSASERVE_REGS_0_63 ", %64, %65, %66, %67}, %68, %69, p, 1, 1;\n}\n"
      : DSASERVE_ACC64(0), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67])
      : "l"(a), "l"(b), "r"(accumulate));
}
__device__ __forceinline__ void wgmma_m64n256k32(float (&d)[128], uint64_t a, uint64_t b,
                                                 int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3 "
      "{" DSASERVE_REGS_0_63 ", "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, "
      "%81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, "
      "%98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, "
      "%126, %127"
      "}, %128, %129, p, 1, 1;\n}\n"
      : DSASERVE_ACC64(0), DSASERVE_ACC64(64)
      : "l"(a), "l"(b), "r"(accumulate));
}
#undef DSASERVE_ACC64
#undef DSASERVE_ACC8
#undef DSASERVE_REGS_0_63

template <int N>
__device__ __forceinline__ void wgmma(float (&d)[N / 2], uint64_t a, uint64_t b, int accumulate) {
  if constexpr (N == 256) {
    wgmma_m64n256k32(d, a, b, accumulate);
  } else if constexpr (N == 136) {
    wgmma_m64n136k32(d, a, b, accumulate);
  } else {
    static_assert(N == 128, "128, 128 + 8 or 256 query rows per consumer");
    wgmma_m64n128k32(d, a, b, accumulate);
  }
}
#endif  // DSASERVE_SM90A

__device__ __forceinline__ float2 fp8x2_to_float2(uint32_t bits) {  // two e4m3, exactly
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(bits), __NV_E4M3);
  return __half22float2(__half2(h));
}

__device__ __forceinline__ uint32_t fp8x4(float a, float b, float c, float d) {  // → e4m3 × 4
  return uint32_t(__nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3)) |
         uint32_t(__nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, __NV_E4M3)) << 16;
}

__device__ __forceinline__ float pow2_ceil(float x) {  // 2^ceil(log2 x), x > 0 normal: exact
  const uint32_t bits = __float_as_uint(x);
  const uint32_t exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0);
  return __uint_as_float(exponent << 23);
}

#ifdef DSASERVE_SM90A
// Producer warp: the live pages of the chunk, in order, through the ring. A page's copies form
// one cp.async group; once kLag newer groups are issued the page has landed (groups complete in
// order), and each lane fences its own copies and arrives on the slot's `full` barrier.
template <int CONSUMERS, int N>
__device__ void produce(Shared<CONSUMERS, N>& sh, const uint8_t* cache, const int* blocks,
                        int num_live, int lane) {
  const auto publish = [&](int b) {
    fence_async_shared();
    mbar_arrive(&sh.full[b % kStages]);
  };
  // Lane l copies chunk l % 8 of row 4j + l / 8 of each page, to chunk (l % 8) ^ (row % 8):
  // row % 8 is l / 8 for even j, l / 8 + 4 for odd j.
  const int even = (lane / 8) * kDim + ((lane % 8) ^ (lane / 8)) * 16;
  const int odd = (lane / 8) * kDim + ((lane % 8) ^ (lane / 8 + 4)) * 16;
  for (int base = 0; base < num_live; base += 32) {
    const int n = min(32, num_live - base);
    const int mine = lane < n ? blocks[base + lane] : 0;  // block ids of the next 32 pages
    for (int i = 0; i < n; ++i) {
      const int b = base + i, s = b % kStages;
      mbar_wait(&sh.empty[s], ((b / kStages) & 1) ^ 1);  // its previous page is consumed
      const uint8_t* src = cache + int64_t(__shfl_sync(~0u, mine, i)) * kPageBytes;
#pragma unroll
      for (int j = 0; j < kValueBytes / 16 / 32; ++j) {  // rows 4j … 4j + 3, 16 bytes a lane
        cp_async16(sh.keys[s] + j * 512 + (j % 2 ? odd : even), src + j * 512 + lane * 16);
      }
      if (lane < kBlock * 4 / 16) {
        cp_async16(&sh.scales[s][lane * 4], src + kValueBytes + lane * 16);
      }
      asm volatile("cp.async.commit_group;" ::: "memory");
      if (b >= kLag) {
        asm volatile("cp.async.wait_group %0;" ::"n"(kLag) : "memory");
        publish(b - kLag);
      }
    }
  }
  asm volatile("cp.async.wait_all;" ::: "memory");
  for (int b = max(0, num_live - kLag); b < num_live; ++b) publish(b);
}

// One consumer warpgroup: its BT tokens' queries against every page of the chunk.
template <int H, int CONSUMERS, int DEPTH, int N, bool LIN, int NQ = N + (LIN ? 8 : 0)>
__device__ void consume(Shared<CONSUMERS, NQ>& sh, int c, const __nv_bfloat16* q, const float* w,
                        const int* limits, float* out, int64_t stride_out, float* gmax,
                        int64_t stride_gmax, int tok0, int ntok, int first, int num_live,
                        int chunk_pages, int s_out) {
  constexpr int BT = N / H;     // tokens per consumer
  constexpr int SPAN = H / 8;   // fragment column blocks (8 columns) per token
  static_assert(BT == 2 || BT % 4 == 0, "the reduce-scatter leaves BT / 2 sums per lane");
  static_assert(DEPTH == 1 || DEPTH == 2, "one or two pages in flight per consumer");
  static_assert(!LIN || BT <= 4, "the linear rows: 8, two per token (four with BT = 2)");
  const int tid = threadIdx.x % 128, wq = tid / 32, lane = tid % 32;
  const int ctok = tok0 + c * BT;     // this consumer's first token
  const int nt = min(BT, ntok - c * BT);  // and how many it has (≤ 0: none)

  // 1. Query rows n = tid, tid + 128, … = (token n / H, head n % H) → e4m3 in the swizzled
  //    tile, the power-of-two scale folded into the head weight (formats.quantize_index_q).
#pragma unroll 1
  for (int n = tid; n < N; n += 128) {
    const int t = n / H;
    const bool ok = t < nt;
    const int64_t row = int64_t(ctok + t) * H + n % H;
    uint4 x[kDim / 8] = {};  // 128 bf16 (0 for rows past the tile's tokens)
    if (ok) {
      const uint4* src = reinterpret_cast<const uint4*>(q + row * kDim);
#pragma unroll
      for (int i = 0; i < kDim / 8; ++i) x[i] = src[i];
    }
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(x);
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < kDim / 2; ++i) {
      const float2 f = __bfloat1622float2(h[i]);
      amax = fmaxf(amax, fmaxf(fabsf(f.x), fabsf(f.y)));
    }
    const float scale = pow2_ceil(fmaxf(amax, kMinAmax) / kFp8Max);
    const float inv = 1.f / scale;  // exact: a power of two
    uint8_t* dst = sh.q[c] + n * kDim;
#pragma unroll
    for (int i = 0; i < kDim / 16; ++i) {  // 16 values → one 16-byte chunk
      uint32_t packed[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 a = __bfloat1622float2(h[8 * i + 2 * e]);
        const float2 b = __bfloat1622float2(h[8 * i + 2 * e + 1]);
        const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a.x * inv, a.y * inv),
                                                     __NV_SATFINITE, __NV_E4M3);
        const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(b.x * inv, b.y * inv),
                                                     __NV_SATFINITE, __NV_E4M3);
        packed[e] = lo | (hi << 16);
      }
      *reinterpret_cast<uint4*>(dst + (i ^ (n % 8)) * 16) =
          make_uint4(packed[0], packed[1], packed[2], packed[3]);
    }
    sh.w[c][n] = ok ? w[row] * scale : 0.f;
  }
  fence_async_shared();
  asm volatile("bar.sync %0, 128;" ::"r"(c + 1) : "memory");  // this warpgroup only
  if constexpr (LIN) {
    // 1b. With LIN the epilogue uses ReLU(x) = (x + |x|) / 2: Σ_h w_h ReLU(x_h) is half of
    //     Σ_h w_h |x_h| (one FFMA per product, where max and FFMA took two) and half of the
    //     linear Σ_h w_h x_h = c · k, c = Σ_h w_h q̂_h, which the tensor cores compute as 8 more
    //     rows of the MMA's N: per token c as e4m3 hi + lo / 16 at a power-of-two scale s (c −
    //     s·hi is at most |c| / 16 per element, so the pair holds c to about 2^-8 of |c|).
    //     A warp makes four dimensions of one token's c per lane from the quantized rows.
    for (int p = tid; p < BT * 32; p += 128) {
      const int t = p / 32, d0 = 4 * (p % 32);
      float cs[4] = {};
#pragma unroll 4
      for (int h = 0; h < H; ++h) {
        const int n = t * H + h;
        const uint32_t bytes = *reinterpret_cast<const uint32_t*>(
            sh.q[c] + n * kDim + ((d0 / 16) ^ (n % 8)) * 16 + d0 % 16);
        const float wn = sh.w[c][n];
        const float2 f01 = fp8x2_to_float2(bytes & 0xFFFF), f23 = fp8x2_to_float2(bytes >> 16);
        cs[0] = fmaf(wn, f01.x, cs[0]);
        cs[1] = fmaf(wn, f01.y, cs[1]);
        cs[2] = fmaf(wn, f23.x, cs[2]);
        cs[3] = fmaf(wn, f23.y, cs[3]);
      }
      float amax = 0.f;
#pragma unroll
      for (int i = 0; i < 4; ++i) amax = fmaxf(amax, fabsf(cs[i]));
      amax = __uint_as_float(__reduce_max_sync(~0u, __float_as_uint(amax)));  // the token's
      const float scale = pow2_ceil(fmaxf(amax, kMinAmax) / kFp8Max);
      const float inv = 1.f / scale;
      const uint32_t hi = fp8x4(cs[0] * inv, cs[1] * inv, cs[2] * inv, cs[3] * inv);
      const float2 h01 = fp8x2_to_float2(hi & 0xFFFF), h23 = fp8x2_to_float2(hi >> 16);
      const uint32_t lo = fp8x4((cs[0] * inv - h01.x) * 16.f, (cs[1] * inv - h01.y) * 16.f,
                                (cs[2] * inv - h23.x) * 16.f, (cs[3] * inv - h23.y) * 16.f);
      // Rows N + 2t (hi), N + 2t + 1 (lo): fragment columns 2(l % 4), +1 are token l % 4's.
      // With BT = 2 each token has four rows (hi, lo, hi, lo): lane l's are token (l % 4) / 2.
#pragma unroll
      for (int r = 0; r < (BT == 2 ? 4 : 2); ++r) {
        const int n = N + (BT == 2 ? 4 : 2) * t + r;
        *reinterpret_cast<uint32_t*>(sh.q[c] + n * kDim + ((d0 / 16) ^ (n % 8)) * 16 +
                                     d0 % 16) = r % 2 ? lo : hi;
      }
      if (p % 32 == 0) {  // the ½ of the identity folded in
        sh.lin[c][t][0] = 0.5f * scale;
        sh.lin[c][t][1] = 0.5f * scale / 16.f;
      }
    }
    fence_async_shared();
    asm volatile("bar.sync %0, 128;" ::"r"(c + 1) : "memory");
  }

  // 2. What this thread needs per page: the weights of its fragment columns, and where its
  //    sums go. After the reduce-scatter each lane keeps OUT = BT / 2 sums: with BT ≥ 4 both
  //    key rows (row, row + 8: one in each group of 8 keys) of tokens 4m + lane % 4, so that the
  //    two groups' maxima take one shuffle chain; with BT = 2 token hi1 of row + 8·hi0.
  constexpr int OUT = BT / 2;
  constexpr int KT = BT >= 4 ? BT / 4 : 1;  // tokens per lane
  const int hi0 = lane & 1, hi1 = (lane >> 1) & 1, bit2 = (lane >> 2) & 1;
  constexpr float kHalf = LIN ? 0.5f : 1.f;  // the identity's ½ (LIN)
  float wr[2 * N / 8];
#pragma unroll
  for (int i = 0; i < N / 8; ++i) {
    wr[2 * i] = kHalf * sh.w[c][8 * i + 2 * (lane % 4)];
    wr[2 * i + 1] = kHalf * sh.w[c][8 * i + 2 * (lane % 4) + 1];
  }
  const int row = 16 * wq + lane / 4 + (BT == 2 ? 8 * hi0 : 0);  // key of the page (+ 8 h)
  const int group = 2 * wq + (BT == 2 ? hi0 : bit2);  // group of the page whose max it stores
  const bool group_lane = lane < (BT == 2 ? 4 : 8);   // holds its group's max after the chain
  const int num_groups = (s_out + kGroup - 1) / kGroup;
  int lim[KT];  // the tokens' causal limits, −1 past the tile
  float lin_hi[KT], lin_lo[KT];  // LIN: the scales of their linear rows' parts (½ folded in)
  float* orow[KT];  // where key 0 of each token's row goes, + row
  float* grow[KT];  // and group 0 of its maxima, + group
  int fast_end = nt >= BT ? s_out : -1;  // pages ending here need no mask (uniform)
#pragma unroll
  for (int m = 0; m < KT; ++m) {
    const int t = BT == 2 ? hi1 : 4 * m + lane % 4;
    lim[m] = t < nt ? limits[ctok + t] : -1;
    lin_hi[m] = LIN ? sh.lin[c][t][0] : 0.f;
    lin_lo[m] = LIN ? sh.lin[c][t][1] : 0.f;
    const int64_t tok = t < nt ? ctok + t : 0;
    orow[m] = out + tok * stride_out + row;
    grow[m] = gmax + tok * stride_gmax + group;
  }
  for (int t = 0; t < BT; ++t) fast_end = min(fast_end, t < nt ? limits[ctok + t] : -1);
  // Page key0's sums x (x[2m + h]: token m, row + 8h; BT = 2: x[0]) → −inf at and past each
  // token's limit (unless the whole page is visible), stored; then the group maxima.
  const auto store = [&](int key0, const float (&x)[OUT]) {
    const bool masked = key0 + kBlock > fast_end;
    const int j = key0 + row;
#pragma unroll
    for (int m = 0; m < KT; ++m) {
      float val[2];
#pragma unroll
      for (int h = 0; h < OUT / KT; ++h) {
        val[h] = !masked || j + 8 * h < lim[m] ? x[2 * m + h] : -INFINITY;  // also NaN slots
        if (!masked || (lim[m] >= 0 && j + 8 * h < s_out)) orow[m][key0 + 8 * h] = val[h];
      }
      float gm;
      if constexpr (BT == 2) {
        gm = val[0];
      } else {  // across lane bit 2 keep the group of this lane's bit 2, send the other
        gm = fmaxf(bit2 ? val[1] : val[0], __shfl_xor_sync(~0u, bit2 ? val[0] : val[1], 4));
      }
      if constexpr (BT == 2) gm = fmaxf(gm, __shfl_xor_sync(~0u, gm, 4));
      gm = fmaxf(gm, __shfl_xor_sync(~0u, gm, 8));
      gm = fmaxf(gm, __shfl_xor_sync(~0u, gm, 16));
      const int g = key0 / kGroup;
      if (group_lane && (!masked || (lim[m] >= 0 && g + group < num_groups))) grow[m][g] = gm;
    }
  };

  // 3. The live pages. With DEPTH = 2 a consumer issues page b + 1's MMA before it reduces page
  //    b, so its own head sums run while the tensor cores work (two accumulator sets).
  const uint32_t dq = desc_lo(sh.q[c]), dk0 = desc_lo(sh.keys[0]);
  const auto issue = [&](float (&acc)[NQ / 2], int b) {  // S = K·Qᵀ of page b, asynchronously
    const int s = b % kStages;
    mbar_wait(&sh.full[s], (b / kStages) & 1);
    const uint32_t dk = dk0 + s * (kValueBytes >> 4);
    pin(acc);
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
    for (int k = 0; k < kDim / 32; ++k) {
      wgmma<NQ>(acc, kmajor_desc(dk + 2 * k), kmajor_desc(dq + 2 * k), k);
    }
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
  };
  const auto reduce = [&](float (&acc)[NQ / 2], int b) {  // page b's MMA is done: logits, stored
    pin(acc);
    const int s = b % kStages;
    float k_scale[OUT / KT];  // of the rows this thread's sums belong to
#pragma unroll
    for (int h = 0; h < OUT / KT; ++h) k_scale[h] = sh.scales[s][row + 8 * h];
    __syncwarp();
    if (lane == 0) mbar_arrive(&sh.empty[s]);  // the page is read: free its slot
    // ReLU · w (LIN: |x| · w / 2) summed over each token's heads, for both key rows this
    // thread holds: one FFMA chain each (enough independent work at either head count).
    const auto act = [](float x) { return LIN ? fabsf(x) : fmaxf(x, 0.f); };
    float v[2 * BT];  // [token][row half]
#pragma unroll
    for (int t = 0; t < BT; ++t) {
      float a = 0.f, b2 = 0.f;
#pragma unroll
      for (int i = t * SPAN; i < (t + 1) * SPAN; ++i) {
        a = fmaf(act(acc[4 * i]), wr[2 * i], a);
        a = fmaf(act(acc[4 * i + 1]), wr[2 * i + 1], a);
        b2 = fmaf(act(acc[4 * i + 2]), wr[2 * i], b2);
        b2 = fmaf(act(acc[4 * i + 3]), wr[2 * i + 1], b2);
      }
      v[2 * t] = a;
      v[2 * t + 1] = b2;
    }
    // Reduce-scatter over the quad (lanes 4r … 4r + 3 hold the same two key rows).
    float x[OUT];
    if constexpr (BT == 2) {  // across lane bit 1 keep token hi1, across bit 0 row half hi0
      float u[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        u[h] = (hi1 ? v[2 + h] : v[h]) + __shfl_xor_sync(~0u, hi1 ? v[h] : v[2 + h], 2);
      }
      x[0] = (hi0 ? u[1] : u[0]) + __shfl_xor_sync(~0u, hi0 ? u[0] : u[1], 1);
      if constexpr (LIN) {  // + the linear half: this lane's token's rows, its row half
        x[0] = fmaf(hi0 ? acc[N / 2 + 2] : acc[N / 2], lin_hi[0],
                    fmaf(hi0 ? acc[N / 2 + 3] : acc[N / 2 + 1], lin_lo[0], x[0]));
      }
      x[0] *= k_scale[0];
    } else {  // across lane bit 1 keep the tokens whose bit 1 is hi1, across bit 0 bit 0 = hi0
      float u[BT];  // [token 4m + e + 2·hi1 (index 2m + e)][half]
#pragma unroll
      for (int k = 0; k < BT / 2; ++k) {
        const int t0 = 4 * (k / 2) + k % 2;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float lo = v[2 * t0 + h], hi = v[2 * (t0 + 2) + h];
          u[2 * k + h] = (hi1 ? hi : lo) + __shfl_xor_sync(~0u, hi1 ? lo : hi, 2);
        }
      }
#pragma unroll
      for (int m = 0; m < KT; ++m) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float e0 = u[2 * (2 * m) + h], e1 = u[2 * (2 * m + 1) + h];
          float sum = (hi0 ? e1 : e0) + __shfl_xor_sync(~0u, hi0 ? e0 : e1, 1);
          if constexpr (LIN) {  // + the linear half: columns 2(l % 4), +1 of row half h
            sum = fmaf(acc[N / 2 + 2 * h + 1], lin_lo[m], sum);
            sum = fmaf(acc[N / 2 + 2 * h], lin_hi[m], sum);
          }
          x[2 * m + h] = sum * k_scale[h];
        }
      }
    }
    store((first + b) * kBlock, x);
  };
  if constexpr (DEPTH == 1) {
    float d[NQ / 2];
    for (int b = 0; b < num_live; ++b) {
      issue(d, b);
      wgmma_wait<0>();
      reduce(d, b);
    }
  } else {
    float d0[NQ / 2], d1[NQ / 2];  // page b's accumulators: d0 for even b, d1 for odd b
    if (num_live > 0) {  // every path below waits for all it issues (ptxas checks)
      issue(d0, 0);
      int b = 0;
      for (; b + 2 < num_live; b += 2) {
        issue(d1, b + 1);
        wgmma_wait<1>();  // page b's group, the older one, is done
        reduce(d0, b);
        issue(d0, b + 2);
        wgmma_wait<1>();
        reduce(d1, b + 1);
      }
      if (b + 1 < num_live) {
        issue(d1, b + 1);
        wgmma_wait<1>();
        reduce(d0, b);
        wgmma_wait<0>();
        reduce(d1, b + 1);
      } else {
        wgmma_wait<0>();
        reduce(d0, b);
      }
    }
  }
  // 4. Pages of the chunk no token of the tile sees.
  float none[OUT];
#pragma unroll
  for (int m = 0; m < OUT; ++m) none[m] = -INFINITY;
  for (int b = num_live; b < chunk_pages; ++b) store((first + b) * kBlock, none);
}
#endif  // DSASERVE_SM90A

template <int H, int CONSUMERS, int DEPTH, int N, bool LIN>
__global__ void __launch_bounds__(threads<CONSUMERS>(), 1)
    indexer_logits_kernel(const __nv_bfloat16* __restrict__ q,  // [T·H, D]
                          const float* __restrict__ w,          // [T·H]
                          const uint8_t* __restrict__ cache,    // pages of kPageBytes
                          const int* __restrict__ block_table,  // [R, max_blocks]
                          int64_t stride_bt,
                          const int* __restrict__ tiles,  // [3, num_tiles]: req, token, length
                          const int* __restrict__ limits,  // [T]
                          float* __restrict__ out, int64_t stride_out,   // [T, s_out]
                          float* __restrict__ gmax, int64_t stride_gmax,  // [T, s_out / 8]
                          int s_out, int pages_per_prog) {
#ifdef DSASERVE_SM90A
  // 1024-byte aligned, as the 128-byte swizzle needs: declared so, which the block checks once,
  // rather than aligned at run time (ptxas recomputed that address at every page).
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  if (smem_addr(smem_raw) % 1024 != 0) __trap();
  constexpr int NQ = N + (LIN ? 8 : 0);
  auto& sh = *reinterpret_cast<Shared<CONSUMERS, NQ>*>(smem_raw);
  const int num_tiles = int(gridDim.x);
  const int req = tiles[blockIdx.x], tok0 = tiles[num_tiles + blockIdx.x];
  const int ntok = tiles[2 * num_tiles + blockIdx.x];
  const int first = int(blockIdx.y) * pages_per_prog;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // The chunk's pages, and how many of them some token of the tile sees (every warp finds it).
  const int max_limit = __reduce_max_sync(~0u, lane < ntok ? limits[tok0 + lane] : 0);
  const int chunk_pages = min(pages_per_prog, (s_out + kBlock - 1) / kBlock - first);
  const int num_live = max(0, min(chunk_pages, (max_limit + kBlock - 1) / kBlock - first));
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&sh.full[s], 32);               // every producer lane
      mbar_init(&sh.empty[s], 4 * CONSUMERS);  // every consumer warp
    }
  }
  __syncthreads();
  if (warp >= 4 * CONSUMERS) {  // the producer warpgroup: one warp copies, three leave
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kProducerRegs));
    if (warp == 4 * CONSUMERS) {
      produce(sh, cache, block_table + req * stride_bt + first, num_live, lane);
    }
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(consumer_regs<CONSUMERS>()));
    // The consumer index through a shuffle: ptxas then keeps it, and the wgmma descriptors made
    // from it, in uniform registers (no per-page moves into them).
    consume<H, CONSUMERS, DEPTH, N, LIN>(sh, __shfl_sync(~0u, warp / 4, 0), q, w, limits, out,
                                         stride_out, gmax, stride_gmax, tok0, ntok, first,
                                         num_live, chunk_pages, s_out);
  }
#else
  __trap();
#endif
}

template <int H, int CONSUMERS, int DEPTH, int N, bool LIN>
void launch(const at::Tensor& q, const at::Tensor& w, const at::Tensor& cache,
            const at::Tensor& block_table, const at::Tensor& tiles, const at::Tensor& limits,
            at::Tensor& out, at::Tensor& gmax, int64_t pages_per_prog, cudaStream_t stream) {
  auto kernel = indexer_logits_kernel<H, CONSUMERS, DEPTH, N, LIN>;
  constexpr size_t smem = smem_bytes<CONSUMERS, N + (LIN ? 8 : 0)>();
  // Per device, so set at every launch (about a microsecond, legal during graph capture).
  C10_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  const int64_t s_out = out.size(1);
  const dim3 grid(unsigned(tiles.size(1)),
                  unsigned((s_out + kBlock * pages_per_prog - 1) / (kBlock * pages_per_prog)));
  kernel<<<grid, threads<CONSUMERS>(), smem, stream>>>(
      reinterpret_cast<const __nv_bfloat16*>(q.data_ptr()), w.data_ptr<float>(),
      cache.data_ptr<uint8_t>(), block_table.data_ptr<int>(), block_table.stride(0),
      tiles.data_ptr<int>(), limits.data_ptr<int>(), out.data_ptr<float>(), out.stride(0),
      gmax.data_ptr<float>(), gmax.stride(0), int(s_out), int(pages_per_prog));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The op: fills logits out [T, S] and the group maxima gmax [T, ceil(S / 8)]. Shapes are checked
// by the Python wrapper (dsaserve/kernels/cuda/indexer_logits.py); these checks guard the ABI.
void indexer_logits(const at::Tensor& q, const at::Tensor& w, const at::Tensor& cache,
                    const at::Tensor& block_table, const at::Tensor& tiles,
                    const at::Tensor& limits, at::Tensor& out, at::Tensor& gmax,
                    int64_t consumers, int64_t depth, int64_t rows, bool linear,
                    int64_t pages_per_prog) {
  TORCH_CHECK(q.is_cuda() && q.scalar_type() == at::kBFloat16 && q.dim() == 3 &&
                  q.size(2) == kDim && q.is_contiguous(),
              "indexer_logits: q must be a contiguous CUDA bf16 [T, H, 128] tensor");
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() &&
                  w.numel() == q.size(0) * q.size(1),
              "indexer_logits: w must be contiguous fp32 [T, H]");
  TORCH_CHECK(cache.scalar_type() == at::kByte && cache.is_contiguous(),
              "indexer_logits: the cache must be contiguous uint8 pages");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.stride(1) == 1 &&
                  tiles.scalar_type() == at::kInt && tiles.is_contiguous() &&
                  tiles.size(0) == 3 && limits.scalar_type() == at::kInt &&
                  limits.is_contiguous(),
              "indexer_logits: block_table, tiles [3, n] and limits must be int32");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.stride(1) == 1 &&
                  gmax.scalar_type() == at::kFloat && gmax.stride(1) == 1 &&
                  gmax.size(1) == (out.size(1) + kGroup - 1) / kGroup,
              "indexer_logits: out [T, S] and gmax [T, ceil(S / 8)] must be fp32 rows");
  TORCH_CHECK(pages_per_prog >= 1, "indexer_logits: pages_per_prog must be >= 1");
  if (tiles.size(1) == 0 || out.size(1) == 0) return;
  const c10::cuda::CUDAGuard guard(q.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
#define DSASERVE_LAUNCH(H, C, D, N, L)                                                        \
  if (heads == H && consumers == C && depth == D && rows == N && linear == L)                 \
  return launch<H, C, D, N, L>(q, w, cache, block_table, tiles, limits, out, gmax,            \
                               pages_per_prog, stream)
#define DSASERVE_SHAPES(H)              \
  DSASERVE_LAUNCH(H, 2, 1, 128, false); \
  DSASERVE_LAUNCH(H, 2, 1, 128, true);  \
  DSASERVE_LAUNCH(H, 2, 2, 128, false); \
  DSASERVE_LAUNCH(H, 2, 2, 128, true);  \
  DSASERVE_LAUNCH(H, 3, 1, 128, false); \
  DSASERVE_LAUNCH(H, 3, 1, 128, true);  \
  DSASERVE_LAUNCH(H, 2, 1, 256, false);
  const int64_t heads = q.size(1);
  DSASERVE_SHAPES(64)
  DSASERVE_SHAPES(32)
#undef DSASERVE_SHAPES
#undef DSASERVE_LAUNCH
  TORCH_CHECK(false, "indexer_logits: heads must be 32 or 64, and (consumers, depth, rows, "
              "linear) one of indexer_logits.SHAPES; got ", heads, " and (", consumers, ", ",
              depth, ", ", rows, ", ", linear, ")");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dsaserve_cuda, m) {
  m.def("indexer_logits(Tensor q, Tensor w, Tensor cache, Tensor block_table, Tensor tiles, "
        "Tensor limits, Tensor(a!) out, Tensor(b!) gmax, int consumers, int depth, int rows, "
        "bool linear, int pages_per_prog) -> ()");
}

TORCH_LIBRARY_IMPL(dsaserve_cuda, CUDA, m) { m.impl("indexer_logits", &indexer_logits); }
