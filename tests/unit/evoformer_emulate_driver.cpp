// Host check of the Evoformer mma kernels (csrc/cuda/evoformer_{fwd,bwd}_mma.cu) under the CUDA
// emulation of csrc/cuda/evoformer_emulate.cuh, against float64 math on the same rounded inputs.
// Built and run by tests/unit/test_evoformer_emulated.py:
//   driver DTYPE B N L H D USE_MASK USE_PAIR SEED   (DTYPE bf16 or f16)
// prints one line "out E lse E dq E dk E dv E dmask E dpair E" (max |err| / max |ref|; -1: not used)
// and exits 0, or 2 on bad arguments.
#include "evoformer_emulate.cuh"  // first: its macros stand in for the CUDA built-ins below
#include "evoformer_fwd_mma.cu"
#include "evoformer_bwd_mma.cu"

#include <cstdio>
#include <string>

using namespace dsc_evo;

namespace {
struct Rng {
    uint64_t s;
    double uniform() {  // [0, 1)
        s = s * 6364136223846793005ULL + 1442695040888963407ULL;
        return (double)(s >> 11) / 9007199254740992.0;
    }
    double normal() {
        const double u = uniform() + 1e-12, v = uniform();
        return std::sqrt(-2.0 * std::log(u)) * std::cos(6.283185307179586 * v);
    }
};

template <typename T> std::vector<T> cast(const std::vector<double> &x) {
    std::vector<T> r(x.size());
    for (size_t i = 0; i < x.size(); i++) store(&r[i], (float)x[i]);
    return r;
}

template <typename T> std::vector<double> widen(const std::vector<T> &x) {
    std::vector<double> r(x.size());
    for (size_t i = 0; i < x.size(); i++) r[i] = load(&x[i]);
    return r;
}

template <typename A, typename B> double rel_err(const std::vector<A> &got, const std::vector<B> &want) {
    double err = 0, ref = 1e-30;
    for (size_t i = 0; i < want.size(); i++) {
        const double g = (double)got[i], w = (double)want[i];
        if (std::isinf(w) && std::isinf(g) && (w > 0) == (g > 0)) continue;
        err = std::max(err, std::fabs(g - w));
        if (!std::isinf(w)) ref = std::max(ref, std::fabs(w));
    }
    return err / ref;
}

template <typename T, int DP> int run(int B, int N, int L, int H, int D, bool use1, bool use2, uint64_t seed) {
    Rng rng{seed};
    const size_t n_qkv = (size_t)B * N * L * H * D, n_rows = (size_t)B * N * H * L;
    std::vector<double> q0(n_qkv), k0(n_qkv), v0(n_qkv), do0(n_qkv), b10((size_t)B * N * L), b20((size_t)B * H * L * L);
    for (auto *x : {&q0, &k0, &v0, &do0})
        for (auto &e : *x) e = rng.normal();
    for (auto &e : b10) e = rng.uniform() < 0.2 ? -1e4 : 0.0;
    for (size_t bn = 0; bn < (size_t)B * N; bn++) b10[bn * L] = 0.0;  // a visible key in every row
    for (auto &e : b20) e = rng.normal();
    auto q = cast<T>(q0), k = cast<T>(k0), v = cast<T>(v0), d_o = cast<T>(do0), b1 = cast<T>(b10), b2 = cast<T>(b20);
    // float64 reference on the rounded inputs
    const auto qd = widen(q), kd = widen(k), vd = widen(v), dod = widen(d_o), b1d = widen(b1), b2d = widen(b2);
    const double scale = 1.0 / std::sqrt((double)D);
    std::vector<double> o_ref(n_qkv), lse_ref(n_rows), dq_ref(n_qkv, 0), dk_ref(n_qkv, 0), dv_ref(n_qkv, 0),
        db1_ref(b10.size(), 0), db2_ref(b20.size(), 0);
    const size_t HD = (size_t)H * D;
    std::vector<double> p(L), dp(L);
    for (int b = 0; b < B; b++)
        for (int n = 0; n < N; n++)
            for (int h = 0; h < H; h++) {
                const size_t bn = (size_t)b * N + n, base = bn * L * HD + (size_t)h * D;
                const size_t plane = ((size_t)b * H + h) * L * L, row0 = (bn * H + h) * L;
                for (int i = 0; i < L; i++) {
                    double m = -INFINITY;
                    for (int j = 0; j < L; j++) {
                        double s = 0;
                        for (int d = 0; d < D; d++) s += qd[base + i * HD + d] * kd[base + j * HD + d];
                        s = s * scale + (use1 ? b1d[bn * L + j] : 0) + (use2 ? b2d[plane + (size_t)i * L + j] : 0);
                        p[j] = s;
                        m = std::max(m, s);
                    }
                    double sum = 0;
                    for (int j = 0; j < L; j++) sum += (p[j] = std::exp(p[j] - m));
                    lse_ref[row0 + i] = m + std::log(sum);
                    for (int j = 0; j < L; j++) p[j] /= sum;
                    double delta = 0;
                    for (int d = 0; d < D; d++) {
                        double o = 0;
                        for (int j = 0; j < L; j++) o += p[j] * vd[base + j * HD + d];
                        o_ref[base + i * HD + d] = o;
                        delta += o * dod[base + i * HD + d];
                    }
                    for (int j = 0; j < L; j++) {
                        double x = 0;
                        for (int d = 0; d < D; d++) x += dod[base + i * HD + d] * vd[base + j * HD + d];
                        const double ds = p[j] * (x - delta);
                        for (int d = 0; d < D; d++) {
                            dq_ref[base + i * HD + d] += ds * kd[base + j * HD + d] * scale;
                            dk_ref[base + j * HD + d] += ds * qd[base + i * HD + d] * scale;
                            dv_ref[base + j * HD + d] += p[j] * dod[base + i * HD + d];
                        }
                        db1_ref[bn * L + j] += ds;
                        db2_ref[plane + (size_t)i * L + j] += ds;
                    }
                }
            }
    // the kernels
    std::vector<T> o(n_qkv), dq(n_qkv), dk(n_qkv), dv(n_qkv);
    std::vector<float> lse(n_rows), delta(n_rows, std::nanf("")), db1(b10.size(), 0.f), db2(b20.size(), 0.f);
    const T *B1 = use1 ? b1.data() : nullptr, *B2 = use2 ? b2.data() : nullptr;
    const bool vec = D % 8 == 0, bvec = L % 8 == 0;
    const unsigned blocks = (unsigned)((L + kMmaRows - 1) / kMmaRows), grid = (unsigned)(B * N * H) * blocks;
    const float sc = (float)scale;
    dsc_emu::launch({grid, 1, 1}, 32 * kMmaWarps, [&] {
        evo_forward_mma_kernel<T, DP>(q.data(), k.data(), v.data(), B1, B2, o.data(), lse.data(), N, L, H, D, sc, vec,
                                      bvec);
    });
    dsc_emu::launch({grid, 1, 1}, 32 * kMmaWarps, [&] {
        evo_dq_mma_kernel<T, DP>(d_o.data(), q.data(), k.data(), v.data(), o.data(), lse.data(), delta.data(), B1,
                                 B2, dq.data(), N, L, H, D, sc, vec, bvec);  // delta: written by this kernel
    });
    dsc_emu::launch({grid, 1, 1}, 32 * kMmaWarps, [&] {
        evo_dkv_mma_kernel<T, DP>(d_o.data(), q.data(), k.data(), v.data(), lse.data(), delta.data(), B1, B2,
                                  dk.data(), dv.data(), use1 ? db1.data() : nullptr, N, L, H, D, sc, vec, bvec);
    });
    if (use2) {
        const int per = (N + 1) / 2;  // two shares of the stack: the cross-block atomics are exercised too
        const unsigned splits = (unsigned)((N + per - 1) / per);
        dsc_emu::launch({(unsigned)(B * H) * splits * blocks * blocks, 1, 1}, 32 * kMmaWarps, [&] {
            evo_dpair_mma_kernel<T, DP>(d_o.data(), q.data(), k.data(), v.data(), lse.data(), delta.data(), B1, B2,
                                        db2.data(), N, L, H, D, sc, per, (int)splits, vec, bvec);
        });
    }
    std::printf("out %.3e lse %.3e dq %.3e dk %.3e dv %.3e dmask %.3e dpair %.3e\n", rel_err(widen(o), o_ref),
                rel_err(lse, lse_ref), rel_err(widen(dq), dq_ref), rel_err(widen(dk), dk_ref),
                rel_err(widen(dv), dv_ref), use1 ? rel_err(db1, db1_ref) : -1.0, use2 ? rel_err(db2, db2_ref) : -1.0);
    return 0;
}
} // namespace

int main(int argc, char **argv) {
    if (argc != 10) {
        std::fprintf(stderr, "usage: %s bf16|f16 B N L H D USE_MASK USE_PAIR SEED\n", argv[0]);
        return 2;
    }
    const std::string dt = argv[1];
    const int B = std::atoi(argv[2]), N = std::atoi(argv[3]), L = std::atoi(argv[4]), H = std::atoi(argv[5]),
              D = std::atoi(argv[6]);
    const bool use1 = std::atoi(argv[7]) != 0, use2 = std::atoi(argv[8]) != 0;
    const uint64_t seed = std::strtoull(argv[9], nullptr, 10);
    if (B < 1 || N < 1 || L < 1 || H < 1 || D < 1 || D > 64 || (dt != "bf16" && dt != "f16")) return 2;
    if (dt == "bf16")
        return D <= 32 ? run<__nv_bfloat16, 32>(B, N, L, H, D, use1, use2, seed)
                       : run<__nv_bfloat16, 64>(B, N, L, H, D, use1, use2, seed);
    return D <= 32 ? run<__half, 32>(B, N, L, H, D, use1, use2, seed) : run<__half, 64>(B, N, L, H, D, use1, use2, seed);
}
