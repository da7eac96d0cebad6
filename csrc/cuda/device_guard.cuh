// Makes `device` current for a launcher's duration and restores the caller's device (shared by the
// multi-tensor and inference launchers).
#pragma once

#include <cuda_runtime_api.h>

namespace dsc_cuda {

class DeviceGuard {
  public:
    explicit DeviceGuard(int device) : target_(device) {
        err_ = cudaGetDevice(&prev_);
        if (err_ == cudaSuccess && prev_ != device) err_ = cudaSetDevice(device);
    }
    ~DeviceGuard() {
        // Restoring cannot fail in a way the caller could act on; the launch result stands.
        if (err_ == cudaSuccess && prev_ != target_) (void)cudaSetDevice(prev_);
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
