/* Our own declaration of the DLPack ABI (v1.x), written from the published specification.
 * Only the members deepspeed_c reads are named; sizes and offsets are pinned by
 * _Static_asserts here and compared against torch's ATen/dlpack.h by a unit test. */
#ifndef DSC_DLPACK_ABI_H
#define DSC_DLPACK_ABI_H

#include <stddef.h>
#include <stdint.h>

enum {
    DSC_DL_CPU = 1,
    DSC_DL_CUDA = 2,
    DSC_DL_CUDA_HOST = 3,
    DSC_DL_CUDA_MANAGED = 13,
};

enum {
    DSC_DL_INT = 0,
    DSC_DL_UINT = 1,
    DSC_DL_FLOAT = 2,
    DSC_DL_BFLOAT = 4,
    DSC_DL_COMPLEX = 5,
    DSC_DL_BOOL = 6,
};

typedef struct {
    int32_t device_type; /* one of DSC_DL_* device codes */
    int32_t device_id;
} DLDevice;

typedef struct {
    uint8_t code;
    uint8_t bits;
    uint16_t lanes;
} DLDataType;

typedef struct {
    void *data;
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t *shape;
    int64_t *strides; /* in elements; NULL means compact row-major */
    uint64_t byte_offset;
} DLTensor;

typedef struct DLManagedTensor {
    DLTensor dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensor *self);
} DLManagedTensor;

typedef struct {
    uint32_t major;
    uint32_t minor;
} DLPackVersion;

typedef struct DLManagedTensorVersioned {
    DLPackVersion version;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensorVersioned *self);
    uint64_t flags;
    DLTensor dl_tensor;
} DLManagedTensorVersioned;

/* The C exchange API (DLPack >= 1.3): a process-lifetime function table that a tensor type
 * publishes as the capsule `type(t).__dlpack_c_exchange_api__` named "dlpack_exchange_api". */
typedef struct DLPackExchangeAPIHeader {
    DLPackVersion version;
    struct DLPackExchangeAPIHeader *prev_api;
} DLPackExchangeAPIHeader;

typedef struct {
    DLPackExchangeAPIHeader header;
    int (*managed_tensor_allocator)(DLTensor *prototype, DLManagedTensorVersioned **out,
                                    void *error_ctx,
                                    void (*set_error)(void *error_ctx, const char *kind,
                                                      const char *message));
    int (*managed_tensor_from_py_object_no_sync)(void *py_object, DLManagedTensorVersioned **out);
    int (*managed_tensor_to_py_object_no_sync)(DLManagedTensorVersioned *tensor,
                                               void **out_py_object);
    int (*dltensor_from_py_object_no_sync)(void *py_object, DLTensor *out);
    int (*current_work_stream)(int32_t device_type, int32_t device_id, void **out_stream);
} DLPackExchangeAPI;

_Static_assert(sizeof(DLDevice) == 8, "DLDevice layout");
_Static_assert(sizeof(DLDataType) == 4, "DLDataType layout");
_Static_assert(offsetof(DLTensor, shape) == 24, "DLTensor layout");
_Static_assert(sizeof(DLTensor) == 48, "DLTensor layout");
_Static_assert(offsetof(DLManagedTensorVersioned, dl_tensor) == 32, "versioned layout");
_Static_assert(offsetof(DLPackExchangeAPI, current_work_stream) == 48, "exchange API layout");

#endif
