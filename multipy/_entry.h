/*
 * What the host's C (_host.c) and the C inside each interpreter's namespace
 * (_bootstrap.c) agree on: how a host thread enters an interpreter.
 * docs/design.md, "The call path", tells the whole story.
 */
#ifndef MULTIPY_ENTRY_H
#define MULTIPY_ENTRY_H

#include <stddef.h>
#include <stdint.h>

#define MULTIPY_MAX_INTERPRETERS 15

/* Statuses of a reply (multipy/_protocol.py has the same numbers). */
enum {
    MULTIPY_OK = 0,     /* payload: the value (marshal, or a pickle: first byte 0x80), or
                           nothing when handle names a new object */
    MULTIPY_ERROR = 1,  /* payload: the remote error record, by marshal */
    MULTIPY_CLOSED = 2, /* the interpreter is stopped: nothing ran */
    MULTIPY_BROKEN = 3, /* multipy's own code inside raised; payload: "type: message" */
    MULTIPY_CANCELLED = 4, /* cancelled before it started: nothing ran */
    MULTIPY_LENT = 5,   /* payload: the value, with the tensors in it lent, by marshal */
    MULTIPY_TENSOR = 6, /* payload: the value, one CPU torch tensor lent: its token and its
                           DLManagedTensor's address (struct multipy_lent_tensor) */
};

/* The payload of a TENSOR reply: the one record of a lent torch tensor (its kind is
 * torch), in this machine's byte order ("=QQ" to Python's struct). */
struct multipy_lent_tensor {
    uint64_t token;
    uint64_t address;
};

/* The operations the C fast paths make and read (multipy/_protocol.py has them all). */
enum { MULTIPY_CALL_VALUE = 2, MULTIPY_CALL_LENT = 7, MULTIPY_CALL_TENSOR = 8 };
#define MULTIPY_PICKLED 0x80 /* a body's first byte when it is a pickle, not a marshal */

/* What a cancel raises in the call (multipy/_protocol.py has the same numbers). */
enum { MULTIPY_CANCEL_TIMEOUT = 0, MULTIPY_CANCEL_INTERRUPT = 1 };

struct multipy_reply {
    int status;
    uint64_t handle;           /* a new object's handle, or 0 */
    const char *data;          /* the payload, valid until multipy_leave */
    size_t size;
    const uint64_t *released;  /* tokens of host objects the interpreter no longer uses
                                  (valid until multipy_leave too) */
    size_t n_released;
};

/* A host thread's line in the fatal-signal report: which interpreter it is in, and
 * what it runs there, as "<op> of <target>" (texts that the interpreter keeps alive,
 * NUL-terminated). */
struct multipy_record {
    volatile int tid;
    volatile int interpreter; /* -1 outside calls */
    const char *volatile op;
    const char *volatile target;
};

/* A request (multipy/_protocol.py): the operation, the handle of its target (0 for
 * none), the epoch of the manager that sends it, and the body holding its arguments:
 * a marshal of them, or a pickle (the first byte is pickle's PROTO opcode, 0x80). */
struct multipy_request {
    int op;
    uint64_t handle;
    uint64_t epoch;
    const char *body;
    size_t size;
    const uint64_t *releases;  /* handles and tokens the host dropped: dropped first */
    size_t n_releases;
    uint64_t serial;           /* numbers the call, for cancelling it */
};

/* Runs one request on the calling thread: 0, and multipy_leave must follow once the
 * reply is copied; or -1 (status MULTIPY_CLOSED), the interpreter is stopped. */
typedef int multipy_enter_fn(void *runtime, const struct multipy_request *request,
                             struct multipy_record *record, struct multipy_reply *reply);
typedef void multipy_leave_fn(void *runtime);
/* Raises an exception in call `serial` if thread `thread` still runs it; 1 if it did. */
typedef int multipy_cancel_fn(void *runtime, unsigned long thread, uint64_t serial, int kind);
/* Drops the calling thread's state and pthread key values in the interpreter, running
 * their destructors: the thread is exiting. */
typedef void multipy_forget_fn(void *runtime);

#endif
