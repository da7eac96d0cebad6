/* cudaStream_t for the plain-C launcher headers: the CUDA runtime's declaration under nvcc, the same
 * typedef otherwise (the CPython bindings are compiled by gcc without the CUDA headers; a repeated
 * identical typedef is valid C11). */
#ifndef DSC_CUDA_STREAM_H
#define DSC_CUDA_STREAM_H

#if defined(__CUDACC__)
#include <cuda_runtime_api.h>
#else
struct CUstream_st;
typedef struct CUstream_st *cudaStream_t;
#endif

#endif
