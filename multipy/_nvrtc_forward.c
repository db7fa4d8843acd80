/*
 * NVRTC, CUDA's runtime compiler, as each interpreter sees it: libnvrtc.so.13, forwarded
 * to one copy in the host's namespace (docs/design.md, "One copy per process").
 */
#define FORWARD_NAMES "_nvrtc_names.h"
#define FORWARD_MISSING 11 /* NVRTC_ERROR_INTERNAL_ERROR */
#include "_forward.h"
