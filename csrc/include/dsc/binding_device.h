/* The device guard of the op bindings built twice, for host tensors and, with the op's DSC_<OP>_ON_CUDA,
 * for CUDA tensors (csrc/py/{moe_gating,random_ltd,quantizer,onebit,compress_quant}_binding.c).
 *
 * Before including this header a binding defines DSC_DEVICE_FAIL(rc, fname), its function turning a
 * launcher's error code into a Python exception (it returns NULL), and, in its CUDA build only,
 * DSC_DEVICE_ENTER(device, &prev) / DSC_DEVICE_LEAVE(device, prev), its launcher library's pair that makes
 * a device current and gives the caller's back (DSC_CUDA_ENTER_LEAVE of csrc/cuda/device_guard.cuh defines
 * it in the op's .cu: each op module links its own static cudart, so each module has its own pair).
 * It gets, for use in a function returning PyObject *:
 *   STREAM_OF(view, stream)  the view's device made current and `void *stream`, torch's current stream
 *                            there; on a failure of either it returns (the caller's device restored)
 *   LEAVE_DEVICE()           the caller's device back: after the launch, before the function returns
 *   CALL(fn, ...)            fn##_cuda(..., stream) in the CUDA build, fn(...) in the host build (the
 *                            variable STREAM_OF declared must be named `stream`)
 * In the host build STREAM_OF and LEAVE_DEVICE do nothing. */
#ifndef DSC_BINDING_DEVICE_H
#define DSC_BINDING_DEVICE_H

#ifdef DSC_DEVICE_ENTER
#define STREAM_OF(view, var)                                                                       \
    int prev_device_ = -1;                                                                          \
    const int device_ = (view).device_id;                                                           \
    const int enter_rc_ = DSC_DEVICE_ENTER(device_, &prev_device_);                                 \
    if (enter_rc_ != 0) return DSC_DEVICE_FAIL(enter_rc_, "set device");                            \
    void *var = dsc_current_cuda_stream(device_);                                                   \
    if (!var && PyErr_Occurred()) {                                                                 \
        DSC_DEVICE_LEAVE(device_, prev_device_);                                                    \
        return NULL;                                                                                \
    }
#define LEAVE_DEVICE() DSC_DEVICE_LEAVE(device_, prev_device_)
#define CALL(fn, ...) fn##_cuda(__VA_ARGS__, (cudaStream_t)stream)
#else
#define STREAM_OF(view, var) (void)0
#define LEAVE_DEVICE() (void)0
#define CALL(fn, ...) fn(__VA_ARGS__)
#endif

#endif
