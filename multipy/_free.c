/*
 * free for every library in an interpreter's namespace, its libc's own calls included
 * (glibc calls its malloc functions through its GOT, so that they can be replaced).
 * Linked into the namespace's root object (_keys.c's library), so that it comes before
 * libc's in the namespace's search order (docs/design.md, "Stacks from another libc").
 *
 * Why: the stacks of threads that have ended wait in one cache for the whole process,
 * the dynamic linker's, whichever libc started them, and every libc's pthread_create
 * takes one from there when it can: the interpreter's libc reuses the stack of a host
 * thread, or of a thread of its own.  Before it does, it frees the old thread's blocks of
 * dynamic TLS (get_cached_stack, inlined into pthread_create) with its own free.  But
 * the dynamic linker allocated those blocks with the host's malloc (the one it finds in
 * the main namespace, as every thread's TLS is the dynamic linker's): a chunk of the
 * host's heap went into the namespace's heap, which then handed it out, marked its
 * neighbours free, or took it back while the host's malloc worked on them, without the
 * host's lock.  The process crashed now and then, in either malloc or in any code
 * whose memory it was.
 *
 * So a free called from this libc's pthread_create goes to the host's free; every
 * other free to libc's, as before.  Told apart by the return address: in glibc 2.36,
 * pthread_create calls free there and nowhere else, and the functions it calls do not
 * end in a jump to free (pthread_attr_destroy, which frees a copy of the default
 * attributes, calls it), so no other free returns into pthread_create.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <link.h>
#include <stddef.h>
#include <stdint.h>

void __libc_free(void *); /* this namespace's libc's free, which glibc exports as such */

/* Where this namespace's libc's pthread_create lies, and the host's free; written
 * before the namespace has started a thread (multipy_free_start). */
static uintptr_t create_start, create_size;
static void (*host_free)(void *);

void free(void *pointer)
{
    if ((uintptr_t)__builtin_return_address(0) - create_start < create_size)
        host_free(pointer); /* a dynamic TLS block of a reused stack */
    else
        __libc_free(pointer);
}

/* The host's free (the main program's, which the dynamic linker allocates TLS with);
 * before the namespace starts a thread.  If libc's pthread_create cannot be found with
 * its size, frees stay libc's. */
void multipy_free_start(void (*host)(void *))
{
    void *create = dlsym(RTLD_NEXT, "pthread_create");
    Dl_info info;
    const ElfW(Sym) *found = NULL;
    if (!create || !dladdr1(create, &info, (void **)&found, RTLD_DL_SYMENT) || !found)
        return;
    host_free = host;
    create_start = (uintptr_t)create;
    create_size = found->st_size;
}
