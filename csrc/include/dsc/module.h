/* Naming of JIT-built op modules. The builder compiles each variant (ISA, arch) with
 * -DDSC_MODULE_NAME=<name>, so several variants of one op can be loaded in one process
 * (tests compare the AVX2 and scalar paths side by side). */
#ifndef DSC_MODULE_H
#define DSC_MODULE_H

#ifndef DSC_MODULE_NAME
#error "DSC_MODULE_NAME must be defined by the op builder"
#endif

#define DSC_CAT_(a, b) a##b
#define DSC_CAT(a, b) DSC_CAT_(a, b)
#define DSC_STR_(x) #x
#define DSC_STR(x) DSC_STR_(x)

#define DSC_PYINIT DSC_CAT(PyInit_, DSC_MODULE_NAME)
#define DSC_MODULE_NAME_STR DSC_STR(DSC_MODULE_NAME)

#endif
