/*
 * nvJitLink, CUDA's linker of device code at run time, as each interpreter sees it:
 * libnvJitLink.so.13, forwarded to one copy in the host's namespace (docs/design.md, "One
 * copy per process").
 */
#define FORWARD_NAMES "_nvjitlink_names.h"
#define FORWARD_MISSING 6 /* NVJITLINK_ERROR_INTERNAL */
#include "_forward.h"
