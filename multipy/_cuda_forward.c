/*
 * The CUDA driver as each interpreter sees it: libcuda.so.1, forwarded to the host's
 * driver (docs/design.md, "CUDA").  A process can use one driver, not one per namespace.
 */
#define FORWARD_NAMES "_cuda_names.h"
#define FORWARD_MISSING 500 /* CUDA_ERROR_NOT_FOUND */
#include "_forward.h"
