/*
 * dlopen for every library in an interpreter's namespace.  Linked into the namespace's
 * root object (_keys.c's library), so that it comes before libc's in the namespace's
 * search order.  It changes two requests and passes everything else on:
 *
 * - RTLD_GLOBAL (docs/design.md, "RTLD_GLOBAL").  glibc crashes when a library is opened
 *   with it inside a namespace other than the main one (its bug 18684).
 *   multipy._inside strips the flag where Python asks for it (ctypes,
 *   sys.setdlopenflags); libraries written in C ask for it themselves: Debian's torch
 *   links OpenMPI, whose UCX opens its modules with RTLD_GLOBAL from a constructor, so
 *   `import torch` crashed an interpreter.  This dlopen clears the flag and jumps to
 *   libc's: a jump, not a call, so that libc sees its caller's return address and opens
 *   the library as asked by that caller (its namespace, its RUNPATH, $ORIGIN).  A library
 *   opened this way gets its symbols from its own dependencies, not from those loaded
 *   globally before it.
 * - dlopen(NULL), "the program" (docs/design.md, "dlopen(NULL)").  libc answers with the
 *   host's main program, in the main namespace, whose symbols are the host's libpython:
 *   ctypes.pythonapi and LLVM's JIT (numba) called the host's CPython from inside an
 *   interpreter and crashed.  Here it answers with the namespace's root object, this
 *   library, whose dependencies (searched breadth first by dlsym) start with the
 *   interpreter's own libpython: the program as the interpreter sees it.
 */
#define _GNU_SOURCE
#include <dlfcn.h>

#if defined(__x86_64__)

/* libc's dlopen, found once the namespace's libc is loaded (the root's constructor). */
__attribute__((visibility("hidden"))) void *(*multipy_libc_dlopen)(const char *, int);
/* This library's path, under which the namespace knows its root object. */
static const char *root_path;

__attribute__((constructor)) static void find_libc_dlopen(void)
{
    void *found = dlvsym(RTLD_NEXT, "dlopen", "GLIBC_2.34");
    if (!found)
        found = dlsym(RTLD_NEXT, "dlopen");
    multipy_libc_dlopen = (void *(*)(const char *, int))found;
    Dl_info info;
    if (dladdr((void *)find_libc_dlopen, &info))
        root_path = info.dli_fname;
}

/* dlopen(NULL, mode): a new reference to the namespace's root object (this call is
 * made from here, so libc opens it in this namespace). */
__attribute__((visibility("hidden"))) void *multipy_dlopen_root(const char *file, int mode)
{
    (void)file;
    return multipy_libc_dlopen(root_path, (mode & ~RTLD_GLOBAL) | RTLD_NOLOAD);
}

__attribute__((naked)) void *dlopen(const char *file, int mode)
{
    (void)file, (void)mode;
    __asm__("testq %rdi, %rdi\n\t"
            "jz multipy_dlopen_root\n\t"
            "andl $-257, %esi\n\t" /* mode &= ~RTLD_GLOBAL (0x100) */
            "jmp *multipy_libc_dlopen(%rip)\n\t");
}

#endif
