// The step between the QKV GEMM and attention: bias add, rotary embedding of q and k (half-split
// pairs, HF's rotate_half layout, float32 tables by position), q to its own buffer and k, v
// appended to the KV cache at the device-held past length. One block per token.
#include "inference_common.cuh"

namespace {
using namespace dsc_inf;

template <typename T>
__global__ void qkv_rotary_cache_kernel(const T *__restrict__ qkv, const T *__restrict__ bias,
                                        const float *__restrict__ cos, const float *__restrict__ sin, int64_t n_pos,
                                        const int64_t *__restrict__ positions, const int32_t *__restrict__ past,
                                        T *__restrict__ kc, T *__restrict__ vc, T *__restrict__ q_out, int T_, int H,
                                        int Hkv, int D, int rot, int S) {
    const int token = blockIdx.x;  // b * T + t
    const int b = token / T_, t = token - b * T_;
    const int width = (H + 2 * Hkv) * D;
    const T *src = qkv + (int64_t)token * width;
    const int row = *past + t;
    int64_t pos = 0;
    if (cos) {
        pos = positions[token];
        pos = pos < 0 ? 0 : (pos >= n_pos ? n_pos - 1 : pos);
    }
    const int half = rot / 2;
    for (int e = threadIdx.x; e < width; e += blockDim.x) {
        const int head = e / D, d = e - head * D;
        float v = load(src + e);
        if (bias) v += load(bias + e);
        if (cos && head < H + Hkv && d < rot) {  // q and k heads rotate; v does not
            const int pd = d < half ? d + half : d - half;
            float other = load(src + head * D + pd);
            if (bias) other += load(bias + head * D + pd);
            const float c = cos[pos * D + d], s = sin[pos * D + d];
            v = d < half ? v * c - other * s : v * c + other * s;
        }
        if (head < H) {
            store(q_out + ((int64_t)token * H + head) * D + d, v);
        } else if (row < S) {
            const int kvh = head < H + Hkv ? head - H : head - H - Hkv;
            T *cache = head < H + Hkv ? kc : vc;
            store(cache + (((int64_t)b * Hkv + kvh) * S + row) * D + d, v);
        }
    }
}
} // namespace

extern "C" int dsc_inf_qkv_rotary_cache(const void *qkv, const void *bias, const float *cos, const float *sin,
                                        int64_t n_pos, const int64_t *positions, const int32_t *past, void *k_cache,
                                        void *v_cache, void *q_out, int64_t B, int64_t T, int64_t H, int64_t Hkv,
                                        int64_t D, int64_t rot, int64_t S, int dtype, int device, cudaStream_t stream) {
    if (!qkv || !past || !k_cache || !v_cache || !q_out || B < 1 || T < 1 || H < 1 || Hkv < 1 || D < 1 || S < 1 ||
        B * T > 0x7fffffffLL || (H + 2 * Hkv) * D > 0x7fffffffLL)
        return DSC_CUDA_EARG;
    if (cos && (!sin || !positions || n_pos < 1 || rot < 2 || rot > D || rot % 2 != 0)) return DSC_CUDA_EARG;
    DeviceGuard guard(device);
    if (guard.error() != 0) return guard.error();
    const int width = (int)((H + 2 * Hkv) * D);
    const int threads = width >= 1024 ? 1024 : ((width + 31) / 32) * 32;
    return dispatch(dtype, [&](auto *tag) {
        using E = std::remove_pointer_t<decltype(tag)>;
        qkv_rotary_cache_kernel<E><<<(unsigned)(B * T), threads, 0, stream>>>(
            static_cast<const E *>(qkv), static_cast<const E *>(bias), cos, sin, n_pos, positions, past,
            static_cast<E *>(k_cache), static_cast<E *>(v_cache), static_cast<E *>(q_out), (int)T, (int)H, (int)Hkv,
            (int)D, (int)rot, (int)S);
        return launch_error();
    });
}
