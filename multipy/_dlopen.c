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
 *   library, whose dependencies (searched breadth first by dlsym) include the
 *   interpreter's own libpython: the program as the interpreter sees it.
 * - A library the host keeps one copy of for every interpreter (docs/design.md, "One
 *   copy per process"; the host names them with multipy_forward_library).  Opened by
 *   its path, as torch opens cuBLASLt, it is loaded once into the host's namespace, and
 *   the caller gets multipy's forwarder of the same soname, pointed at that copy.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

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

/* The libraries forwarded to the host's copy: the real file (a resolved path), and
 * multipy's forwarder for it.  Written before any code runs in the namespace. */
static struct {
    char *real;
    char *forwarder;
} forwarded[8];
static size_t forwarded_count;

/* From the host, before any code runs in the namespace: a dlopen of `real` (by a path
 * that resolves to it) gets `forwarder` instead.  0, or -1 when the table is full. */
int multipy_forward_library(const char *real, const char *forwarder)
{
    if (forwarded_count == sizeof forwarded / sizeof forwarded[0])
        return -1;
    if (!(forwarded[forwarded_count].real = strdup(real))
        || !(forwarded[forwarded_count].forwarder = strdup(forwarder)))
        return -1;
    forwarded_count++;
    return 0;
}

/* dlopen(file, mode) of a forwarded library: the host's copy (loaded now if it was
 * not) and this namespace's forwarder pointed at it.  NULL, for libc to open `file` as
 * usual, when `file` is no forwarded library or any of that fails. */
__attribute__((visibility("hidden"))) void *multipy_dlopen_forwarded(const char *file, int mode)
{
    const char *name = strrchr(file, '/');
    if (!name || !forwarded_count)
        return NULL;
    char resolved[PATH_MAX];
    for (size_t i = 0; i < forwarded_count; i++) {
        if (strcmp(name, strrchr(forwarded[i].real, '/')) != 0 || !realpath(file, resolved)
            || strcmp(resolved, forwarded[i].real) != 0)
            continue;
        mode &= ~RTLD_GLOBAL;
        if (mode & RTLD_NOLOAD)
            return multipy_libc_dlopen(forwarded[i].forwarder, mode);
        void *host = dlmopen(LM_ID_BASE, forwarded[i].real, RTLD_NOW | RTLD_LOCAL);
        if (!host)
            return NULL;
        void *forwarder = multipy_libc_dlopen(forwarded[i].forwarder, mode);
        int (*forward_to)(void *) = forwarder ? (int (*)(void *))dlsym(forwarder, "multipy_forward_to") : NULL;
        if (!forward_to) {
            if (forwarder)
                dlclose(forwarder);
            dlclose(host);
            return NULL;
        }
        forward_to(host);
        return forwarder;
    }
    return NULL;
}

__attribute__((naked)) void *dlopen(const char *file, int mode)
{
    (void)file, (void)mode;
    __asm__("testq %rdi, %rdi\n\t"
            "jz multipy_dlopen_root\n\t"
            "pushq %rdi\n\t" /* kept across the call; the stack stays 16-byte aligned */
            "pushq %rsi\n\t"
            "subq $8, %rsp\n\t"
            "call multipy_dlopen_forwarded\n\t"
            "addq $8, %rsp\n\t"
            "popq %rsi\n\t"
            "popq %rdi\n\t"
            "testq %rax, %rax\n\t"
            "jnz 1f\n\t"
            "andl $-257, %esi\n\t" /* mode &= ~RTLD_GLOBAL (0x100) */
            "jmp *multipy_libc_dlopen(%rip)\n"
            "1:\tret\n\t");
}

#endif
