// Issue 44 session 8: variants of the two fake-quant paths under 85% of copy (4096-element groups one pass;
// stochastic rounding), each checked bit-equal to the current kernel before timing. Standalone:
//   nvcc -O3 -std=c++17 --expt-relaxed-constexpr -arch=sm_90 -Icsrc/include -Icsrc/cuda .devrun/qbench.cu -o /tmp/qb
#include "../csrc/cuda/compress_quant.cu"

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#define CK(x)                                                                                                  \
    do {                                                                                                       \
        cudaError_t e_ = (x);                                                                                  \
        if (e_ != cudaSuccess) {                                                                               \
            fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_));                        \
            exit(1);                                                                                           \
        }                                                                                                      \
    } while (0)

namespace {

template <bool kStream> __device__ __forceinline__ float4 ld4(const float4 *p) {
    if constexpr (kStream) return __ldcs(p);
    else return *p;
}
template <bool kStream> __device__ __forceinline__ void st4(float4 *p, float4 v) {
    if constexpr (kStream) __stcs(p, v);
    else *p = v;
}

__device__ __forceinline__ float4 q4(float4 v, const Params &p, float qlo, float qhi, int asym, uint64_t seed,
                                     int64_t e) {
    float4 o;
    o.x = quant_one<float>(v.x, p, qlo, qhi, asym, 0, seed, e);
    o.y = quant_one<float>(v.y, p, qlo, qhi, asym, 0, seed, e + 1);
    o.z = quant_one<float>(v.z, p, qlo, qhi, asym, 0, seed, e + 2);
    o.w = quant_one<float>(v.w, p, qlo, qhi, asym, 0, seed, e + 3);
    return o;
}

// group kernel over float4: kT threads, kV float4 each (group = kT * kV * 4 elements at most); every thread
// folds the warps' partials itself (one barrier), params computed by every thread
template <int kT, int kV, bool kStream>
__global__ __launch_bounds__(kT) void group4(const float4 *__restrict__ x, float4 *__restrict__ out, int64_t groups,
                                             int64_t n4, int bits, int asym, uint64_t seed) {
    __shared__ unsigned int smin[2][kT / 32], smax[2][kT / 32];
    const float q = (float)(1 << bits);
    const float qlo = asym ? 0.0f : -q / 2, qhi = asym ? q - 1 : q / 2 - 1;
    int par = 0;
    for (int64_t g = blockIdx.x; g < groups; g += gridDim.x, par ^= 1) {
        const int64_t base = g * n4;
        float4 v[kV];
        unsigned int kmin = 0xffffffffu, kmax = 0u;
#pragma unroll
        for (int j = 0; j < kV; j++) {
            const int64_t k = threadIdx.x + (int64_t)j * kT;
            if (k < n4) v[j] = ld4<kStream>(x + base + k);
        }
#pragma unroll
        for (int j = 0; j < kV; j++) {
            const int64_t k = threadIdx.x + (int64_t)j * kT;
            if (k < n4) {
                take_key(v[j].x, asym, kmin, kmax);
                take_key(v[j].y, asym, kmin, kmax);
                take_key(v[j].z, asym, kmin, kmax);
                take_key(v[j].w, asym, kmin, kmax);
            }
        }
        for (int off = 16; off > 0; off >>= 1) {
            const unsigned int a = __shfl_xor_sync(0xffffffffu, kmin, off),
                               b = __shfl_xor_sync(0xffffffffu, kmax, off);
            kmin = a < kmin ? a : kmin;
            kmax = b > kmax ? b : kmax;
        }
        if ((threadIdx.x & 31) == 0) {
            smin[par][threadIdx.x >> 5] = kmin;
            smax[par][threadIdx.x >> 5] = kmax;
        }
        __syncthreads();
#pragma unroll
        for (int w = 0; w < kT / 32; w++) {
            kmin = smin[par][w] < kmin ? smin[par][w] : kmin;
            kmax = smax[par][w] > kmax ? smax[par][w] : kmax;
        }
        float vlo, vhi;
        keys_range(kmin, kmax, asym, vlo, vhi);
        const Params p = make_params<float>(vlo, vhi, q, asym, 0);
#pragma unroll
        for (int j = 0; j < kV; j++) {
            const int64_t k = threadIdx.x + (int64_t)j * kT;
            if (k < n4) st4<kStream>(out + base + k, q4(v[j], p, qlo, qhi, asym, seed, 4 * (base + k)));
        }
    }
}

// apply over float4, kU float4 per thread per iteration (loads first)
template <int kU, bool kStream>
__global__ void apply4(const float4 *__restrict__ x, float4 *__restrict__ out, int64_t total4, int64_t n4,
                       const Params *__restrict__ params, float qlo, float qhi, int asym, uint64_t seed) {
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + (kU - 1) * stride < total4; i += kU * stride) {
        float4 v[kU];
#pragma unroll
        for (int u = 0; u < kU; u++) v[u] = ld4<kStream>(x + i + u * stride);
#pragma unroll
        for (int u = 0; u < kU; u++) {
            const int64_t k = i + u * stride;
            const Params p = params[n4 == total4 ? 0 : k / n4];
            st4<kStream>(out + k, q4(v[u], p, qlo, qhi, asym, seed, 4 * k));
        }
    }
    for (; i < total4; i += stride) {
        const Params p = params[n4 == total4 ? 0 : i / n4];
        st4<kStream>(out + i, q4(ld4<kStream>(x + i), p, qlo, qhi, asym, seed, 4 * i));
    }
}

template <int kU, bool kStream>
__global__ void ranges4(const float4 *__restrict__ x, int64_t n4, int asym, unsigned int *keys) {
    __shared__ unsigned int smin[kThreads / 32], smax[kThreads / 32];
    unsigned int kmin = 0xffffffffu, kmax = 0u;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + (kU - 1) * stride < n4; i += kU * stride) {
        float4 v[kU];
#pragma unroll
        for (int u = 0; u < kU; u++) v[u] = ld4<kStream>(x + i + u * stride);
#pragma unroll
        for (int u = 0; u < kU; u++) {
            take_key(v[u].x, asym, kmin, kmax);
            take_key(v[u].y, asym, kmin, kmax);
            take_key(v[u].z, asym, kmin, kmax);
            take_key(v[u].w, asym, kmin, kmax);
        }
    }
    for (; i < n4; i += stride) {
        const float4 v = ld4<kStream>(x + i);
        take_key(v.x, asym, kmin, kmax);
        take_key(v.y, asym, kmin, kmax);
        take_key(v.z, asym, kmin, kmax);
        take_key(v.w, asym, kmin, kmax);
    }
    block_keys(kmin, kmax, smin, smax);
    if (threadIdx.x == 0) {
        if (asym) atomicMin(&keys[0], kmin);
        atomicMax(&keys[1], kmax);
    }
}

__global__ void count_diff(const unsigned int *a, const unsigned int *b, int64_t n, unsigned long long *bad) {
    unsigned long long c = 0;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        c += a[i] != b[i];
    if (c) atomicAdd(bad, c);
}

__global__ void fill(float *x, int64_t n) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        x[i] = 3.0f * (float)((int)(dsc_cq_noise(99, i) * 1e6f)) * 1e-6f + (float)((i * 7919) % 13) * 0.01f;
}

int sms() {
    int dev = 0, s = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&s, cudaDevAttrMultiProcessorCount, dev);
    return s;
}

}  // namespace

int main(int argc, char **argv) {
    const int log2 = argc > 1 ? atoi(argv[1]) : 28;
    const int64_t n = 1ll << log2, n4 = n / 4;
    float *x, *ref, *out;
    CK(cudaMalloc(&x, n * 4));
    CK(cudaMalloc(&ref, n * 4));
    CK(cudaMalloc(&out, n * 4));
    unsigned long long *bad;
    CK(cudaMalloc(&bad, 8));
    fill<<<1024, 256>>>(x, n);
    CK(cudaDeviceSynchronize());
    const int S = sms();
    const int64_t G = n / 4096;
    const float4 *x4 = reinterpret_cast<const float4 *>(x);
    float4 *o4 = reinterpret_cast<float4 *>(out);

    // the two-pass path's scratch for g1 (one group)
    unsigned int *keys;
    Params *params;
    CK(cudaMalloc(&keys, 64));
    CK(cudaMalloc(&params, 64));
    auto g1_params = [&](int asym, auto ranges_launch) {
        cudaMemsetAsync(keys, 0xff, 4);
        cudaMemsetAsync(keys + 1, 0, 4);
        ranges_launch();
        params_kernel<float><<<1, 128>>>(keys, nullptr, nullptr, 1, 8, asym, 0, params);
    };

    struct Case {
        std::string name, family;
        std::function<void()> fn;
        double bytes;
    };
    std::vector<Case> cases;
    auto cur = [&](int64_t groups, int asym, uint64_t seed) {
        return [=]() { fake_quant_t<float>(x, out, groups, n / groups, 8, asym, nullptr, nullptr, 0, seed, 0); };
    };
    // family "g4096": asym8, groups of 4096, one pass (2 x 4 B per element)
    cases.push_back({"cur (group_vec_kernel)", "g4096", cur(G, 1, 0), 8.0 * n});
    cases.push_back({"group4 256x4", "g4096", [&]() { group4<256, 4, false><<<(unsigned)G, 256>>>(x4, o4, G, 1024, 8, 1, 0); }, 8.0 * n});
    cases.push_back({"group4 128x8", "g4096", [&]() { group4<128, 8, false><<<(unsigned)G, 128>>>(x4, o4, G, 1024, 8, 1, 0); }, 8.0 * n});
    cases.push_back({"group4 128x8 cs", "g4096", [&]() { group4<128, 8, true><<<(unsigned)G, 128>>>(x4, o4, G, 1024, 8, 1, 0); }, 8.0 * n});
    cases.push_back({"group4 512x2", "g4096", [&]() { group4<512, 2, false><<<(unsigned)G, 512>>>(x4, o4, G, 1024, 8, 1, 0); }, 8.0 * n});
    cases.push_back({"group4 64x16", "g4096", [&]() { group4<64, 16, false><<<(unsigned)G, 64>>>(x4, o4, G, 1024, 8, 1, 0); }, 8.0 * n});
    cases.push_back({"group4 256x4 persist", "g4096", [&]() { group4<256, 4, false><<<(unsigned)(S * 8), 256>>>(x4, o4, G, 1024, 8, 1, 0); }, 8.0 * n});
    // family "stoch": sym8 g1 stochastic, two passes (3 x 4 B per element)
    cases.push_back({"cur stochastic g1", "stoch", cur(1, 0, 7), 12.0 * n});
    auto two_pass = [&](int asym, uint64_t seed, int ru, bool rs, int au, bool as, int grid_mult) {
        return [=]() {
            g1_params(asym, [&]() {
                const int gb = S * grid_mult;
                if (ru == 1 && !rs) ranges4<1, false><<<gb, kThreads>>>(x4, n4, asym, keys);
                else if (ru == 2 && !rs) ranges4<2, false><<<gb, kThreads>>>(x4, n4, asym, keys);
                else if (ru == 2 && rs) ranges4<2, true><<<gb, kThreads>>>(x4, n4, asym, keys);
                else ranges4<4, false><<<gb, kThreads>>>(x4, n4, asym, keys);
            });
            const int gb = S * grid_mult;
            if (au == 1 && !as) apply4<1, false><<<gb, kThreads>>>(x4, o4, n4, n4, params, -128.f, 127.f, asym, seed);
            else if (au == 2 && !as) apply4<2, false><<<gb, kThreads>>>(x4, o4, n4, n4, params, -128.f, 127.f, asym, seed);
            else if (au == 2 && as) apply4<2, true><<<gb, kThreads>>>(x4, o4, n4, n4, params, -128.f, 127.f, asym, seed);
            else apply4<4, false><<<gb, kThreads>>>(x4, o4, n4, n4, params, -128.f, 127.f, asym, seed);
        };
    };
    cases.push_back({"2pass r1 a1 g8", "stoch", two_pass(0, 7, 1, false, 1, false, 8), 12.0 * n});
    {
        auto inner = two_pass(0, 7, 1, false, 1, false, 8);
        cases.push_back({"2pass r1 a1 g8 +defaultpool", "stoch", [=]() {
                             void *tmp = nullptr;
                             cudaMallocAsync(&tmp, 64, 0);
                             inner();
                             cudaFreeAsync(tmp, 0);
                         }, 12.0 * n});
    }
    cases.push_back({"mix cur-ranges + apply4<1>", "stoch", [&]() {
                         g1_params(0, [&]() {
                             ranges_kernel<float4><<<dim3(S * 8, 1), kThreads>>>(x4, n4, 1, 0, keys);
                         });
                         apply4<1, false><<<S * 8, kThreads>>>(x4, o4, n4, n4, params, -128.f, 127.f, 0, 7);
                     }, 12.0 * n});
    cases.push_back({"mix ranges4<1> + cur-apply", "stoch", [&]() {
                         g1_params(0, [&]() { ranges4<1, false><<<S * 8, kThreads>>>(x4, n4, 0, keys); });
                         apply_kernel_f32x4<<<S * 8, kThreads>>>(x4, o4, n4, n4, params, -128.f, 127.f, 0, 7);
                     }, 12.0 * n});
    cases.push_back({"2pass r2 a2 g8", "stoch", two_pass(0, 7, 2, false, 2, false, 8), 12.0 * n});
    cases.push_back({"2pass r2cs a2cs g8", "stoch", two_pass(0, 7, 2, true, 2, true, 8), 12.0 * n});
    cases.push_back({"2pass r4 a4 g8", "stoch", two_pass(0, 7, 4, false, 4, false, 8), 12.0 * n});
    cases.push_back({"2pass r2 a2 g4", "stoch", two_pass(0, 7, 2, false, 2, false, 4), 12.0 * n});
    cases.push_back({"2pass r2 a2 g16", "stoch", two_pass(0, 7, 2, false, 2, false, 16), 12.0 * n});
    // family "near": sym8 g1 nearest (already at the bar; the same variants must not lose)
    cases.push_back({"cur sym8 g1", "near", cur(1, 0, 0), 12.0 * n});
    cases.push_back({"2pass r2 a2 g8 near", "near", two_pass(0, 0, 2, false, 2, false, 8), 12.0 * n});
    cases.push_back({"2pass r2cs a2cs g8 near", "near", two_pass(0, 0, 2, true, 2, true, 8), 12.0 * n});
    cases.push_back({"memcpy d2d", "copy", [&]() { cudaMemcpyAsync(out, x, n * 4, cudaMemcpyDeviceToDevice); }, 8.0 * n});

    // correctness: every variant equals the current kernel of its family bit for bit
    bool ok_all = true;
    for (auto fam : {"g4096", "stoch", "near"}) {
        const Case *base = nullptr;
        for (auto &c : cases)
            if (c.family == fam && !base) {
                base = &c;
                c.fn();
                CK(cudaMemcpy(ref, out, n * 4, cudaMemcpyDeviceToDevice));
            } else if (c.family == fam) {
                CK(cudaMemset(out, 0, n * 4));
                c.fn();
                CK(cudaMemset(bad, 0, 8));
                count_diff<<<1024, 256>>>(reinterpret_cast<unsigned *>(out), reinterpret_cast<unsigned *>(ref), n, bad);
                unsigned long long h = 0;
                CK(cudaMemcpy(&h, bad, 8, cudaMemcpyDeviceToHost));
                printf("check %-28s vs %-24s mismatches %llu\n", c.name.c_str(), base->name.c_str(), h);
                ok_all &= h == 0;
            }
    }
    CK(cudaDeviceSynchronize());
    printf("correctness: %s\n", ok_all ? "all bit-equal" : "MISMATCH");

    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    std::vector<float> best(cases.size(), 1e30f);
    const int reps = 5;
    for (int round = 0; round < 5; round++)
        for (size_t k = 0; k < cases.size(); k++) {
            cases[k].fn();
            cudaEventRecord(a);
            for (int r = 0; r < reps; r++) cases[k].fn();
            cudaEventRecord(b);
            cudaEventSynchronize(b);
            float ms = 0;
            cudaEventElapsedTime(&ms, a, b);
            best[k] = std::min(best[k], ms / reps);
        }
    CK(cudaGetLastError());
    double copy_bw = 0;
    for (size_t k = 0; k < cases.size(); k++)
        if (cases[k].family == "copy") copy_bw = cases[k].bytes / best[k] / 1e6;
    printf("\n2^%d fp32, best of 5 rounds x %d reps; bytes: one-pass 8 B/elt, two-pass 12 B/elt\n", log2, reps);
    printf("%-30s %-7s %9s %9s %8s\n", "case", "family", "ms", "GB/s", "vs copy");
    for (size_t k = 0; k < cases.size(); k++) {
        const double bw = cases[k].bytes / best[k] / 1e6;
        printf("%-30s %-7s %9.3f %9.0f %8.3f\n", cases[k].name.c_str(), cases[k].family.c_str(), best[k], bw,
               bw / copy_bw);
    }
    return ok_all ? 0 : 1;
}
