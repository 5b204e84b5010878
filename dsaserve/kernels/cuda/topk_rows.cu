// Exact top-k of long score rows, one thread block per row (sm_80 and later; a cluster of them
// per row on sm_90 where rows are few).
//
// The indexer's logits rows are as long as the context (64K-128K keys and more) and k is 2,048.
// dsaserve/kernels/triton/row_topk.py does this in three launches of one program per row; each
// is latency-bound (a bit-by-bit search is a chain of block-wide reductions), so a decode step
// of 64 rows pays ~50 us for them. Here one block does all of it with shared-memory histograms,
// which Triton does not offer (its histogram is built from ballots):
//
//   1. tau <= the k-th largest of the row's group maxima (the logits kernel writes the maximum
//      of every GROUP keys): at least k groups have a maximum >= tau and each holds a key >= tau,
//      so the top k keys all score >= tau. Found by a bucket select (below), one or two
//      passes.
//   2. One pass over the row: keys >= tau go to a list of C entries in shared memory. Mostly
//      that is k plus a few (a group whose maximum clears tau rarely has a second key that does).
//      Where the row's group maxima fit in shared memory (rows up to 128K keys), the pass reads
//      only the groups whose maximum clears tau, about k of them: 1/8 of a 128K-key row.
//   3. The exact k best of the list by a bucket select over 64-bit entries (score key << 32 |
//      inverted key index: distinct, ties go to the smaller key index), then written out.
//
// Few rows (decode: 64 on 132 multiprocessors) would leave most of the GPU idle: there a row
// takes a cluster of 2-8 blocks (sm_90), each finding tau itself and compacting its share of
// the row into the first block's list through distributed shared memory. On Hopper, a
// 1024-thread block that reads its whole share (rows too long for the group list) first copies
// it (up to 39K keys) into shared memory with bulk copies while it searches tau, so step 2 reads
// shared memory, not L2 or DRAM.
//
// Rows whose list would overflow (more than C keys >= tau: clustered or equal scores) and rows
// too short to have k groups take the exact path instead: the row's own k-th score by a bucket
// select over the row, the keys above it, then the ties in key order.
//
// Bucket select: the keys in play lie in [lo, hi]; a pass counts them in NB equal-width bins of
// that range (shared-memory atomics), finds the bin holding the wanted rank counting from the top
// and narrows [lo, hi] to it. The bins follow the keys' actual range (the first range is their
// min and max), so even keys that share their exponent spread over the bins, and the range
// shrinks at least 1024-fold per pass: 32-bit keys are exact after four passes at most.

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "mbarrier.cuh"

#include <cooperative_groups.h>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace {

// benchmarks/topk_phases.py builds with DSASERVE_TOPK_PHASES: the first and last block print
// the time each phase took (ns, %globaltimer), to see where a row's latency goes.
#ifdef DSASERVE_TOPK_PHASES
#define PHASE(i)                                                                  \
  if (threadIdx.x == 0) {                                                         \
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(phase_ns[i]));              \
  }
#else
#define PHASE(i)
#endif

constexpr int kBins = 2048;      // NB: bins per bucket-select pass
constexpr int kList = 4096;      // C: list entries per row (the top-k kernel's k <= C)
constexpr int kGroupKeys = 16384;  // group maxima cached in shared memory (longer rows re-read)
// Keys a thread takes per step of the compaction: 16, or 8 where 1024 threads leave each only
// 64 registers (16 spilled there).
template <int THREADS>
constexpr int kBatch = THREADS >= 1024 ? 8 : 16;
// Blocks that stage their share of the row in shared memory (with the launch's room for it):
// 1024-thread ones, alone on their multiprocessor.
template <int THREADS>
constexpr bool kCanStage = THREADS >= 1024;
// tau may sit below the k-th group maximum by this many maxima: each adds a list entry or
// two, and stopping the search early saves passes (the list has room: k + 2 * 512 < C).
constexpr int kTauSlack = 512;

// fp32 -> uint32 with the same order (-0.0 just below +0.0).
__device__ __forceinline__ uint32_t sortable(float x) {
  const uint32_t b = __float_as_uint(x);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ float unsortable(uint32_t key) {
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// A slot from a shared-memory counter, one atomic per warp (the threads that call it together).
__device__ __forceinline__ int claim(int* counter) {
  const cooperative_groups::coalesced_group g = cooperative_groups::coalesced_threads();
  int base = 0;
  if (g.thread_rank() == 0) base = atomicAdd(counter, int(g.size()));
  return g.shfl(base, 0) + int(g.thread_rank());
}

// One list entry: larger = better score, then smaller key index.
__device__ __forceinline__ uint64_t entry(uint32_t key, uint32_t j) {
  return (uint64_t(key) << 32) | uint64_t(0xffffffffu - j);
}

template <typename Key>
struct Range {
  Key lo, hi;
};

template <typename Key>
__device__ __forceinline__ Range<Key> widen(Range<Key> a, Range<Key> b) {
  return {a.lo < b.lo ? a.lo : b.lo, a.hi > b.hi ? a.hi : b.hi};
}

template <int THREADS>
struct Shared {
  using Scan = cub::BlockScan<int, THREADS>;
  using Reduce32 = cub::BlockReduce<Range<uint32_t>, THREADS>;
  using Reduce64 = cub::BlockReduce<Range<uint64_t>, THREADS>;
  union {
    typename Scan::TempStorage scan;
    typename Reduce32::TempStorage reduce32;
    typename Reduce64::TempStorage reduce64;
  } tmp;
  int hist[kBins];
  int count;      // list entries claimed
  int written;    // output slots claimed
  int groups;     // groups listed for compact_groups (in hist, as uint16)
  int bin;        // the bin a select pass chose
  int above;      // keys in higher bins than `bin`
  int few;        // keys collected in `last` by a select's last step
  uint64_t lo, hi;  // broadcast of a min / max reduction
  uint64_t last[32];  // the keys of a select's last bin, ranked directly
  uint64_t staged;  // mbarrier: the bulk copies of the row into the stage have landed
};

// Dynamic shared memory: Shared, then the list (C uint64) or, before it is needed, the group
// maxima's keys (kGroupKeys uint32): the two are never live together; then, where the launch
// gives it room, the stage: a copy of the block's share of the row (stage_row).
template <int THREADS>
__host__ __device__ constexpr size_t smem_bytes() {
  constexpr size_t head = (sizeof(Shared<THREADS>) + 15) / 16 * 16;
  constexpr size_t list = kList * sizeof(uint64_t);
  constexpr size_t gmax = kGroupKeys * sizeof(uint32_t);
  return head + (list > gmax ? list : gmax);
}

struct SelectResult {
  uint64_t threshold;  // keys >= threshold: the selection (see `ties`)
  int ties;            // 0: count(key >= threshold) == rank exactly; else count(key > threshold)
                       // == rank - ties and `ties` more must come from the keys == threshold
};

// The rank-th largest of the keys that `visit` hands out (rank >= 1, at most their number).
// visit(f) calls f(key) for this thread's keys; every thread of the block calls this together.
// slack == 0: exact. slack > 0: stops as soon as threshold <= the rank-th largest and at most
// `slack` more keys than `rank` are >= threshold (`ties` then 0); fewer passes.
// The bins are 2^shift wide, so that a key's bin is a shift, not a division: the range shrinks
// at least 1024-fold per pass.
template <int THREADS, typename Key, typename Visit>
__device__ SelectResult bucket_select(Shared<THREADS>& s, Visit visit, int rank, int slack) {
  using Reduce = std::conditional_t<sizeof(Key) == 8, typename Shared<THREADS>::Reduce64,
                                    typename Shared<THREADS>::Reduce32>;
  constexpr int kPer = kBins / THREADS;  // bins a thread scans, highest first
  constexpr int kBits = 8 * sizeof(Key);
  static_assert(kBins % THREADS == 0, "bins must split evenly over the threads");
  static_assert(kBins == 2048, "the bin of a key is its top 11 bits above lo");
  Range<Key> range{~Key(0), 0};
  visit([&](Key key) { range = widen(range, Range<Key>{key, key}); });
  auto& red = *reinterpret_cast<typename Reduce::TempStorage*>(&s.tmp);
  range = Reduce(red).Reduce(range, widen<Key>);
  if (threadIdx.x == 0) {
    s.lo = range.lo;
    s.hi = range.hi;
    s.few = 0;
  }
  __syncthreads();
  Key lo = Key(s.lo), hi = Key(s.hi);
  int in_bin = -1;  // keys in [lo, hi] once a pass has run
  while (lo != hi && (in_bin < 0 || in_bin - rank > slack)) {
    const Key span = hi - lo;
    const int used = kBits - (sizeof(Key) == 8 ? __clzll(span) : __clz(span));
    const int shift = used > 11 ? used - 11 : 0;  // (span >> shift) < kBins
    for (int i = threadIdx.x; i < kBins; i += THREADS) s.hist[i] = 0;
    __syncthreads();
    visit([&](Key key) {
      if (key >= lo && key <= hi) atomicAdd(&s.hist[int((key - lo) >> shift)], 1);
    });
    __syncthreads();
    int counts[kPer];
    int mine = 0;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      counts[i] = s.hist[kBins - 1 - (threadIdx.x * kPer + i)];
      mine += counts[i];
    }
    int before;
    typename Shared<THREADS>::Scan(s.tmp.scan).ExclusiveSum(mine, before);
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      if (before < rank && before + counts[i] >= rank) {
        s.bin = kBins - 1 - (threadIdx.x * kPer + i);
        s.above = before;
      }
      before += counts[i];
    }
    __syncthreads();
    const int bin = s.bin;
    rank -= s.above;
    in_bin = s.hist[bin];
    lo += Key(bin) << shift;
    const Key top = lo + ((Key(1) << shift) - 1);
    hi = hi < top ? hi : top;
    __syncthreads();  // s.bin, s.above and s.hist are rewritten by the next pass
    if (slack == 0 && in_bin > rank && in_bin <= 32) {
      // At most 32 keys left in play: one warp ranks them against each other instead of
      // another pass or two (the exact selection from a ~2,500-entry list took 3-4 passes).
      visit([&](Key key) {
        if (key >= lo && key <= hi) s.last[atomicAdd(&s.few, 1)] = key;
      });
      __syncthreads();
      if (threadIdx.x < 32) {
        const int n = s.few;
        const Key mine = threadIdx.x < n ? Key(s.last[threadIdx.x]) : Key(0);
        int greater = 0, equal = 0;
        for (int j = 0; j < n; ++j) {
          const Key other = Key(s.last[j]);
          greater += other > mine;
          equal += other == mine;
        }
        // The rank-th largest: `greater` above it, and it or its equals reach the rank.
        if (int(threadIdx.x) < n && greater < rank && rank <= greater + equal) {
          s.lo = mine;  // equal keys write the same
          s.bin = greater + equal == rank ? 0 : rank - greater;
        }
      }
      __syncthreads();
      return {s.lo, s.bin};
    }
  }
  // Done: one key value left (its copies beyond `rank` are ties), or the bin holds the keys
  // wanted (exactly, or within the slack).
  return {uint64_t(lo), (in_bin == rank || slack > 0) ? 0 : rank};
}

// This thread's first list slot of the `mine` its warp claims for it from *count: one prefix
// sum over the warp and one atomic (all lanes call this together).
__device__ __forceinline__ int claim_slots(int* count, int mine) {
  constexpr unsigned kAll = 0xffffffffu;
  const int lane = threadIdx.x & 31;
  int upto = mine;  // inclusive prefix sum over the warp's lanes
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int n = __shfl_up_sync(kAll, upto, o);
    if (lane >= o) upto += n;
  }
  int slot = 0;
  if (lane == 31) slot = atomicAdd(count, upto);
  return __shfl_sync(kAll, slot, 31) + upto - mine;
}

// Appends the keys j of row[begin:end) that satisfy pred(key) to the list, in no particular
// order, and adds their number to *count (entries past kList are not stored); the caller
// synchronizes before reading either. The list and the count may live in another block of the
// cluster (distributed shared memory). The first n_staged keys of the range (a multiple of 4,
// begin too) are read from `stage`, a copy in this block's shared memory (stage_row), the rest
// from the row (16-byte loads where the row allows, else coalesced scalar ones). A thread counts
// its keepers among a batch of keys (32 staged ones, or kBatch from memory), then its warp claims
// their list slots with one prefix sum and one atomic (a claim per kept key: 26.0 against
// 20.2 us for the whole decode top-k, with the other changes of that version).
template <int THREADS, typename Pred>
__device__ void compact(int* count, uint64_t* list, const float* row, int begin, int end,
                        bool vec4, const float* stage, int n_staged, Pred pred) {
  constexpr unsigned kAll = 0xffffffffu;
  constexpr int kB = kBatch<THREADS>;
  constexpr int kS = 32;  // staged keys per thread per step: one bit each in `keep`

  // Staged keys, read twice from shared memory: counted, then the keepers appended.
  const float4* stage4 = reinterpret_cast<const float4*>(stage);
  for (int base = 0; base < n_staged; base += kS * THREADS) {  // the same steps in every thread
    // Staged key e of this thread's step (float4 number e / 4 of the step, lane e % 4).
    auto at = [&](int e) { return base + 4 * ((e / 4) * THREADS + int(threadIdx.x)) + e % 4; };
    unsigned keep = 0;
#pragma unroll
    for (int u = 0; u < kS / 4; ++u) {
      if (at(4 * u) < n_staged) {
        const float4 v = stage4[at(4 * u) / 4];
        keep |= (unsigned(pred(sortable(v.x))) | unsigned(pred(sortable(v.y))) << 1 |
                 unsigned(pred(sortable(v.z))) << 2 | unsigned(pred(sortable(v.w))) << 3)
                << (4 * u);
      }
    }
    const int mine = __popc(keep);
    if (__any_sync(kAll, mine != 0)) {
      int slot = claim_slots(count, mine);
      for (; keep != 0; keep &= keep - 1, ++slot) {
        const int j = at(__ffs(keep) - 1);
        if (slot < kList) list[slot] = entry(sortable(stage[j]), uint32_t(begin + j));
      }
    }
  }

  const int n4 = end / 4;
  const float4* row4 = reinterpret_cast<const float4*>(row);
  // Key e of this thread's batch at `base`.
  auto index = [&](int base, int e) {
    return vec4 ? base + 4 * ((e / 4) * THREADS + int(threadIdx.x)) + e % 4
                : base + e * THREADS + int(threadIdx.x);
  };
  for (int base = begin + n_staged; base < end; base += kB * THREADS) {
    float x[kB];
    if (vec4) {
#pragma unroll
      for (int u = 0; u < kB / 4; ++u) {
        const int i = base / 4 + u * THREADS + threadIdx.x;
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        if (i < n4) {
          v = __ldcg(row4 + i);
        } else if (4 * i < end) {  // the range's last, partial group of four
          v.x = __ldcg(row + 4 * i);
          v.y = 4 * i + 1 < end ? __ldcg(row + 4 * i + 1) : 0.f;
          v.z = 4 * i + 2 < end ? __ldcg(row + 4 * i + 2) : 0.f;
        }
        x[4 * u] = v.x;
        x[4 * u + 1] = v.y;
        x[4 * u + 2] = v.z;
        x[4 * u + 3] = v.w;
      }
    } else {
#pragma unroll
      for (int e = 0; e < kB; ++e) {
        const int j = index(base, e);
        x[e] = j < end ? __ldcg(row + j) : 0.f;
      }
    }
    unsigned keep = 0;  // bit e: key e of the batch is kept
#pragma unroll
    for (int e = 0; e < kB; ++e) {
      keep |= unsigned(index(base, e) < end && pred(sortable(x[e]))) << e;
    }
    const int mine = __popc(keep);
    if (__any_sync(kAll, mine != 0)) {
      int slot = claim_slots(count, mine);
#pragma unroll
      for (int e = 0; e < kB; ++e) {
        if (keep >> e & 1) {
          if (slot < kList) list[slot] = entry(sortable(x[e]), uint32_t(index(base, e)));
          ++slot;
        }
      }
    }
  }
}

// compact() over the groups of kGroup keys listed in `groups` (n of them: those whose maximum
// passes pred, the others hold no key that does). With tau at the k-th group maximum that is
// about k groups, so a 128K-key row costs ~64 KB of keys instead of 512 KB. Every load of a
// step is independent (the group ids come from shared memory): two 16-byte loads per group,
// or scalar ones where vec4 is false or the row ends at `limit`.
constexpr int kGroup = 8;
template <int THREADS, typename Pred>
__device__ void compact_groups(int* count, uint64_t* list, const float* row,
                               const uint16_t* groups, int n, int limit, bool vec4, Pred pred) {
  constexpr int kGroupsPer = THREADS >= 1024 ? 1 : 2;  // per thread per step (64 registers)
  for (int i0 = 0; i0 < n; i0 += kGroupsPer * THREADS) {  // the same steps in every thread
    int j0[kGroupsPer];
    float x[kGroupsPer][kGroup];
#pragma unroll
    for (int u = 0; u < kGroupsPer; ++u) {
      const int i = i0 + u * THREADS + int(threadIdx.x);
      j0[u] = i < n ? int(groups[i]) * kGroup : limit;  // past the row: nothing kept
      if (vec4 && j0[u] + kGroup <= limit) {
        const float4 a = __ldcg(reinterpret_cast<const float4*>(row + j0[u]));
        const float4 b = __ldcg(reinterpret_cast<const float4*>(row + j0[u] + 4));
        x[u][0] = a.x, x[u][1] = a.y, x[u][2] = a.z, x[u][3] = a.w;
        x[u][4] = b.x, x[u][5] = b.y, x[u][6] = b.z, x[u][7] = b.w;
      } else {
#pragma unroll
        for (int e = 0; e < kGroup; ++e) {
          x[u][e] = j0[u] + e < limit ? __ldcg(row + j0[u] + e) : 0.f;
        }
      }
    }
    unsigned keep = 0;  // bit u * kGroup + e: key e of group u is kept
#pragma unroll
    for (int u = 0; u < kGroupsPer; ++u) {
#pragma unroll
      for (int e = 0; e < kGroup; ++e) {
        keep |= unsigned(j0[u] + e < limit && pred(sortable(x[u][e]))) << (u * kGroup + e);
      }
    }
    const int mine = __popc(keep);
    if (__any_sync(0xffffffffu, mine != 0)) {
      int slot = claim_slots(count, mine);
#pragma unroll
      for (int u = 0; u < kGroupsPer; ++u) {
#pragma unroll
        for (int e = 0; e < kGroup; ++e) {
          if (keep >> (u * kGroup + e) & 1) {
            if (slot < kList) list[slot] = entry(sortable(x[u][e]), uint32_t(j0[u] + e));
            ++slot;
          }
        }
      }
    }
  }
}

// Bulk copies (the TMA unit) of src[0:n] (n a multiple of 4, src 16-byte aligned) into `stage`,
// in this block's shared memory, completing on the mbarrier `bar`, which this call initializes
// for its own arrival. One thread calls it; every thread then waits (mbar_wait(bar, 0)) before
// reading.
__device__ __forceinline__ void stage_row(float* stage, const float* src, int n, uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr uint32_t kPiece = 32768;  // bytes per copy instruction
  mbar_init(bar, 1);
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");  // seen by the copies
  const uint32_t b = smem_addr(bar);
  const uint32_t dst = smem_addr(stage);
  const uint32_t bytes = uint32_t(n) * 4;
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(b), "r"(bytes)
               : "memory");
  for (uint32_t off = 0; off < bytes; off += kPiece) {
    const uint32_t size = bytes - off < kPiece ? bytes - off : kPiece;
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
        ::"r"(dst + off), "l"(reinterpret_cast<const char*>(src) + off), "r"(size), "r"(b)
        : "memory");
  }
#endif
}

// Calls f(key) for each of this thread's keys of row[0:limit].
template <int THREADS>
struct RowKeys {
  const float* row;
  int limit;
  template <typename F>
  __device__ void operator()(F f) const {
    for (int j = threadIdx.x; j < limit; j += THREADS) f(sortable(__ldcg(row + j)));
  }
};

// A row's blocks: CL of them form a thread-block cluster (sm_90) where rows are too few to fill
// the GPU with one block each (decode: 64 rows on 132 multiprocessors). Each finds tau itself
// (the group maxima are 1/8 of the row: cheaper to read twice than to share), compacts its
// share of the row into the list of the cluster's first block through distributed shared
// memory, and leaves the rest to that block. CL == 1 needs no cluster (sm_80 too).
struct Cluster {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  __device__ static int rank() { return int(cooperative_groups::this_cluster().block_rank()); }
  __device__ static void sync() { cooperative_groups::this_cluster().sync(); }
  template <typename T>
  __device__ static T* first(T* p) {  // the same shared-memory object in the first block
    return cooperative_groups::this_cluster().map_shared_rank(p, 0);
  }
#else  // never launched with CL > 1 below sm_90 (topk.py picks 1 there)
  __device__ static int rank() { return 0; }
  __device__ static void sync() { __trap(); }
  template <typename T>
  __device__ static T* first(T* p) { return p; }
#endif
};

template <int THREADS, int CL, typename Index>
__global__ void __launch_bounds__(THREADS)
topk_rows_kernel(const float* __restrict__ logits, const float* __restrict__ group_max,
                 const int64_t* __restrict__ limits64, const int32_t* __restrict__ limits32,
                 float* __restrict__ values, Index* __restrict__ indices, int64_t stride_l,
                 int64_t stride_g, int64_t stride_o, int k, int group, bool group_list,
                 int stage_keys) {
  extern __shared__ __align__(16) unsigned char smem[];
#ifdef DSASERVE_TOPK_PHASES
  uint64_t phase_ns[7] = {};
#endif
  PHASE(0);
  auto& s = *reinterpret_cast<Shared<THREADS>*>(smem);
  uint64_t* list = reinterpret_cast<uint64_t*>(smem + (sizeof(Shared<THREADS>) + 15) / 16 * 16);
  uint32_t* gkeys = reinterpret_cast<uint32_t*>(list);
  float* stage = reinterpret_cast<float*>(smem + smem_bytes<THREADS>());
  const int64_t r = blockIdx.x / CL;
  const int rank = CL > 1 ? Cluster::rank() : 0;
  const float* row = logits + r * stride_l;
  const int limit = int(limits64 ? limits64[r] : limits32[r]);
  float* out_v = values + r * stride_o;
  Index* out_i = indices + r * stride_o;
  const bool vec4 = (stride_l % 4 == 0) && (reinterpret_cast<uintptr_t>(logits) % 16 == 0);
  // The threshold path (the only one the blocks of a cluster share): every block of the row
  // takes the same branches, so all of them or none reach the cluster barriers.
  const bool by_tau = limit > kList && group_max != nullptr && (limit + group - 1) / group >= k;
  if constexpr (CL > 1) {
    if (rank != 0 && !by_tau) return;
  }

  if (limit <= k) {  // every visible key is chosen, in key order
    for (int j = threadIdx.x; j < k; j += THREADS) {
      out_v[j] = j < limit ? row[j] : -INFINITY;
      out_i[j] = j < limit ? Index(j) : Index(-1);
    }
    return;
  }
  // The threshold path: this block's share of the row, [begin, end) (multiples of 4 but for
  // the row's end), and as much of it as the stage holds (Hopper, 1024 threads), copied there
  // while tau is searched: issued once the group maxima are in, which tau needs first (issued
  // before them, the copy delayed them by 1.5 us). (A function, called where needed: values
  // kept live across the search spilled registers.)
  struct Share {
    int begin, end, staged;
  };
  // Where the group maxima fit in shared memory and a group is kGroup keys, the compaction
  // reads only the groups whose maximum clears tau (about k of them: 1/8 of the row), and a
  // block's share is whole groups; else it reads its whole share, staged where it can be.
  auto by_groups = [&]() {
    return group_list && group == kGroup && (limit + kGroup - 1) / kGroup <= kGroupKeys;
  };
  auto share_of_row = [&]() {
    const int per_block = by_groups() ? (limit + kGroup * CL - 1) / (kGroup * CL) * kGroup
                                      : (limit + 4 * CL - 1) / (4 * CL) * 4;
    const int begin = min(rank * per_block, limit);
    const int end = min(begin + per_block, limit);
    const bool stage = kCanStage<THREADS> && vec4 && !by_groups();
    return Share{begin, end, stage ? min(end - begin, stage_keys) / 4 * 4 : 0};
  };
  if (threadIdx.x == 0) {
    s.count = 0;
    s.written = 0;
    s.groups = 0;
  }
  __syncthreads();
  // This block alone: the list's entries once compaction is done.
  auto compact_here = [&](auto pred) {
    compact<THREADS>(&s.count, list, row, 0, limit, vec4, stage, 0, pred);
    __syncthreads();
    return s.count;
  };

  // (Computed here, not above: earlier, it pushed the 1024-thread build past 64 registers.)
  const int num_groups = (limit + group - 1) / group;
  int count = kList + 1;  // list entries; > kList: take the exact path
  if (limit <= kList) {  // the whole row fits in the list
    count = compact_here([](uint32_t) { return true; });
  } else if (by_tau) {
    const float* gm = group_max + r * stride_g;
    const bool cached = num_groups <= kGroupKeys;
    if (cached && stride_g % 4 == 0 && reinterpret_cast<uintptr_t>(group_max) % 16 == 0) {
      // 16-byte loads, four in flight per thread (two at 1,024 threads: more spill): a 128K-key
      // row's 16,384 maxima in two steps of 512 threads (eight scalar loads per step took four,
      // 5-7 us under prefill's load).
      constexpr int kLoads = THREADS >= 1024 ? 2 : 4;
      const float4* gm4 = reinterpret_cast<const float4*>(gm);
      uint4* gkeys4 = reinterpret_cast<uint4*>(gkeys);
      const int n4 = num_groups / 4;
      for (int i0 = 0; i0 < n4; i0 += kLoads * THREADS) {
        float4 v[kLoads];
#pragma unroll
        for (int u = 0; u < kLoads; ++u) {
          const int i = i0 + u * THREADS + int(threadIdx.x);
          v[u] = i < n4 ? __ldcg(gm4 + i) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int u = 0; u < kLoads; ++u) {
          const int i = i0 + u * THREADS + int(threadIdx.x);
          if (i < n4) {
            gkeys4[i] = make_uint4(sortable(v[u].x), sortable(v[u].y), sortable(v[u].z),
                                   sortable(v[u].w));
          }
        }
      }
      for (int g = 4 * n4 + int(threadIdx.x); g < num_groups; g += THREADS) {
        gkeys[g] = sortable(__ldcg(gm + g));
      }
      __syncthreads();
    } else if (cached) {  // eight loads in flight per thread
      for (int g0 = 0; g0 < num_groups; g0 += 8 * THREADS) {
        float v[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
          const int g = g0 + u * THREADS + threadIdx.x;
          v[u] = g < num_groups ? __ldcg(gm + g) : 0.f;
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) {
          const int g = g0 + u * THREADS + threadIdx.x;
          if (g < num_groups) gkeys[g] = sortable(v[u]);
        }
      }
      __syncthreads();
    }
    if (threadIdx.x == 0 && share_of_row().staged > 0) {  // waited for after the search
      stage_row(stage, row + share_of_row().begin, share_of_row().staged, &s.staged);
    }
    PHASE(1);
    auto visit = [&](auto f) {
      if (cached) {
        for (int g = threadIdx.x; g < num_groups; g += THREADS) f(gkeys[g]);
      } else {
        for (int g = threadIdx.x; g < num_groups; g += THREADS) f(sortable(__ldcg(gm + g)));
      }
    };
    const uint32_t tau =
        uint32_t(bucket_select<THREADS, uint32_t>(s, visit, k, kTauSlack).threshold);
    PHASE(2);
    auto above = [tau](uint32_t key) { return key >= tau; };
    const Share mine = share_of_row();
    if (mine.staged > 0) mbar_wait(&s.staged, 0);
    // The groups of this block's share whose maximum clears tau, listed in the histogram's
    // room (free now) as 16-bit ids; more than that room holds: the whole share instead.
    constexpr int kGroupList = int(sizeof(s.hist) / sizeof(uint16_t));
    uint16_t* glist = reinterpret_cast<uint16_t*>(s.hist);
    if (by_groups()) {
      // A thread tests its groups (at most 32: kGroupKeys / 512), then its warp claims their
      // slots at once (a claim per step of THREADS groups took ~3 us of a prefill row).
      const int g_begin = mine.begin / kGroup, g_end = (mine.end + kGroup - 1) / kGroup;
      static_assert(kGroupKeys / 512 <= 32, "a thread's groups must fit one 32-bit mask");
      unsigned pass = 0;  // bit u: group g_begin + u * THREADS + threadIdx.x passes
      for (int u = 0; g_begin + u * THREADS < g_end; ++u) {
        const int g = g_begin + u * THREADS + int(threadIdx.x);
        pass |= unsigned(g < g_end && above(gkeys[g])) << u;
      }
      int slot = claim_slots(&s.groups, __popc(pass));
      for (; pass != 0; pass &= pass - 1, ++slot) {
        const int g = g_begin + (__ffs(pass) - 1) * THREADS + int(threadIdx.x);
        if (slot < kGroupList) glist[slot] = uint16_t(g);
      }
    }
    // The list overwrites the cached maxima: every thread is done with them (and, in a
    // cluster, the first block's count is 0 and its maxima read) before any append; the blocks
    // of a cluster append to the first block's list through distributed shared memory.
    int* list_count = &s.count;
    uint64_t* row_list = list;
    if constexpr (CL > 1) {
      Cluster::sync();
      list_count = Cluster::first(&s.count);
      row_list = Cluster::first(list);
    } else {
      __syncthreads();
    }
    PHASE(3);
    if (by_groups() && s.groups <= kGroupList) {
      compact_groups<THREADS>(list_count, row_list, row, glist, s.groups, limit, vec4, above);
    } else {
      compact<THREADS>(list_count, row_list, row, mine.begin, mine.end, vec4, stage,
                       mine.staged, above);
    }
    // Every append has landed before the first block reads the list.
    if constexpr (CL > 1) {
      Cluster::sync();
      if (rank != 0) return;
    } else {
      __syncthreads();
    }
    count = s.count;
    PHASE(4);
  }

  int ties = 0;
  uint32_t kth = 0;
  if (count > kList || count < k) {  // exact path: the row's own k-th key (count < k only if
                                     // the group maxima do not match the logits)
    const SelectResult sel =
        bucket_select<THREADS, uint32_t>(s, RowKeys<THREADS>{row, limit}, k, 0);
    kth = uint32_t(sel.threshold);
    ties = sel.ties;
    if (threadIdx.x == 0) s.count = 0;
    __syncthreads();
    count = ties ? compact_here([kth](uint32_t key) { return key > kth; })
                 : compact_here([kth](uint32_t key) { return key >= kth; });
  }
  if (ties) {  // the first `ties` keys equal to kth, in key order, after the `count` above it
    int taken = 0;
    for (int base = 0; base < limit && taken < ties; base += THREADS) {
      const int j = base + threadIdx.x;
      const int tie = (j < limit && sortable(row[j]) == kth) ? 1 : 0;
      int before, total;
      typename Shared<THREADS>::Scan(s.tmp.scan).ExclusiveSum(tie, before, total);
      if (tie && taken + before < ties) list[count + taken + before] = entry(kth, uint32_t(j));
      taken += total;
      __syncthreads();  // the scan's storage is reused
    }
    count = k;
  }

  // The k best of the list's `count` entries (all of them when count == k).
  uint64_t cut = 0;
  if (count > k) {
    auto visit = [&](auto f) {
      for (int i = threadIdx.x; i < count; i += THREADS) f(list[i]);
    };
    cut = bucket_select<THREADS, uint64_t>(s, visit, k, 0).threshold;  // entries are distinct
  }
  PHASE(5);
  for (int i = threadIdx.x; i < count; i += THREADS) {
    const uint64_t e = list[i];
    if (e >= cut) {
      const int p = claim(&s.written);
      out_v[p] = unsortable(uint32_t(e >> 32));
      out_i[p] = Index(0xffffffffu - uint32_t(e));
    }
  }
#ifdef DSASERVE_TOPK_PHASES
  __syncthreads();
  PHASE(6);
  if (threadIdx.x == 0 && (r == 0 || r == gridDim.x / CL - 1)) {
    printf("row %d: list %d | cache maxima %llu, tau %llu, list groups %llu, compact %llu, "
           "select %llu, write %llu ns\n", int(r), count, phase_ns[1] - phase_ns[0],
           phase_ns[2] - phase_ns[1], phase_ns[3] - phase_ns[2], phase_ns[4] - phase_ns[3],
           phase_ns[5] - phase_ns[4], phase_ns[6] - phase_ns[5]);
  }
#endif
}

template <int THREADS, int CL, typename Index>
void launch(const at::Tensor& logits, const c10::optional<at::Tensor>& group_max,
            const at::Tensor& limits, int64_t k, int64_t group, bool group_list, bool stage,
            at::Tensor& values, at::Tensor& indices, cudaStream_t stream) {
  auto kernel = topk_rows_kernel<THREADS, CL, Index>;
  // 1024-thread blocks own their multiprocessor (64 registers each take the whole register
  // file), so on Hopper they also take the shared memory left for a stage of the row (bulk
  // copies, sm_90): up to 39K keys of each block's share.
  int device = 0, major = 0, optin = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  // (Rows that take the group list are not staged: with every row that short, no stage.)
  const bool all_listed = group_list && group == kGroup && logits.size(1) <= kGroupKeys * kGroup;
  int stage_keys = 0;
  if (stage && !all_listed && THREADS == 1024 && major >= 9 &&
      optin > int(smem_bytes<THREADS>())) {
    const int64_t share = (logits.size(1) + 4 * CL - 1) / (4 * CL) * 4;
    stage_keys = int(std::min<int64_t>(share, (optin - int(smem_bytes<THREADS>())) / 16 * 4));
  }
  const size_t smem = smem_bytes<THREADS>() + size_t(stage_keys) * sizeof(float);
  // Per device, so set at every launch (a host call of about a microsecond, legal while a CUDA
  // graph is being captured).
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      int(smem)));
  const bool gm = group_max.has_value();
  const bool l64 = limits.scalar_type() == at::kLong;
  cudaLaunchAttribute cluster;
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = CL;
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(unsigned(logits.size(0) * CL));
  config.blockDim = dim3(THREADS);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = &cluster;
  config.numAttrs = CL > 1 ? 1 : 0;
  C10_CUDA_CHECK(cudaLaunchKernelEx(
      &config, kernel, logits.data_ptr<float>(), gm ? group_max->data_ptr<float>() : nullptr,
      l64 ? limits.data_ptr<int64_t>() : nullptr, l64 ? nullptr : limits.data_ptr<int32_t>(),
      values.data_ptr<float>(), indices.data_ptr<Index>(), logits.stride(0),
      gm ? group_max->stride(0) : int64_t(0), values.stride(0), int(k), int(group), group_list,
      stage_keys));
}

template <typename Index>
void launch_for(int64_t threads, int64_t cluster, bool group_list, bool stage,
                const at::Tensor& logits, const c10::optional<at::Tensor>& group_max,
                const at::Tensor& limits, int64_t k, int64_t group, at::Tensor& values,
                at::Tensor& indices, cudaStream_t stream) {
#define DSASERVE_LAUNCH(T, C) \
  return launch<T, C, Index>(logits, group_max, limits, k, group, group_list, stage, values, \
                             indices, stream)
  if (threads == 512) {
    TORCH_CHECK(cluster == 1, "topk_rows: clusters take 1024 threads per block");
    DSASERVE_LAUNCH(512, 1);
  }
  TORCH_CHECK(threads == 1024, "topk_rows: threads must be 512 or 1024");
  switch (cluster) {
    case 1:
      DSASERVE_LAUNCH(1024, 1);
    case 2:
      DSASERVE_LAUNCH(1024, 2);
    case 4:
      DSASERVE_LAUNCH(1024, 4);
    case 8:
      DSASERVE_LAUNCH(1024, 8);
    default:
      TORCH_CHECK(false, "topk_rows: cluster must be 1, 2, 4 or 8, got ", cluster);
  }
#undef DSASERVE_LAUNCH
}

// The op: fills values [T, k] and indices [T, k] (int32 or int64). Shapes and dtypes are
// checked by the Python wrapper (dsaserve/kernels/cuda/topk.py); these checks guard the ABI.
void topk_rows(const at::Tensor& logits, const c10::optional<at::Tensor>& group_max,
               const at::Tensor& limits, int64_t k, int64_t group, int64_t threads,
               int64_t cluster, bool group_list, bool stage, at::Tensor& values,
               at::Tensor& indices) {
  TORCH_CHECK(logits.is_cuda() && logits.scalar_type() == at::kFloat && logits.dim() == 2 &&
                  logits.stride(1) == 1,
              "topk_rows: logits must be a CUDA fp32 [T, S] tensor with unit column stride");
  TORCH_CHECK(k >= 1 && k <= kList, "topk_rows: k must be in [1, ", kList, "]");
  TORCH_CHECK(logits.size(1) < (int64_t(1) << 31), "topk_rows: rows must be < 2^31 keys");
  TORCH_CHECK(values.stride(0) == indices.stride(0), "topk_rows: outputs must share strides");
  if (logits.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(logits.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (indices.scalar_type() == at::kLong) {
    launch_for<int64_t>(threads, cluster, group_list, stage, logits, group_max, limits, k, group,
                        values, indices, stream);
  } else {
    launch_for<int32_t>(threads, cluster, group_list, stage, logits, group_max, limits, k, group,
                        values, indices, stream);
  }
}

}  // namespace

TORCH_LIBRARY(dsaserve_cuda, m) {
  m.def("topk_rows(Tensor logits, Tensor? group_max, Tensor limits, int k, int group, "
        "int threads, int cluster, bool group_list, bool stage, Tensor(a!) values, "
        "Tensor(b!) indices) -> ()");
}

TORCH_LIBRARY_IMPL(dsaserve_cuda, CUDA, m) { m.impl("topk_rows", &topk_rows); }
