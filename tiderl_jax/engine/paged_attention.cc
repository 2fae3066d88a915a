// Paged attention on the CPU, read straight from the page pool: an XLA FFI custom call.
//
// The `xla` implementation (paged_attention.py) gathers every row's pages into a dense [b, span] copy
// and multiplies it, at XLA:CPU's gather speed and over the whole padded span; this kernel walks each
// row's page table and reads only the pages that hold its keys, one page at a time, with an online
// (running max and sum) softmax, so nothing is copied and padding costs nothing.
//
// Contract (the same as paged_attention_reference): q [b, t, h, d], k_pool / v_pool [pages, kv, ps, d]
// (float32), page_table [b, P] int32, starts [b] int32 -> out [b, t, h, d]. Query t of row b sits at
// position starts[b] + t and attends the keys at positions 0 ..= that position (at most P * ps of them);
// query head j reads kv head j / (h / kv). Built at first use by cpu_attention.py.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// One (row, query token, kv head): the G query heads that share the kv head go through the row's pages
// together, so each page's keys and values are read once for all of them.
struct Problem {
  int64_t B, T, H, D, NP, KV, PS, P, G;
  float scale;
  const float *Q, *K, *V;
  const int32_t *table, *start;
  float* O;

  void Solve(int64_t unit, float* s, float* m, float* l, float* acc) const {
    const int64_t k = unit % KV, bt = unit / KV, b = bt / T, t = bt % T;
    const float neg_inf = -std::numeric_limits<float>::infinity();
    const int64_t n = std::min<int64_t>(static_cast<int64_t>(start[b]) + t + 1, P * PS);  // keys seen
    const float* qk = Q + (bt * H + k * G) * D;  // G query heads, contiguous
    std::fill(m, m + G, neg_inf);
    std::fill(l, l + G, 0.0f);
    std::fill(acc, acc + G * D, 0.0f);
    for (int64_t p = 0; p * PS < n; ++p) {
      int64_t page = table[b * P + p];
      page = std::min<int64_t>(std::max<int64_t>(page, 0), NP - 1);
      const int64_t cnt = std::min<int64_t>(PS, n - p * PS);
      const float* kp = K + (page * KV + k) * PS * D;
      const float* vp = V + (page * KV + k) * PS * D;
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = qk + g * D;
        float* sg = s + g * PS;
        float block_max = neg_inf;
        for (int64_t j = 0; j < cnt; ++j) {
          const float* kj = kp + j * D;
          float dot = 0.0f;
          for (int64_t i = 0; i < D; ++i) dot += qg[i] * kj[i];
          sg[j] = dot * scale;
          block_max = std::max(block_max, sg[j]);
        }
        const float new_max = std::max(m[g], block_max);
        const float correction = std::exp(m[g] - new_max);  // 0 on the first page (m = -inf)
        float* ag = acc + g * D;
        float sum = l[g] * correction;
        for (int64_t i = 0; i < D; ++i) ag[i] *= correction;
        for (int64_t j = 0; j < cnt; ++j) {
          const float e = std::exp(sg[j] - new_max);
          sum += e;
          const float* vj = vp + j * D;
          for (int64_t i = 0; i < D; ++i) ag[i] += e * vj[i];
        }
        l[g] = sum;
        m[g] = new_max;
      }
    }
    float* ok = O + (bt * H + k * G) * D;
    for (int64_t g = 0; g < G; ++g) {
      const float inv = 1.0f / l[g];
      for (int64_t i = 0; i < D; ++i) ok[g * D + i] = acc[g * D + i] * inv;
    }
  }

  // Units [0, B*T*KV) in chunks taken from a shared counter, by this thread and by helpers on XLA's
  // intra-op pool. The caller waits only for chunks already taken: a helper that starts late finds none
  // left and returns, so the caller never waits on a task that has not run (the shared state outlives it).
  struct Shared {
    std::atomic<int64_t> next{0}, finished{0};
  };

  void RunChunks(Shared& sh, int64_t units, int64_t chunk) const {
    std::vector<float> s(G * PS), m(G), l(G), acc(G * D);
    for (;;) {
      const int64_t c = sh.next.fetch_add(1);
      const int64_t lo = c * chunk;
      if (lo >= units) return;
      const int64_t hi = std::min(units, lo + chunk);
      for (int64_t u = lo; u < hi; ++u) Solve(u, s.data(), m.data(), l.data(), acc.data());
      sh.finished.fetch_add(hi - lo);
    }
  }
};

}  // namespace

static ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_pool,
                                     ffi::Buffer<ffi::F32> v_pool, ffi::Buffer<ffi::S32> page_table,
                                     ffi::Buffer<ffi::S32> starts, ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions();
  const auto kd = k_pool.dimensions();
  const auto td = page_table.dimensions();
  const auto vd = v_pool.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || td.size() != 2 || vd.size() != 4 ||
      !std::equal(vd.begin(), vd.end(), kd.begin())) {
    return ffi::Error::InvalidArgument("paged_attention: expected q [b,t,h,d], pools [pages,kv,ps,d], table [b,P]");
  }
  Problem pr;
  pr.B = qd[0], pr.T = qd[1], pr.H = qd[2], pr.D = qd[3];
  pr.NP = kd[0], pr.KV = kd[1], pr.PS = kd[2];
  pr.P = td[1];
  if (kd[3] != pr.D || td[0] != pr.B || starts.dimensions()[0] != pr.B || pr.KV <= 0 || pr.H % pr.KV != 0) {
    return ffi::Error::InvalidArgument("paged_attention: mismatched shapes");
  }
  pr.G = pr.H / pr.KV;
  pr.scale = 1.0f / std::sqrt(static_cast<float>(pr.D));
  pr.Q = q.typed_data(), pr.K = k_pool.typed_data(), pr.V = v_pool.typed_data();
  pr.table = page_table.typed_data(), pr.start = starts.typed_data();
  pr.O = out->typed_data();

  const int64_t units = pr.B * pr.T * pr.KV;
  const int64_t helpers = std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 1), 64) - 1;
  const int64_t chunk = std::max<int64_t>(1, units / (4 * (helpers + 1)));
  auto shared = std::make_shared<Problem::Shared>();
  const int64_t chunks = (units + chunk - 1) / chunk;
  for (int64_t i = 0; i < std::min(helpers, chunks - 1); ++i) {
    pool.Schedule([pr, shared, units, chunk] { pr.RunChunks(*shared, units, chunk); });
  }
  pr.RunChunks(*shared, units, chunk);
  while (shared->finished.load() < units) std::this_thread::yield();
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(TiderlPagedAttention, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
