/* Force-included (gcc -include) into csrc/core/fetch_plan.c by test_fetch_plan.py: routes the
 * planner's malloc/calloc through a counter so the driver can fail the k-th allocation. */
#include <stdlib.h>
void *dsc_test_malloc(size_t n);
void *dsc_test_calloc(size_t n, size_t size);
#define malloc dsc_test_malloc
#define calloc dsc_test_calloc
