/* Shared pieces of every multi-tensor op module: error text and the launch geometry. */
#include "multi_tensor_apply.cuh"

extern "C" const char *dsc_cuda_strerror(int code) {
    switch (code) {
    case DSC_CUDA_OK: return "no error";
    case DSC_CUDA_EDTYPE: return "unsupported dtype combination for this kernel";
    case DSC_CUDA_EARG: return "invalid argument (negative size, too many tensors or a missing pointer)";
    default: break;
    }
    return code > 0 ? cudaGetErrorString(static_cast<cudaError_t>(code)) : "unknown deepspeed_c CUDA error";
}

extern "C" int dsc_mt_tensors_per_launch(int depth) {
    switch (depth) {
    case 1: return dsc_mt::Meta<1>::kCap;
    case 2: return dsc_mt::Meta<2>::kCap;
    case 3: return dsc_mt::Meta<3>::kCap;
    case 4: return dsc_mt::Meta<4>::kCap;
    case 5: return dsc_mt::Meta<5>::kCap;
    default: return 0;
    }
}

extern "C" int dsc_mt_chunk_elems(void) { return dsc_mt::kChunk; }
