// Makes `device` current for a launcher's duration and restores the caller's device: one form shared by the
// multi-tensor and inference launchers (DeviceGuard, scoped) and by the ops whose C bindings hold the device
// across a call (DSC_CUDA_ENTER_LEAVE: an extern "C" enter/leave pair, since a binding is plain C).
#pragma once

#include <cuda_runtime_api.h>

namespace dsc_cuda {

// Makes `device` current; *prev gets the caller's device. Both CUDA calls are checked: the first failure is
// returned and nothing after it runs.
inline cudaError_t enter_device(int device, int *prev) {
    cudaError_t err = cudaGetDevice(prev);
    if (err == cudaSuccess && *prev != device) err = cudaSetDevice(device);
    return err;
}

// Gives the caller's device back after a successful enter_device. Restoring cannot fail in a way the caller
// could act on (the launch's result stands), so its status is dropped on purpose.
inline void leave_device(int device, int prev) {
    if (prev >= 0 && prev != device) (void)cudaSetDevice(prev);
}

class DeviceGuard {
  public:
    explicit DeviceGuard(int device) : target_(device), err_(enter_device(device, &prev_)) {}
    ~DeviceGuard() {
        if (err_ == cudaSuccess) leave_device(target_, prev_);
    }
    int error() const { return static_cast<int>(err_); }
    DeviceGuard(const DeviceGuard &) = delete;
    DeviceGuard &operator=(const DeviceGuard &) = delete;

  private:
    int target_;
    int prev_ = -1;
    cudaError_t err_;
};

} // namespace dsc_cuda

// Defines `extern "C" int PREFIX_cuda_enter(int device, int *prev)` (returns a cudaError_t) and
// `extern "C" void PREFIX_cuda_leave(int device, int prev)`, the pair an op's header declares for its binding
// (dsc/binding_device.h). Each op module links its own static cudart, so each defines its own pair.
#define DSC_CUDA_ENTER_LEAVE(PREFIX)                                                                           \
    extern "C" int PREFIX##_cuda_enter(int device, int *prev) {                                                \
        return static_cast<int>(dsc_cuda::enter_device(device, prev));                                         \
    }                                                                                                          \
    extern "C" void PREFIX##_cuda_leave(int device, int prev) { dsc_cuda::leave_device(device, prev); }
