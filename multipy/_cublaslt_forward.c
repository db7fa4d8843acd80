/*
 * cuBLASLt as each interpreter sees it: libcublasLt.so.13, forwarded to one copy in the
 * host's namespace (docs/design.md, "One copy per process").  Its own copy would cost an
 * interpreter about 87 MiB: a 92 MiB data section that its relocations write.
 */
#define FORWARD_NAMES "_cublaslt_names.h"
#define FORWARD_MISSING 15 /* CUBLAS_STATUS_NOT_SUPPORTED */
#include "_forward.h"
