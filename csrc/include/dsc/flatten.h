/* Copy a list of host buffers into one contiguous buffer and back. */
#ifndef DSC_FLATTEN_H
#define DSC_FLATTEN_H

#include <stddef.h>
#include <stdint.h>

/* srcs[i] holds nbytes[i] bytes; they land back to back in dst (total = sum of nbytes). */
void dsc_flatten_bytes(const void *const *srcs, const int64_t *nbytes, int64_t n, void *dst);
/* The inverse: dst[i] receives nbytes[i] bytes taken back to back from src. */
void dsc_unflatten_bytes(const void *src, void *const *dsts, const int64_t *nbytes, int64_t n);

#endif
