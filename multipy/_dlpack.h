/*
 * Tensors lent across the boundary by DLPack (docs/design.md, "memory").
 *
 * The owner exports a tensor with its own torch's to_dlpack and keeps the capsule under
 * a token; the receiver reads the owner's DLManagedTensor by address and gives its own
 * torch a copy of it whose deleter only queues the token (no lock a call holds, no
 * GIL: torch may free a tensor on any thread).  The queue goes back to the owner with
 * the next call, and the owner drops its capsule under its own GIL.  Included by the
 * host's C and by the C inside each interpreter: each has its own copy of this code.
 */
#ifndef MULTIPY_DLPACK_H
#define MULTIPY_DLPACK_H

#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The DLPack ABI (dlpack.h): v0.8's "dltensor" capsule, which every torch reads and
 * which owners export; and v1.0's "dltensor_versioned", whose flags let numpy (2.1 and
 * later) make a writable array, where it makes a read-only one from a "dltensor". */
typedef struct {
    int32_t device_type; /* kDLCPU = 1 */
    int32_t device_id;
} DLDevice;
typedef struct {
    uint8_t code, bits;
    uint16_t lanes;
} DLDataType;
typedef struct {
    void *data;
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t *shape, *strides;
    uint64_t byte_offset;
} DLTensor;
typedef struct DLManagedTensor {
    DLTensor dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensor *self);
} DLManagedTensor;

typedef struct {
    uint32_t major, minor;
} DLPackVersion;
typedef struct DLManagedTensorVersioned {
    DLPackVersion version;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensorVersioned *self);
    uint64_t flags; /* 0: writable, not a copy */
    DLTensor dl_tensor;
} DLManagedTensorVersioned;

#define MULTIPY_DL_CPU 1
#define MULTIPY_DL_CUDA 2

/* Tokens whose aliases died, waiting for the next call to carry them to their owner. */
struct release_queue {
    pthread_mutex_t lock;
    uint64_t *tokens;
    size_t count, capacity;
};
#define RELEASE_QUEUE_INIT {PTHREAD_MUTEX_INITIALIZER, NULL, 0, 0}

static void queue_push(struct release_queue *queue, uint64_t token)
{
    pthread_mutex_lock(&queue->lock);
    if (queue->count == queue->capacity) {
        size_t capacity = queue->capacity ? 2 * queue->capacity : 64;
        uint64_t *grown = realloc(queue->tokens, capacity * sizeof *grown);
        if (!grown) { /* the owner keeps the tensor: a leak, never a dangling alias */
            pthread_mutex_unlock(&queue->lock);
            return;
        }
        queue->tokens = grown;
        queue->capacity = capacity;
    }
    queue->tokens[queue->count++] = token;
    pthread_mutex_unlock(&queue->lock);
}

/* Moves the queued tokens to out (room for `room`); how many it moved. */
static size_t queue_take(struct release_queue *queue, uint64_t *out, size_t room)
{
    pthread_mutex_lock(&queue->lock);
    size_t taken = queue->count < room ? queue->count : room;
    queue->count -= taken;
    memcpy(out, queue->tokens + queue->count, taken * sizeof *out);
    pthread_mutex_unlock(&queue->lock);
    return taken;
}

static size_t queue_length(struct release_queue *queue)
{
    pthread_mutex_lock(&queue->lock);
    size_t count = queue->count;
    pthread_mutex_unlock(&queue->lock);
    return count;
}

/* The receiver's copy of the owner's DLManagedTensor, in one of the two forms. */
struct alias {
    DLManagedTensor managed;
    DLManagedTensorVersioned versioned;
    uint64_t token;
    struct release_queue *queue;
};

static void release_alias(struct alias *alias)
{
    queue_push(alias->queue, alias->token);
    free(alias);
}

static void alias_deleter(DLManagedTensor *managed)
{
    release_alias(managed->manager_ctx);
}

static void versioned_alias_deleter(DLManagedTensorVersioned *versioned)
{
    release_alias(versioned->manager_ctx);
}

static void alias_capsule_destructor(PyObject *capsule)
{
    /* Still named as made: no torch or numpy took it, so the token goes back from here.
     * Runs while an exception may be propagating: it must neither raise nor clear one. */
    if (PyCapsule_IsValid(capsule, "dltensor"))
        release_alias(((DLManagedTensor *)PyCapsule_GetPointer(capsule, "dltensor"))->manager_ctx);
    else if (PyCapsule_IsValid(capsule, "dltensor_versioned"))
        release_alias(((DLManagedTensorVersioned *)PyCapsule_GetPointer(
            capsule, "dltensor_versioned"))->manager_ctx);
}

/* lent_address(capsule) -> int: the DLManagedTensor of a "dltensor" capsule that this
 * side's torch or numpy made, or 0 when its memory is neither host memory nor a CUDA
 * device's (which the process's one CUDA context shares with every interpreter). */
static PyObject *lent_address(PyObject *module, PyObject *capsule)
{
    (void)module;
    DLManagedTensor *managed = PyCapsule_GetPointer(capsule, "dltensor");
    if (!managed)
        return NULL;
    int32_t device = managed->dl_tensor.device.device_type;
    if (device != MULTIPY_DL_CPU && device != MULTIPY_DL_CUDA)
        return PyLong_FromLong(0);
    return PyLong_FromVoidPtr(managed);
}

#define LENT_ADDRESS_METHOD                                                              \
    {"lent_address", lent_address, METH_O,                                               \
     "lent_address(capsule) -> int: the DLManagedTensor in a dltensor capsule, 0 if its " \
     "memory is neither host nor CUDA device memory."}

/* The capsule for this side's torch.from_dlpack (or numpy's, versioned) of the owner's
 * tensor or array whose DLManagedTensor is at owner, whose token goes to `queue` once
 * this side is done with it (or once the capsule is dropped unused).  NULL with an
 * exception: then nothing is queued, and the owner takes the token back. */
static PyObject *capsule_of(DLManagedTensor *owner, uint64_t token, int versioned,
                            struct release_queue *queue)
{
    if (!owner) {
        PyErr_SetString(PyExc_ValueError, "no tensor at address 0");
        return NULL;
    }
    /* malloc, each field set here: a zeroed block would come from calloc, which glibc
     * serves without its per-thread cache, at several times the cost */
    struct alias *alias = malloc(sizeof *alias);
    if (!alias)
        return PyErr_NoMemory();
    alias->token = token;
    alias->queue = queue;
    PyObject *capsule;
    if (versioned) { /* shape and strides: the owner's, kept until the token goes back */
        alias->versioned = (DLManagedTensorVersioned){
            .version = {1, 0}, .manager_ctx = alias, .deleter = versioned_alias_deleter,
            .flags = 0, .dl_tensor = owner->dl_tensor};
        capsule = PyCapsule_New(&alias->versioned, "dltensor_versioned", alias_capsule_destructor);
    } else {
        alias->managed = (DLManagedTensor){
            .dl_tensor = owner->dl_tensor, .manager_ctx = alias, .deleter = alias_deleter};
        capsule = PyCapsule_New(&alias->managed, "dltensor", alias_capsule_destructor);
    }
    if (!capsule)
        free(alias); /* the token was never queued: the owner takes it back */
    return capsule;
}

/* The capsule of alias_capsule(address, token, source, versioned=False) (_lend.h):
 * capsule_of, its arguments Python objects. */
static PyObject *make_alias_capsule(PyObject *const *args, Py_ssize_t nargs,
                                    struct release_queue *queue)
{
    if (nargs < 2) {
        PyErr_SetString(PyExc_TypeError, "alias_capsule(address, token, ...)");
        return NULL;
    }
    int versioned = nargs >= 4 ? PyObject_IsTrue(args[3]) : 0;
    if (versioned < 0)
        return NULL;
    DLManagedTensor *owner = PyLong_AsVoidPtr(args[0]);
    uint64_t token = PyLong_AsUnsignedLongLong(args[1]);
    if (PyErr_Occurred())
        return NULL;
    return capsule_of(owner, token, versioned, queue);
}

#endif
