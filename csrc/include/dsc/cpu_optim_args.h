/* Binding-side argument parsing shared by the CPU optimizer modules: tensor lists in, validated
 * dsc_opt_tensor arrays out (names in every error). */
#ifndef DSC_CPU_OPTIM_ARGS_H
#define DSC_CPU_OPTIM_ARGS_H

#include "dsc/tensor_view.h" /* Python.h first, as CPython requires */
#include "dsc/cpu_optim.h"

/* Operand lists of one step call; s1 and copies may be NULL (absent) and copies may be None.
 * On success *out is PyMem-allocated (free with PyMem_Free) and *n its length. */
int dsc_parse_opt_lists(PyObject *params, PyObject *grads, PyObject *s0, const char *s0_name, PyObject *s1,
                        const char *s1_name, PyObject *copies, dsc_opt_tensor **out, Py_ssize_t *n);

/* A list of float32/bfloat16/float16 CPU tensors as operands + numels (both PyMem-allocated). */
int dsc_parse_operand_list(PyObject *tensors, const char *name, dsc_operand **ops, int64_t **numels,
                           Py_ssize_t *n);

/* The METH_FASTCALL method bump_steps(steps): every tensor of `steps` (float32 CPU tensors of one
 * element: torch's per-parameter step counts) += 1 in place; returns the new counts as a list of
 * ints. Nothing changes unless every tensor is valid. */
PyObject *dsc_bump_steps(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

/* The METH_FASTCALL method simd() -> the SIMD path this op was built for ("avx512", "avx2", "scalar"). */
PyObject *dsc_simd_method(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

#define DSC_SIMD_METHOD                                                                                \
    {"simd", (PyCFunction)(void (*)(void))dsc_simd_method, METH_FASTCALL,                              \
     "simd() -> the SIMD path of this build."}

/* Runs one optimizer step over the parsed operands with the GIL released, then frees `ts`.
 * `step` adapts the op's typed entry point; returns None, or NULL with MemoryError set. */
typedef int (*dsc_opt_step_fn)(dsc_opt_tensor *ts, int64_t n, const void *hparams);
PyObject *dsc_run_opt_step(dsc_opt_tensor *ts, Py_ssize_t n, dsc_opt_step_fn step, const void *hparams);

/* The METH_FASTCALL method num_threads(n=0) -> int: with n > 0, the OpenMP threads this op's steps
 * use from now on (offload_optimizer.cpuadam_cores_perc); returns the count in force. */
PyObject *dsc_num_threads_method(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

#define DSC_NUM_THREADS_METHOD                                                                         \
    {"num_threads", (PyCFunction)(void (*)(void))dsc_num_threads_method, METH_FASTCALL,                \
     "num_threads(n=0) -> int: set (n > 0) and return the OpenMP threads of this op's steps."}

#define DSC_BUMP_STEPS_METHOD                                                                          \
    {"bump_steps", (PyCFunction)(void (*)(void))dsc_bump_steps, METH_FASTCALL,                         \
     "bump_steps(steps) -> list[int]: each one-element float32 step tensor += 1, in place."}

#endif
