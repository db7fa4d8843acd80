/*
 * The CUDA driver as each interpreter sees it: a plain shared library whose soname is
 * libcuda.so.1, which the host loads into an interpreter's namespace before any Python
 * runs there (docs/design.md, "CUDA").  A CUDA runtime in that namespace (torch's
 * cudart, ctypes.CDLL("libcuda.so.1")) then finds this library by its soname instead of
 * loading a second driver, which would fail: there is one driver per process.
 *
 * Every name in _cuda_names.h is exported as a trampoline, one indirect jump through
 * its slot, so any signature passes through untouched.  The constructor fills the
 * slots once, from the real driver in the host's namespace; a name that driver lacks
 * keeps its first value, a function that answers CUDA_ERROR_NOT_FOUND.
 *
 * x86-64 only (the trampolines are x86-64 assembly); setup.py builds it nowhere else.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <link.h>

#define CUDA_ERROR_NOT_FOUND 500

/* What a slot holds until the driver's own function is found: answers every call. */
static int not_found(void)
{
    return CUDA_ERROR_NOT_FOUND;
}

/* One slot per name, hidden so that the trampolines reach them PC-relative. */
#define NAME(name) __attribute__((visibility("hidden"))) void *slot_##name = (void *)not_found;
#include "_cuda_names.h"
#undef NAME

/* The exported entry points: `name: jmp *slot_name(%rip)`. */
#define NAME(name)                                      \
    __asm__(".text\n"                                   \
            ".globl " #name "\n"                        \
            ".type " #name ", @function\n"              \
            #name ":\n"                                 \
            "\tjmp *slot_" #name "(%rip)\n"             \
            ".size " #name ", . - " #name "\n");
#include "_cuda_names.h"
#undef NAME

static const struct {
    const char *name;
    void **slot;
} entries[] = {
#define NAME(name) {#name, &slot_##name},
#include "_cuda_names.h"
#undef NAME
};

/*
 * Resolves every name once in the real driver, loaded in the host's namespace (the
 * host has loaded it already, so this finds that copy).  Loaded in the host's namespace
 * itself, the search for libcuda.so.1 could find this very library: then it forwards
 * nothing, and every name answers CUDA_ERROR_NOT_FOUND.
 */
__attribute__((constructor)) static void forward(void)
{
    Dl_info info;
    struct link_map *self;
    Lmid_t namespace;
    if (!dladdr1((void *)forward, &info, (void **)&self, RTLD_DL_LINKMAP)
        || dlinfo(self, RTLD_DI_LMID, &namespace) != 0 || namespace == LM_ID_BASE)
        return;
    void *driver = dlmopen(LM_ID_BASE, "libcuda.so.1", RTLD_NOW);
    if (!driver)
        return;
    for (size_t i = 0; i < sizeof entries / sizeof entries[0]; i++) {
        void *function = dlsym(driver, entries[i].name);
        if (function)
            *entries[i].slot = function;
    }
}
