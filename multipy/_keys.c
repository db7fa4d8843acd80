/*
 * The pthread keys of one interpreter's namespace (docs/design.md, "pthread keys").
 *
 * This library is the root object of every namespace: the host dlmopens it, and it
 * brings in libc and the running CPython's libpython as its dependencies (the second
 * added by the host, multipy/_root.py, into the slot below).  Being first in the
 * namespace's search order, its pthread_key_create, pthread_getspecific and the rest
 * are the ones that every library loaded into the namespace binds to, not libc's.
 *
 * Why: a thread has one table of key values (1,024 slots in its descriptor), which the
 * libc of every namespace reads and writes, while each libc keeps its own list of the
 * slots it handed out.  Left to their libcs, two namespaces hand out the same slot.
 * Here, a namespace's keys live in a table of its own per thread, and its libc's list
 * is kept full, so that its libc can hand out no slot at all.  The namespace uses one
 * real slot, which the host took from its libc for it (so no one else has it): its
 * value on a thread is that thread's table, and its destructor, which this namespace's
 * libc runs when a thread it started exits, runs the destructors of the namespace's
 * keys.  A host thread's exit runs them through multipy_keys_thread_exit instead
 * (_bootstrap.c, multipy_forget).
 *
 * Keys are numbered from FIRST_KEY, above every real slot: one that reaches a libc's
 * own functions is refused there (EINVAL, or NULL), never taken for another's.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <threads.h>
#include <unistd.h>

#define KEYS 1024      /* a namespace's keys: as many as glibc gives a whole process */
#define FIRST_KEY 1024 /* glibc's PTHREAD_KEYS_MAX: no real slot has this number */
#define BLOCK 32       /* a thread's values come in blocks of this many keys */
#define ROUNDS 4       /* PTHREAD_DESTRUCTOR_ITERATIONS */

/* Where the host writes the path of the running CPython's libpython, which its copy of
 * this library then needs (multipy/_root.py finds the slot by these first bytes, and
 * names it in a spare entry of the dynamic section): built without libpython, so that
 * one build serves every installation of its CPython version. */
__attribute__((used)) const char multipy_libpython_slot[4096] = "multipy: libpython's path goes here";

struct key {
    _Atomic uintptr_t seq; /* odd: in use; each create and delete adds one */
    void (*_Atomic destructor)(void *);
};

struct value {
    uintptr_t seq; /* the key's seq when the value was set: stale once it changes */
    void *data;
};

struct table {
    struct value *blocks[KEYS / BLOCK];
    struct value first[BLOCK]; /* blocks[0] */
};

static struct key keys[KEYS];
static atomic_int in_use;
static int ordinal = -1;
static pthread_key_t real_key;
static int (*libc_setspecific)(pthread_key_t, const void *);
static __thread struct table *mine;

/* Says, once, which library found the namespace's keys all taken (EAGAIN follows). */
static void report_shortage(void *caller)
{
    static atomic_int said;
    if (atomic_exchange(&said, 1))
        return;
    Dl_info info;
    const char *library = dladdr(caller, &info) && info.dli_fname ? info.dli_fname : "a library";
    dprintf(STDERR_FILENO,
            "multipy: interpreter #%d has no pthread key left: all %d of its keys are in use, "
            "and %s, which it was loading or running, asked for another "
            "(pthread_key_create fails with EAGAIN)\n",
            ordinal, KEYS, library);
}

static int create_key(pthread_key_t *key, void (*destructor)(void *), void *caller)
{
    for (int i = 0; i < KEYS; i++) {
        uintptr_t seq = atomic_load(&keys[i].seq);
        if (!(seq & 1) && seq + 2 > seq
            && atomic_compare_exchange_strong(&keys[i].seq, &seq, seq + 1)) {
            atomic_store(&keys[i].destructor, destructor);
            atomic_fetch_add(&in_use, 1);
            *key = FIRST_KEY + (pthread_key_t)i;
            return 0;
        }
    }
    report_shortage(caller);
    return EAGAIN;
}

int pthread_key_create(pthread_key_t *key, void (*destructor)(void *))
{
    return create_key(key, destructor, __builtin_return_address(0));
}

int pthread_key_delete(pthread_key_t key)
{
    unsigned i = key - FIRST_KEY;
    if (i >= KEYS)
        return EINVAL;
    uintptr_t seq = atomic_load(&keys[i].seq);
    if (!(seq & 1) || !atomic_compare_exchange_strong(&keys[i].seq, &seq, seq + 1))
        return EINVAL;
    atomic_fetch_sub(&in_use, 1);
    return 0;
}

void *pthread_getspecific(pthread_key_t key)
{
    unsigned i = key - FIRST_KEY;
    struct table *table = mine;
    if (i >= KEYS || !table)
        return NULL;
    struct value *block = table->blocks[i / BLOCK];
    if (!block)
        return NULL;
    struct value *value = &block[i % BLOCK];
    if (value->seq != atomic_load_explicit(&keys[i].seq, memory_order_relaxed))
        return NULL;
    return value->data;
}

/* This thread's table, made on first use; NULL out of memory. */
static struct table *own_table(void)
{
    if (mine)
        return mine;
    if (!libc_setspecific) /* before multipy_keys_start */
        return NULL;
    struct table *table = calloc(1, sizeof *table);
    if (!table)
        return NULL;
    table->blocks[0] = table->first;
    if (libc_setspecific(real_key, table) != 0) {
        free(table);
        return NULL;
    }
    return mine = table;
}

int pthread_setspecific(pthread_key_t key, const void *data)
{
    unsigned i = key - FIRST_KEY;
    if (i >= KEYS)
        return EINVAL;
    uintptr_t seq = atomic_load_explicit(&keys[i].seq, memory_order_relaxed);
    if (!(seq & 1))
        return EINVAL;
    if (!data && !mine)
        return 0;
    struct table *table = own_table();
    if (!table)
        return ENOMEM;
    struct value *block = table->blocks[i / BLOCK];
    if (!block) {
        if (!data)
            return 0;
        if (!(block = table->blocks[i / BLOCK] = calloc(BLOCK, sizeof *block)))
            return ENOMEM;
    }
    block[i % BLOCK].seq = seq;
    block[i % BLOCK].data = (void *)data;
    return 0;
}

/* The names that old binaries and C11 code call the same functions by. */
int __pthread_key_create(pthread_key_t *key, void (*destructor)(void *))
{
    return create_key(key, destructor, __builtin_return_address(0));
}

void *__pthread_getspecific(pthread_key_t key)
{
    return pthread_getspecific(key);
}

int __pthread_setspecific(pthread_key_t key, const void *data)
{
    return pthread_setspecific(key, data);
}

int tss_create(tss_t *key, tss_dtor_t destructor)
{
    return create_key(key, destructor, __builtin_return_address(0)) == 0 ? thrd_success
                                                                         : thrd_error;
}

void tss_delete(tss_t key)
{
    pthread_key_delete(key);
}

void *tss_get(tss_t key)
{
    return pthread_getspecific(key);
}

int tss_set(tss_t key, void *data)
{
    int failed = pthread_setspecific(key, data);
    return !failed ? thrd_success : failed == ENOMEM ? thrd_nomem : thrd_error;
}

/* Runs the destructors of this thread's values, as glibc does (up to ROUNDS rounds while
 * destructors set new values), then frees its table. */
static void finish_thread(void *unused)
{
    (void)unused;
    struct table *table = mine;
    if (!table)
        return;
    for (int round = 0; round < ROUNDS; round++) {
        int ran = 0;
        for (unsigned b = 0; b < KEYS / BLOCK; b++) {
            struct value *block = table->blocks[b];
            for (unsigned j = 0; block && j < BLOCK; j++) {
                void *data = block[j].data;
                if (!data)
                    continue;
                block[j].data = NULL;
                struct key *key = &keys[b * BLOCK + j];
                void (*destructor)(void *) = atomic_load(&key->destructor);
                if (destructor && block[j].seq == atomic_load(&key->seq)) {
                    destructor(data);
                    ran = 1;
                }
            }
        }
        if (!ran)
            break;
    }
    mine = NULL;
    libc_setspecific(real_key, NULL);
    for (unsigned b = 1; b < KEYS / BLOCK; b++)
        free(table->blocks[b]);
    free(table);
}

/* -- what the host calls -- */

/*
 * Before anything else runs in the namespace: fills its libc's list of keys, but for
 * `real`, the slot the host took for it, which it takes with finish_thread as its
 * destructor.  0, or -1 with the reason in error.
 */
int multipy_keys_start(int interpreter, unsigned real, char *error, size_t size)
{
    int (*create)(pthread_key_t *, void (*)(void *)) = dlsym(RTLD_NEXT, "pthread_key_create");
    int (*delete)(pthread_key_t) = dlsym(RTLD_NEXT, "pthread_key_delete");
    libc_setspecific = dlsym(RTLD_NEXT, "pthread_setspecific");
    if (!create || !delete || !libc_setspecific) {
        snprintf(error, size, "this namespace's libc has no pthread_key_create");
        return -1;
    }
    ordinal = interpreter;
    pthread_key_t key;
    int taken = 0;
    while (create(&key, NULL) == 0)
        taken++;
    if (taken != KEYS) {
        snprintf(error, size, "this namespace's libc had handed out %d pthread keys before "
                 "multipy took its list", KEYS - taken);
        return -1;
    }
    if (delete(real) != 0 || create(&key, finish_thread) != 0 || key != real) {
        snprintf(error, size, "this namespace's libc would not give pthread key %u back", real);
        return -1;
    }
    real_key = real;
    return 0;
}

/* A host thread is exiting (multipy_forget): its values' destructors run now. */
void multipy_keys_thread_exit(void)
{
    finish_thread(NULL);
}

/* How many of the namespace's KEYS keys are in use. */
int multipy_keys_in_use(void)
{
    return atomic_load(&in_use);
}
