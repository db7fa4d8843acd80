/*
 * A library that the whole process has one copy of, as each interpreter sees it: a
 * plain shared library with the real library's soname and every one of its entry
 * points (docs/design.md, "One copy per process").  Included by one small .c file per
 * library, which defines:
 *
 *   FORWARD_NAMES    the header that lists its entry points, one NAME(...) a line;
 *   FORWARD_MISSING  what an entry point answers until it is forwarded, or when the
 *                    real library lacks it (an error status of that library's API).
 *
 * Every name is exported as a trampoline, one indirect jump through its slot, so any
 * signature passes through untouched.  Loaded into an interpreter's namespace, it is
 * found there by its soname (by the dependencies that need it, by dlopen), and whoever
 * loaded it calls multipy_forward_to() once, with a handle of the real library in the
 * host's namespace, before anything else calls it.
 *
 * x86-64 only (the trampolines are x86-64 assembly); setup.py builds it nowhere else.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>

/* What a slot holds until the real function is found: answers every call. */
static int missing(void)
{
    return FORWARD_MISSING;
}

/* One slot per name, hidden so that the trampolines reach them PC-relative. */
#define NAME(name) __attribute__((visibility("hidden"))) void *slot_##name = (void *)missing;
#include FORWARD_NAMES
#undef NAME

/* The exported entry points: `name: jmp *slot_name(%rip)`. */
#define NAME(name)                                      \
    __asm__(".text\n"                                   \
            ".globl " #name "\n"                        \
            ".type " #name ", @function\n"              \
            #name ":\n"                                 \
            "\tjmp *slot_" #name "(%rip)\n"             \
            ".size " #name ", . - " #name "\n");
#include FORWARD_NAMES
#undef NAME

static const struct {
    const char *name;
    void **slot;
} entries[] = {
#define NAME(name) {#name, &slot_##name},
#include FORWARD_NAMES
#undef NAME
};

/*
 * Points every name at the real library's function of that name (`real` is a handle
 * that dlopen or dlmopen gave for it; a name it lacks keeps answering FORWARD_MISSING).
 * Returns how many names it found.  Call it before any other name is called: the slots
 * are written without synchronisation.
 */
int multipy_forward_to(void *real)
{
    int found = 0;
    for (size_t i = 0; i < sizeof entries / sizeof entries[0]; i++) {
        void *function = dlsym(real, entries[i].name);
        if (function) {
            *entries[i].slot = function;
            found++;
        }
    }
    return found;
}
