// Paged attention on the CPU, read straight from the page pool: an XLA FFI custom call.
//
// The `xla` implementation (paged_attention.py) gathers every row's pages into a dense [b, span] copy
// and multiplies it, at XLA:CPU's gather speed and over the whole padded span; this kernel walks each
// row's page table and reads only the pages that hold its keys, one page at a time, with an online
// (running max and sum) softmax, so nothing is copied and padding costs nothing.
//
// Contract (the same as paged_attention_reference): q [b, t, h, d], k_pool / v_pool [pages, kv, ps, d]
// (float32), page_table [b, P] int32, starts [b] int32, num_new [b] int32 -> out [b, t, h, d]. Query t of
// row b sits at position starts[b] + t and attends the keys at positions 0 ..= that position (at most P * ps
// of them); query head j reads kv head j / (h / kv). Queries t >= num_new[b] are the row's padding: skipped,
// written as zeros. Built at first use by cpu_attention.py.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kQueryTile = 16;  // query tokens per unit: a page's keys are read once for all of them
constexpr int64_t kTransposeMin = 8;  // query vectors per unit from which a page is transposed (measured)

// exp(x) for x <= 0 (scores minus their running max), to about 2 ulp: Cody-Waite reduction x = n ln2 + r and
// Cephes' degree-6 polynomial for exp(r), scaled by 2^n through the exponent bits. Branch-free, so the compiler
// vectorises the loop that calls it (std::exp is a scalar library call per score). Below -87.3 it returns about
// 1e-38 in place of a denormal or 0.
inline float ExpNonPositive(float x) {
  x = std::max(x, -87.3f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// One unit: (row, tile of up to QT query tokens, kv head). The G query heads that share the kv head and the
// tile's tokens go through the row's pages together: each page's keys are transposed once to [D, PS] and its
// keys and values read once for all of the tile's M = tokens * G query vectors, and the scores of a query are
// a vector over the page's keys (no horizontal sum per key). A query stops at its own position, so the pages
// no query of the tile sees are never read (the causal mask's fully masked tiles), and the row's padding
// queries (tokens at or past num_new[b]) are skipped and written as zeros.
struct Problem {
  int64_t B, T, H, D, NP, KV, PS, P, G, QT, NT;
  float scale;
  const float *Q, *K, *V;
  const int32_t *table, *start, *num_new;
  float* O;

  struct Scratch {
    std::vector<float> s, kt, m, l, acc;
    explicit Scratch(const Problem& pr)
        : s(pr.PS), kt(pr.D * pr.PS), m(pr.QT * pr.G), l(pr.QT * pr.G), acc(pr.QT * pr.G * pr.D) {}
  };

  // s[j] = scale * q . k_j for the page's keys, from the page transposed to kt [D, PS]: a vector of 16 keys at a
  // time (the default page size is 16) with four independent accumulators (GCC / Clang vector extensions: one
  // AVX-512 register, or as many narrower ones as the machine has; the auto-vectoriser picked the wrong loop).
  void Scores(const float* __restrict qv, const float* __restrict kt, float* __restrict s) const {
    typedef float V16 __attribute__((vector_size(64)));
    int64_t j0 = 0;
    for (; j0 + 16 <= PS; j0 += 16) {
      V16 r0 = {}, r1 = {}, r2 = {}, r3 = {}, k0, k1, k2, k3;
      int64_t i = 0;
      for (; i + 4 <= D; i += 4) {
        std::memcpy(&k0, kt + i * PS + j0, sizeof(k0));
        std::memcpy(&k1, kt + (i + 1) * PS + j0, sizeof(k1));
        std::memcpy(&k2, kt + (i + 2) * PS + j0, sizeof(k2));
        std::memcpy(&k3, kt + (i + 3) * PS + j0, sizeof(k3));
        r0 += qv[i] * k0;
        r1 += qv[i + 1] * k1;
        r2 += qv[i + 2] * k2;
        r3 += qv[i + 3] * k3;
      }
      for (; i < D; ++i) {
        std::memcpy(&k0, kt + i * PS + j0, sizeof(k0));
        r0 += qv[i] * k0;
      }
      const V16 sum = ((r0 + r1) + (r2 + r3)) * scale;
      std::memcpy(s + j0, &sum, sizeof(sum));
    }
    for (int64_t j = j0; j < PS; ++j) {
      float r = 0.0f;
      for (int64_t i = 0; i < D; ++i) r += qv[i] * kt[i * PS + j];
      s[j] = r * scale;
    }
  }

  // a[:D] += sum_j e[j] v_j[:D] over the page's first `vis` values, 16 lanes of D at a time held in a register.
  void Accumulate(const float* __restrict e, int64_t vis, const float* __restrict vp, float* __restrict a) const {
    typedef float V16 __attribute__((vector_size(64)));
    int64_t c = 0;
    for (; c + 16 <= D; c += 16) {
      V16 acc, vj;
      std::memcpy(&acc, a + c, sizeof(acc));
      for (int64_t j = 0; j < vis; ++j) {
        std::memcpy(&vj, vp + j * D + c, sizeof(vj));
        acc += e[j] * vj;
      }
      std::memcpy(a + c, &acc, sizeof(acc));
    }
    for (; c < D; ++c)
      for (int64_t j = 0; j < vis; ++j) a[c] += e[j] * vp[j * D + c];
  }

  void Solve(int64_t unit, Scratch& w) const {
    const int64_t k = unit % KV, rest = unit / KV, tile = rest % NT, b = rest / NT;
    const int64_t t0 = tile * QT, t_end = std::min(T, t0 + QT);
    const int64_t t1 = std::max(t0, std::min<int64_t>(t_end, num_new[b]));  // real queries [t0, t1)
    for (int64_t t = t1; t < t_end; ++t) std::fill_n(O + ((b * T + t) * H + k * G) * D, G * D, 0.0f);
    if (t1 == t0) return;
    const float neg_inf = -std::numeric_limits<float>::infinity();
    const int64_t first = start[b];
    const int64_t n = std::min<int64_t>(first + t1, P * PS);  // keys the tile's last query sees
    const int64_t M = (t1 - t0) * G;
    // Transposing a page costs about as much as a few queries' scores: worth it for a prefill tile's many
    // queries, not for a decode row's G; those take a dot product per key.
    const bool transpose = M >= kTransposeMin;
    float *s = w.s.data(), *kt = w.kt.data(), *m = w.m.data(), *l = w.l.data(), *acc = w.acc.data();
    std::fill_n(m, M, neg_inf);
    std::fill_n(l, M, 0.0f);
    std::fill_n(acc, M * D, 0.0f);
    for (int64_t p = 0; p * PS < n; ++p) {
      int64_t page = table[b * P + p];
      page = std::min<int64_t>(std::max<int64_t>(page, 0), NP - 1);
      const int64_t cnt = std::min<int64_t>(PS, n - p * PS);
      const float* kp = K + (page * KV + k) * PS * D;
      const float* vp = V + (page * KV + k) * PS * D;
      if (transpose) {
        for (int64_t j = 0; j < cnt; ++j)
          for (int64_t i = 0; i < D; ++i) kt[i * PS + j] = kp[j * D + i];
        for (int64_t i = 0; i < D; ++i) std::fill(kt + i * PS + cnt, kt + (i + 1) * PS, 0.0f);
      }
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t vis = std::min<int64_t>(cnt, std::min<int64_t>(first + t + 1, P * PS) - p * PS);
        if (vis <= 0) continue;  // this page is past the query's position (later queries of the tile see it)
        for (int64_t g = 0; g < G; ++g) {
          const int64_t mq = (t - t0) * G + g;
          const float* qv = Q + ((b * T + t) * H + k * G + g) * D;
          if (transpose) {
            Scores(qv, kt, s);
          } else {
            for (int64_t j = 0; j < vis; ++j) {
              const float* kj = kp + j * D;
              float dot = 0.0f;
              for (int64_t i = 0; i < D; ++i) dot += qv[i] * kj[i];
              s[j] = dot * scale;
            }
          }
          float block_max = neg_inf;
          for (int64_t j = 0; j < vis; ++j) block_max = std::max(block_max, s[j]);
          const float new_max = std::max(m[mq], block_max);
          const float correction = std::exp(m[mq] - new_max);  // 0 on the first page (m = -inf)
          float* a = acc + mq * D;
          for (int64_t i = 0; i < D; ++i) a[i] *= correction;
          for (int64_t j = 0; j < vis; ++j) s[j] = ExpNonPositive(s[j] - new_max);
          float sum = 0.0f;
          for (int64_t j = 0; j < vis; ++j) sum += s[j];
          Accumulate(s, vis, vp, a);
          l[mq] = l[mq] * correction + sum;
          m[mq] = new_max;
        }
      }
    }
    for (int64_t t = t0; t < t1; ++t) {
      float* o = O + ((b * T + t) * H + k * G) * D;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t mq = (t - t0) * G + g;
        const float inv = 1.0f / l[mq];
        for (int64_t i = 0; i < D; ++i) o[g * D + i] = acc[mq * D + i] * inv;
      }
    }
  }

  // Units [0, B*NT*KV) in chunks taken from a shared counter, by this thread and by helpers on XLA's
  // intra-op pool. The caller waits only for chunks already taken: a helper that starts late finds none
  // left and returns, so the caller never waits on a task that has not run (the shared state outlives it).
  struct Shared {
    std::atomic<int64_t> next{0}, finished{0};
  };

  void RunChunks(Shared& sh, int64_t units, int64_t chunk) const {
    Scratch w(*this);
    for (;;) {
      const int64_t c = sh.next.fetch_add(1);
      const int64_t lo = c * chunk;
      if (lo >= units) return;
      const int64_t hi = std::min(units, lo + chunk);
      for (int64_t u = lo; u < hi; ++u) Solve(u, w);
      sh.finished.fetch_add(hi - lo);
    }
  }
};

}  // namespace

static ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_pool,
                                     ffi::Buffer<ffi::F32> v_pool, ffi::Buffer<ffi::S32> page_table,
                                     ffi::Buffer<ffi::S32> starts, ffi::Buffer<ffi::S32> num_new,
                                     ffi::ResultBuffer<ffi::F32> out) {
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
  if (kd[3] != pr.D || td[0] != pr.B || starts.dimensions()[0] != pr.B || num_new.dimensions()[0] != pr.B ||
      pr.KV <= 0 || pr.H % pr.KV != 0) {
    return ffi::Error::InvalidArgument("paged_attention: mismatched shapes");
  }
  pr.G = pr.H / pr.KV;
  pr.scale = 1.0f / std::sqrt(static_cast<float>(pr.D));
  pr.Q = q.typed_data(), pr.K = k_pool.typed_data(), pr.V = v_pool.typed_data();
  pr.table = page_table.typed_data(), pr.start = starts.typed_data(), pr.num_new = num_new.typed_data();
  pr.QT = std::min<int64_t>(pr.T, kQueryTile);
  pr.NT = (pr.T + pr.QT - 1) / pr.QT;
  pr.O = out->typed_data();

  const int64_t units = pr.B * pr.NT * pr.KV;
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
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
