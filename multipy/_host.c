/*
 * multipy._host: the C that the host needs (docs/design.md, "The call path").
 *
 * - Entry.call enters an interpreter on the calling thread: it hands the request to the
 *   namespace's multipy_enter with the host's GIL released for the whole call, copies
 *   the reply, and drops the host objects the interpreter gave back.
 * - take_key takes a pthread key of the process for an interpreter's namespace, which
 *   keeps its own keys over that one (docs/design.md, "pthread keys").
 * - A thread that entered interpreters drops its state (and key values) in each when it
 *   exits.
 * - The fatal-signal report (and its crash cell) and the exit guard.
 * - What glibc reports of static TLS, for the room estimate (multipy/_glibc.py).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "_dlpack.h"
#include "_entry.h"
#include "_lend.h"
#include "_occupancy.h"
#include "_plain.h"

/* -- threads that enter interpreters -- */

#define RECORDS 1024
static struct multipy_record records[RECORDS];

static struct {
    void *runtime;
    multipy_forget_fn *forget;
    pthread_key_t key; /* the process's key that the interpreter's namespace keeps its own over */
} interpreters[MULTIPY_MAX_INTERPRETERS];

static pthread_key_t exiting; /* its destructor runs when a thread that entered exits */
static pthread_once_t exiting_made = PTHREAD_ONCE_INIT;
static int exiting_failed;

static __thread unsigned entered; /* bit k: this thread has state in interpreter k */
static __thread struct multipy_record *line;

static void thread_exit(void *unused)
{
    (void)unused;
    for (int k = 0; k < MULTIPY_MAX_INTERPRETERS; k++)
        if (entered & (1u << k))
            interpreters[k].forget(interpreters[k].runtime);
    entered = 0;
    if (line) {
        line->interpreter = -1;
        line->tid = 0; /* free for another thread */
        line = NULL;
    }
}

/* Before this thread first enters interpreter k: the memory that holds the value of k's
 * key on this thread is allocated here, by the host's libc, which frees it when the
 * thread exits (it must come from the heap that frees it, not from k's libc).  Sets
 * *record to the thread's line in the crash report (NULL if all are taken); -1 out of
 * memory, when the thread must not enter. */
static int prepare(int k, struct multipy_record **record)
{
    if (!(entered & (1u << k))) {
        if (pthread_setspecific(interpreters[k].key, (void *)1) != 0
            || pthread_setspecific(exiting, (void *)1) != 0)
            return -1;
        entered |= 1u << k;
    }
    if (!line) {
        int tid = (int)syscall(SYS_gettid);
        for (int i = 0; i < RECORDS && !line; i++) {
            int free_slot = 0;
            if (atomic_compare_exchange_strong((_Atomic int *)&records[i].tid, &free_slot, tid))
                line = &records[i];
        }
    }
    *record = line;
    return 0;
}

static void make_exiting(void)
{
    exiting_failed = pthread_key_create(&exiting, thread_exit);
}

static PyObject *take_key(PyObject *module, PyObject *unused)
{
    (void)module, (void)unused;
    pthread_once(&exiting_made, make_exiting);
    pthread_key_t key;
    int failed = exiting_failed ? exiting_failed : pthread_key_create(&key, NULL);
    if (failed == EAGAIN)
        return PyErr_Format(PyExc_RuntimeError,
                            "the process has no pthread key left (glibc gives a process %d, "
                            "and the host's libraries hold them all)", PTHREAD_KEYS_MAX);
    if (failed)
        return PyErr_Format(PyExc_RuntimeError, "pthread_key_create failed: %s", strerror(failed));
    return PyLong_FromUnsignedLong(key);
}

/* -- Entry: one interpreter's entry points -- */

typedef struct {
    PyObject_HEAD
    int ordinal;
    int closed;
    void *runtime;
    multipy_enter_fn *enter;
    multipy_leave_fn *leave;
    multipy_cancel_fn *cancel;
    PyObject *releases; /* list: handles and tokens the host dropped, sent with the next call */
    PyObject *exports;  /* dict: token -> host object lent to interpreters */
    PyObject *lent_tokens; /* lent_tokens(payload, status) -> the tokens a reply lends */
} Entry;

/* Per interpreter: tokens of its tensors that host aliases no longer use (_dlpack.h). */
static struct release_queue queues[MULTIPY_MAX_INTERPRETERS] = {
    [0 ... MULTIPY_MAX_INTERPRETERS - 1] = RELEASE_QUEUE_INIT};

static struct release_queue *alias_queue(long source)
{
    return source >= 0 && source < MULTIPY_MAX_INTERPRETERS ? &queues[source] : NULL;
}

static _Atomic uint64_t serials;       /* numbers calls, process-wide */
static unsigned long main_thread;      /* the host's main thread */
static struct {                        /* the call the main thread runs; under the host GIL */
    Entry *entry;
    uint64_t serial;
} main_call;

static int Entry_init(Entry *self, PyObject *args, PyObject *kwargs)
{
    unsigned long long runtime, enter, leave, cancel, forget;
    unsigned int key;
    static char *names[] = {"ordinal", "runtime", "enter", "leave", "cancel", "forget", "key",
                            "releases", "exports", "lent_tokens", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "iKKKKKIO!O!O", names, &self->ordinal,
                                     &runtime, &enter, &leave, &cancel, &forget, &key, &PyList_Type,
                                     &self->releases, &PyDict_Type, &self->exports,
                                     &self->lent_tokens))
        return -1;
    Py_INCREF(self->releases);
    Py_INCREF(self->exports);
    Py_INCREF(self->lent_tokens);
    if (self->ordinal < 0 || self->ordinal >= MULTIPY_MAX_INTERPRETERS) {
        PyErr_SetString(PyExc_ValueError, "no such interpreter");
        return -1;
    }
    self->runtime = (void *)(uintptr_t)runtime;
    self->enter = (multipy_enter_fn *)(uintptr_t)enter;
    self->leave = (multipy_leave_fn *)(uintptr_t)leave;
    self->cancel = (multipy_cancel_fn *)(uintptr_t)cancel;
    interpreters[self->ordinal].runtime = self->runtime;
    interpreters[self->ordinal].forget = (multipy_forget_fn *)(uintptr_t)forget;
    interpreters[self->ordinal].key = key;
    return 0;
}

/* Drops the host objects the interpreter gave back from exports (token -> object). */
static void drop_released(PyObject *exports, const uint64_t *tokens, size_t count)
{
    for (size_t i = 0; i < count; i++) {
        PyObject *token = PyLong_FromUnsignedLongLong(tokens[i]);
        if (!token || PyDict_DelItem(exports, token) < 0)
            PyErr_Clear(); /* already gone */
        Py_XDECREF(token);
    }
}

static PyObject *unread_name; /* "unread", interned */
static PyObject *lent_of(struct loan *loan);

/* The handle or token number goes back to the interpreter with the next call.  Keeps
 * the exception being raised, if any. */
static void release_later(Entry *self, uint64_t number)
{
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyObject *item = PyLong_FromUnsignedLongLong(number);
    if (item)
        PyList_Append(self->releases, item); /* if it fails: a leak, not a dangling alias */
    Py_XDECREF(item);
    PyErr_Restore(type, value, traceback);
}

/* A reply that will not be read (its caller was interrupted): what it made or lent in
 * the interpreter goes back with the next call, and the request's Lent (lent, or made
 * from loan; none if neither) takes back with unread(status, payload) what the
 * interpreter did not alias.  Keeps the exception being raised. */
static void give_back(Entry *self, int status, uint64_t handle, PyObject *payload,
                      PyObject *lent, struct loan *loan)
{
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    if (status != MULTIPY_OK && status != MULTIPY_LENT && status != MULTIPY_TENSOR) {
        PyObject *owner = lent ? Py_NewRef(lent) : loan ? lent_of(loan) : NULL;
        PyObject *number = owner ? PyLong_FromLong(status) : NULL;
        PyObject *done = number ? PyObject_CallMethodObjArgs(owner, unread_name, number,
                                                             payload, NULL)
                                : NULL;
        Py_XDECREF(owner);
        Py_XDECREF(number);
        Py_XDECREF(done);
        PyErr_Clear();
    } else if (handle) {
        release_later(self, handle);
    } else if (PyBytes_GET_SIZE(payload)) {
        PyObject *tokens = PyObject_CallFunction(self->lent_tokens, "Oi", payload, status);
        Py_ssize_t end = PyList_GET_SIZE(self->releases);
        if (!tokens || !PyList_Check(tokens)
            || PyList_SetSlice(self->releases, end, end, tokens) < 0)
            PyErr_Clear();
        Py_XDECREF(tokens);
    }
    PyErr_Restore(type, value, traceback);
}

/* (status, handle, payload), stealing payload (Py_BuildValue parses a format each call). */
static PyObject *reply_tuple(int status, uint64_t handle, PyObject *payload)
{
    PyObject *reply = PyTuple_New(3);
    PyObject *number = PyLong_FromUnsignedLongLong(handle);
    if (!reply || !number) {
        Py_XDECREF(reply);
        Py_XDECREF(number);
        Py_DECREF(payload);
        return NULL;
    }
    PyTuple_SET_ITEM(reply, 0, PyLong_FromLong(status)); /* a small int: never fails */
    PyTuple_SET_ITEM(reply, 1, number);
    PyTuple_SET_ITEM(reply, 2, payload);
    return reply;
}

/* *out = value as a uint64; -1 with an exception set if it is not one. */
static int read_number(PyObject *value, uint64_t *out)
{
    *out = PyLong_AsUnsignedLongLong(value);
    return *out == (uint64_t)-1 && PyErr_Occurred() ? -1 : 0;
}

/* Keeps the storage of tensor, lent by lend_torch_at without it, beside its capsule under
 * token in objects, if the token is still lent there: 0, or -1 with an exception. */
static int keep_storage(PyObject *tensor, PyObject *objects, PyObject *token)
{
    PyObject *capsule = PyDict_GetItemWithError(objects, token);
    if (!capsule)
        return PyErr_Occurred() ? -1 : 0; /* given back already */
    Py_INCREF(capsule);
    PyObject *storage = PyObject_CallOneArg(torch_api.untyped_storage, tensor);
    PyObject *kept = storage ? PyTuple_Pack(2, capsule, storage) : NULL;
    int kept_now = kept ? PyDict_SetItem(objects, token, kept) : -1;
    Py_DECREF(capsule);
    Py_XDECREF(storage);
    Py_XDECREF(kept);
    return kept_now;
}

/* After a CALL_TENSOR, whatever its outcome, before any Python code of the host's runs
 * again: the storage of input, lent without it, kept beside it unless the interpreter
 * gave its token back (among released, count of them), when an alias there outlived
 * the call, so that set_() on input cannot free what that alias reads.  Keeps an
 * exception raised before; 0, or -1 if this failed and none had been. */
static int keep_input_storage(PyObject *input, const struct multipy_request *request,
                              struct loan *loan, const uint64_t *released, size_t count)
{
    struct multipy_lent_tensor body;
    memcpy(&body, request->body, sizeof body);
    for (size_t i = 0; released && i < count; i++)
        if (released[i] == body.token)
            return 0; /* given back: nothing aliases it now */
    if (!PyList_GET_SIZE(loan->tokens))
        return 0; /* taken back */
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    int kept = keep_storage(input, loan->objects, PyList_GET_ITEM(loan->tokens, 0));
    if (!type)
        return kept;
    PyErr_Clear();
    PyErr_Restore(type, value, traceback);
    return 0;
}

/* Runs request in the interpreter on this thread, without the host's GIL: the reply
 * (status, handle, payload), or, with tensor, None for a TENSOR reply whose record is
 * then in *tensor (once this side has torch); NULL with an exception.  See Entry.call,
 * whose lent this is (NULL for none), or loan, what the request lent without a Lent
 * (NULL for none); input, a CALL_TENSOR's tensor lent into loan without its storage
 * (keep_input_storage), else NULL. */
static PyObject *enter(Entry *self, struct multipy_request *request, PyObject *lent,
                       struct loan *loan, struct multipy_lent_tensor *tensor, PyObject *input)
{
    if (self->closed)
        return Py_BuildValue("(iKy)", MULTIPY_CLOSED, 0ULL, "");
    if (!request->serial)
        request->serial = ++serials;
    int on_main = (unsigned long)pthread_self() == main_thread;
    struct multipy_record *record;
    PyObject *releases = self->releases;
    Py_ssize_t listed = PyList_GET_SIZE(releases);
    struct release_queue *queue = &queues[self->ordinal];
    size_t n = (size_t)listed + queue_length(queue);
    uint64_t few[64], *numbers = n <= 64 ? few : PyMem_RawMalloc(n * sizeof *numbers);
    if (!numbers || prepare(self->ordinal, &record) < 0) { /* not sent: nothing stays lent */
        if (numbers && numbers != few)
            PyMem_RawFree(numbers);
        PyErr_NoMemory();
        if (loan)
            take_back(NULL, loan);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < listed; i++)
        numbers[i] = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(releases, i));
    if (listed) {
        PyErr_Clear(); /* a number that is not one is skipped inside */
        if (PyList_SetSlice(releases, 0, listed, NULL) < 0)
            PyErr_Clear();
    }
    n = (size_t)listed + queue_take(queue, numbers + listed, n - (size_t)listed);
    request->releases = numbers;
    request->n_releases = n;

    if (record) {
        record->op = record->target = NULL;
        record->interpreter = self->ordinal;
    }
    struct multipy_reply reply;
    int entered;
    if (on_main) {
        main_call.entry = self;
        main_call.serial = request->serial;
    }
    Py_BEGIN_ALLOW_THREADS
    entered = self->enter(self->runtime, request, record, &reply);
    Py_END_ALLOW_THREADS
    if (on_main)
        main_call.entry = NULL;
    if (record)
        record->interpreter = -1;
    if (numbers != few)
        PyMem_RawFree(numbers);
    if (entered < 0)
        return Py_BuildValue("(iKy)", MULTIPY_CLOSED, 0ULL, "");
    /* Copy what the reply holds, then let the interpreter reuse its buffer: dropping
     * host objects may run Python code that enters the interpreter again. */
    int tensor_reply = tensor && reply.status == MULTIPY_TENSOR && reply.size == sizeof *tensor
                       && torch_api.from_dlpack;
    if (tensor_reply)
        memcpy(tensor, reply.data, sizeof *tensor);
    PyObject *payload = tensor_reply ? NULL
                                     : PyBytes_FromStringAndSize(reply.data,
                                                                 (Py_ssize_t)reply.size);
    size_t count = reply.n_released;
    uint64_t *tokens = count <= 64 ? few : PyMem_RawMalloc(count * sizeof *tokens);
    if (tokens)
        memcpy(tokens, reply.released, count * sizeof *tokens);
    self->leave(self->runtime);
    int kept = input ? keep_input_storage(input, request, loan, tokens, count) : 0;
    if (tokens) {
        drop_released(self->exports, tokens, count);
        if (tokens != few)
            PyMem_RawFree(tokens);
    }
    if (!payload && !tensor_reply)
        return NULL;
    /* Ctrl-C, or no storage kept: nobody will read this reply */
    if (kept < 0 || (on_main && PyErr_CheckSignals() < 0)) {
        if (tensor_reply)
            release_later(self, tensor->token);
        else
            give_back(self, reply.status, reply.handle, payload, lent, loan);
        Py_XDECREF(payload);
        return NULL;
    }
    return tensor_reply ? Py_NewRef(Py_None) : reply_tuple(reply.status, reply.handle, payload);
}

PyDoc_STRVAR(Entry_call_doc,
"call(op: int, handle: int, epoch: int, body: bytes, serial: int = 0, lent=None)\n"
"-> (status, handle, payload)\n\n"
"Runs a request (multipy._protocol) in the interpreter on this thread, without the host's\n"
"GIL (serial 0: a new number).  Takes every number out of the releases list and sends\n"
"them along; removes from the exports dict the tokens the interpreter gave back.  On the\n"
"main thread, interrupt_main() cancels the call; if Ctrl-C then raises before the reply\n"
"is returned, lent.unread(status, payload) runs for a reply that did not run the request\n"
"(lent: the multipy._sharing.Lent of what the request lent).");

static PyObject *Entry_call(Entry *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 4 || nargs > 6 || !PyBytes_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "call(op: int, handle: int, epoch: int, body: bytes, "
                                         "serial: int = 0, lent=None)");
        return NULL;
    }
    struct multipy_request request = {
        .body = PyBytes_AS_STRING(args[3]),
        .size = (size_t)PyBytes_GET_SIZE(args[3]),
    };
    long op = PyLong_AsLong(args[0]);
    if ((op == -1 && PyErr_Occurred()) || read_number(args[1], &request.handle) < 0
        || read_number(args[2], &request.epoch) < 0
        || (nargs >= 5 && read_number(args[4], &request.serial) < 0))
        return NULL;
    if (op < 0 || op > INT_MAX) {
        PyErr_SetString(PyExc_ValueError, "no such operation");
        return NULL;
    }
    request.op = (int)op;
    return enter(self, &request, nargs == 6 && args[5] != Py_None ? args[5] : NULL, NULL, NULL,
                 NULL);
}

/* -- the common call of a value, in C (docs/design.md, "The call path") -- */

/* What it lends and aliases with, given once by multipy.session (use_call_path): the
 * host's exports (a multipy._sharing.Exports), its objects and counter, the Lent type
 * (made only for the Python that reads unusual replies), and _sharing's alias for what
 * is not a torch tensor.  lent_type is NULL until then. */
static PyObject *no_keywords; /* {}, for calls without keyword arguments: never changed */

static struct {
    PyObject *lent_type, *exports, *objects, *counter, *alias;
    PyObject *call_value_op;                        /* CALL_VALUE, as an int */
    PyObject *request, *finish, *give_back, *tokens; /* names, interned */
} call_path;

static PyObject *use_call_path(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "use_call_path(Lent, exports, alias)");
        return NULL;
    }
    if (call_path.lent_type) /* once: other threads may be calling the functions kept */
        Py_RETURN_NONE;
    if (!(call_path.objects = PyObject_GetAttrString(args[1], "objects"))
        || !(call_path.counter = PyObject_GetAttrString(args[1], "counter"))
        || !(call_path.call_value_op = PyLong_FromLong(MULTIPY_CALL_VALUE))
        || !(call_path.request = PyUnicode_InternFromString("request"))
        || !(call_path.finish = PyUnicode_InternFromString("_finish"))
        || !(call_path.give_back = PyUnicode_InternFromString("_give_back"))
        || !(call_path.tokens = PyUnicode_InternFromString("tokens")))
        return NULL;
    call_path.exports = Py_NewRef(args[1]);
    call_path.alias = Py_NewRef(args[2]);
    call_path.lent_type = Py_NewRef(args[0]); /* last: the others are ready */
    Py_RETURN_NONE;
}

/* A multipy._sharing.Lent of what loan lent (NULL with an exception). */
static PyObject *lent_of(struct loan *loan)
{
    PyObject *lent = PyObject_CallOneArg(call_path.lent_type, call_path.exports);
    if (lent && PyObject_SetAttr(lent, call_path.tokens, loan->tokens) < 0)
        Py_CLEAR(lent);
    return lent;
}

/* The body of a CALL_VALUE of method with values and kwargs as Interpreter._encode
 * makes it: plain (*op stays CALL_VALUE), or, with no keyword arguments, the torch
 * tensors among scalars in values lent into loan (*op CALL_LENT; open, the caller
 * closes it).  None, nothing lent, when Interpreter.request must make it (a pickle,
 * numpy arrays, CUDA tensors); NULL with an exception, nothing lent. */
static PyObject *encode_call(PyObject *method, PyObject *values, PyObject *kwargs,
                             struct loan *loan, int *op)
{
    PyObject *message = PyTuple_Pack(3, method, values, kwargs);
    PyObject *body = message ? plain(NULL, message) : NULL;
    Py_XDECREF(message);
    if (body != Py_None || !PyDict_CheckExact(kwargs) || PyDict_GET_SIZE(kwargs))
        return body;
    Py_DECREF(body);
    if (!(loan->tokens = PyList_New(0)))
        return NULL;
    loan->objects = Py_NewRef(call_path.objects);
    loan->counter = Py_NewRef(call_path.counter);
    PyObject *flat = lend_values(values, loan, NULL, NULL);
    if (!flat || flat == Py_None) { /* it took back what it lent */
        loan_close(loan);
        return flat;
    }
    message = PyTuple_Pack(4, method, PyTuple_GET_ITEM(flat, 0), PyTuple_GET_ITEM(flat, 1),
                           kwargs);
    Py_DECREF(flat);
    body = message ? plain(NULL, message) : NULL;
    Py_XDECREF(message);
    if (!body || body == Py_None) { /* a tuple or long text met twice: pickle keeps it so */
        if (take_back(NULL, loan) < 0)
            Py_CLEAR(body);
        loan_close(loan);
        return body;
    }
    *op = MULTIPY_CALL_LENT;
    return body;
}

/* The body of a CALL_TENSOR (multipy._protocol) into *body: the call of target alone
 * with one CPU torch tensor, lent into loan (opened here; the caller closes it), its
 * record's token and address.  1 if so; 0, nothing lent, for any other call or a tensor
 * not lent; -1 with an exception, nothing lent. */
static int encode_tensor_call(PyObject *method, PyObject *values, PyObject *kwargs,
                              struct loan *loan, struct multipy_lent_tensor *body)
{
    if (method != Py_None || !torch_api.tensor || !PyTuple_CheckExact(values)
        || PyTuple_GET_SIZE(values) != 1
        || (PyObject *)Py_TYPE(PyTuple_GET_ITEM(values, 0)) != torch_api.tensor
        || !PyDict_CheckExact(kwargs) || PyDict_GET_SIZE(kwargs))
        return 0;
    if (!(loan->tokens = PyList_New(0)))
        return -1;
    loan->objects = Py_NewRef(call_path.objects);
    loan->counter = Py_NewRef(call_path.counter);
    /* without its storage: call_value keeps it if an alias outlives the call */
    int lending = lend_torch_at(PyTuple_GET_ITEM(values, 0), loan, 0, &body->token,
                                &body->address);
    if (lending < 0)
        take_back(NULL, loan);
    if (lending <= 0)
        loan_close(loan);
    return lending;
}

/* The value of a LENT reply's message (values, positions, single), as
 * Interpreter._finish reads it: the aliases of what the interpreter lent in their
 * places; if they cannot all be made, interpreter._give_back(payload, status, aliased). */
static PyObject *alias_reply(Entry *self, PyObject *interpreter, PyObject *message,
                             PyObject *reply)
{
    PyObject *aliased = PyList_New(0), *source = PyLong_FromLong(self->ordinal), *values = NULL;
    if (aliased && source) {
        PyObject *alias_args[5] = {PyTuple_GET_ITEM(message, 0), PyTuple_GET_ITEM(message, 1),
                                   source, aliased, call_path.alias};
        values = alias_flat(NULL, alias_args, 5);
        if (!values) { /* Ctrl-C, say: what was not aliased goes back */
            PyObject *type, *value, *traceback;
            PyErr_Fetch(&type, &value, &traceback);
            PyObject *done = PyObject_CallMethodObjArgs(
                interpreter, call_path.give_back, PyTuple_GET_ITEM(reply, 2),
                PyTuple_GET_ITEM(reply, 0), aliased, NULL);
            if (done) {
                Py_DECREF(done);
                PyErr_Restore(type, value, traceback);
            } else { /* as in Python, the exception giving back raised replaces it */
                Py_XDECREF(type);
                Py_XDECREF(value);
                Py_XDECREF(traceback);
            }
        }
    }
    Py_XDECREF(aliased);
    Py_XDECREF(source);
    if (!values)
        return NULL;
    int single = PyObject_IsTrue(PyTuple_GET_ITEM(message, 2));
    PyObject *value = single < 0 ? NULL : single ? PySequence_GetItem(values, 0)
                                                 : PyList_AsTuple(values);
    Py_DECREF(values);
    return value;
}

/* The value of a CALL_VALUE's reply as Interpreter._finish gives it: read here when it
 * is plain or lent, else by interpreter._finish(reply, the Lent of what loan lent, or
 * None). */
static PyObject *read_reply(Entry *self, PyObject *interpreter, PyObject *reply,
                            struct loan *loan)
{
    long status = PyLong_AsLong(PyTuple_GET_ITEM(reply, 0));
    PyObject *payload = PyTuple_GET_ITEM(reply, 2);
    const char *data = PyBytes_AS_STRING(payload);
    Py_ssize_t size = PyBytes_GET_SIZE(payload);
    int plain_value = size && (unsigned char)data[0] != MULTIPY_PICKLED;
    if (status == MULTIPY_OK && plain_value && !PyObject_IsTrue(PyTuple_GET_ITEM(reply, 1)))
        return PyMarshal_ReadObjectFromString(data, size);
    if (status == MULTIPY_LENT && plain_value) {
        PyObject *message = PyMarshal_ReadObjectFromString(data, size);
        if (message && PyTuple_CheckExact(message) && PyTuple_GET_SIZE(message) == 3
            && PyTuple_CheckExact(PyTuple_GET_ITEM(message, 0))
            && PyTuple_CheckExact(PyTuple_GET_ITEM(message, 1))) {
            PyObject *value = alias_reply(self, interpreter, message, reply);
            Py_DECREF(message);
            return value;
        }
        Py_XDECREF(message); /* _finish reads it again, and says what is wrong */
        PyErr_Clear();
    }
    PyObject *lent = loan->tokens ? lent_of(loan) : Py_NewRef(Py_None);
    PyObject *value = lent ? PyObject_CallMethodObjArgs(interpreter, call_path.finish, reply,
                                                        lent, NULL)
                           : NULL;
    Py_XDECREF(lent);
    return value;
}

PyDoc_STRVAR(Entry_call_value_doc,
"call_value(interpreter, target, handle: int, epoch: int, method, args, kwargs) -> value\n\n"
"interpreter.request(CALL_VALUE, target, method, args, kwargs) (multipy.session), made\n"
"here (target's handle, interpreter's epoch) when its arguments are plain, or scalars and\n"
"CPU torch tensors with no keyword arguments, and its reply read here when it is plain or\n"
"lent.  The rest by the same methods of interpreter as request's: request itself for any\n"
"other arguments (nothing lent here), _finish for any other reply, _give_back for a lent\n"
"one not aliased whole.  Only after use_call_path; on this thread, without\n"
"multipy.timeout.");

/* Entry.call_value with its numbers read: see its docstring. */
static PyObject *call_value(Entry *self, PyObject *interpreter, PyObject *target,
                            uint64_t handle, uint64_t epoch, PyObject *method, PyObject *values,
                            PyObject *kwargs)
{
    struct multipy_request request = {.op = MULTIPY_CALL_TENSOR, .handle = handle,
                                      .epoch = epoch};
    struct loan loan = {NULL, NULL, NULL}; /* what the request lends, if it does */
    struct multipy_lent_tensor in, out = {0, 0}; /* a CALL_TENSOR's body, a TENSOR reply's */
    PyObject *body = NULL;
    int tensor = encode_tensor_call(method, values, kwargs, &loan, &in);
    if (tensor < 0)
        return NULL;
    if (tensor) {
        request.body = (const char *)&in;
        request.size = sizeof in;
    } else {
        request.op = MULTIPY_CALL_VALUE;
        if (!(body = encode_call(method, values, kwargs, &loan, &request.op)))
            return NULL;
        if (body == Py_None) { /* (a dict of its own: Replicas' empty one stays empty) */
            Py_DECREF(body);
            PyObject *given = kwargs == no_keywords ? PyDict_New() : Py_NewRef(kwargs);
            PyObject *value = given ? PyObject_CallMethodObjArgs(interpreter, call_path.request,
                                                                 call_path.call_value_op, target,
                                                                 method, values, given, NULL)
                                    : NULL;
            Py_XDECREF(given);
            return value;
        }
        request.body = PyBytes_AS_STRING(body);
        request.size = (size_t)PyBytes_GET_SIZE(body);
    }
    PyObject *reply = enter(self, &request, NULL, loan.tokens ? &loan : NULL, &out,
                            tensor ? PyTuple_GET_ITEM(values, 0) : NULL);
    Py_XDECREF(body);
    PyObject *value = reply == Py_None
                      ? alias_lent_at(out.token, out.address, &queues[self->ordinal], NULL)
                      : reply ? read_reply(self, interpreter, reply, &loan) : NULL;
    Py_XDECREF(reply);
    loan_close(&loan);
    return value;
}

static PyObject *Entry_call_value(Entry *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 7 || !call_path.lent_type) {
        PyErr_SetString(PyExc_TypeError, "call_value(interpreter, target, handle, epoch, "
                                         "method, args, kwargs), after use_call_path");
        return NULL;
    }
    uint64_t handle, epoch;
    if (read_number(args[2], &handle) < 0 || read_number(args[3], &epoch) < 0)
        return NULL;
    return call_value(self, args[0], args[1], handle, epoch, args[4], args[5], args[6]);
}

/* Cancels call serial of thread in entry's interpreter, without the host's GIL (it waits
 * for the interpreter's); True if the call was running. */
static PyObject *cancel_call(Entry *entry, unsigned long thread, uint64_t serial, int kind)
{
    int found = 0;
    struct multipy_record *record;
    Py_BEGIN_ALLOW_THREADS
    if (prepare(entry->ordinal, &record) == 0)
        found = entry->cancel(entry->runtime, thread, serial, kind);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(found);
}

PyDoc_STRVAR(Entry_cancel_doc,
"cancel(thread: int, serial: int, kind: int) -> bool\n\n"
"Raises an exception (kind: 0 the interpreter's CallCancelled, 1 KeyboardInterrupt) in\n"
"call serial if thread still runs it; waits for the interpreter's GIL, not for the call.");

static PyObject *Entry_cancel(Entry *self, PyObject *args)
{
    unsigned long thread;
    unsigned long long serial;
    int kind;
    if (!PyArg_ParseTuple(args, "kKi", &thread, &serial, &kind))
        return NULL;
    return cancel_call(self, thread, serial, kind);
}

static void Entry_dealloc(Entry *self)
{
    Py_XDECREF(self->releases);
    Py_XDECREF(self->exports);
    Py_XDECREF(self->lent_tokens);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Entry_close(Entry *self, PyObject *unused)
{
    (void)unused;
    self->closed = 1;
    Py_RETURN_NONE;
}

static PyMethodDef Entry_methods[] = {
    {"close", (PyCFunction)Entry_close, METH_NOARGS,
     "From now on call() answers CLOSED without entering (a forked child's interpreters)."},
    {"call", (PyCFunction)(void (*)(void))Entry_call, METH_FASTCALL, Entry_call_doc},
    {"call_value", (PyCFunction)(void (*)(void))Entry_call_value, METH_FASTCALL,
     Entry_call_value_doc},
    {"cancel", (PyCFunction)Entry_cancel, METH_VARARGS, Entry_cancel_doc},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject EntryType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "multipy._host.Entry",
    .tp_basicsize = sizeof(Entry),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Entry(ordinal, runtime, enter, leave, cancel, forget, key, releases, exports, "
              "lent_tokens): the entry points of one interpreter (addresses inside its "
              "namespace), its namespace's key (take_key), its list of releases to send "
              "and the host's dict of lent objects.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Entry_init,
    .tp_dealloc = (destructor)Entry_dealloc,
    .tp_methods = Entry_methods,
};

/* -- what each thread keeps: its multipy.timeout and its last picks -- */

static __thread double thread_timeout = -1;                  /* seconds; negative: none */
static __thread int thread_cursors[MULTIPY_MAX_INTERPRETERS]; /* by a Cursor's slot */

static PyObject *ThreadSettings_get_timeout(PyObject *self, void *unused)
{
    (void)self, (void)unused;
    return thread_timeout < 0 ? Py_NewRef(Py_None) : PyFloat_FromDouble(thread_timeout);
}

static int ThreadSettings_set_timeout(PyObject *self, PyObject *value, void *unused)
{
    (void)self, (void)unused;
    if (!value) {
        PyErr_SetString(PyExc_AttributeError, "timeout cannot be deleted: set it to None");
        return -1;
    }
    double seconds = value == Py_None ? -1 : PyFloat_AsDouble(value);
    if (seconds == -1 && PyErr_Occurred())
        return -1;
    if (value != Py_None && !(seconds >= 0)) { /* NaN too */
        PyErr_Format(PyExc_ValueError, "timeout must be None or at least 0 seconds, not %R",
                     value);
        return -1;
    }
    thread_timeout = seconds;
    return 0;
}

static PyGetSetDef ThreadSettings_getset[] = {
    {"timeout", ThreadSettings_get_timeout, ThreadSettings_set_timeout,
     "The calling thread's multipy.timeout in seconds (a float), or None.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject ThreadSettingsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "multipy._host.ThreadSettings",
    .tp_basicsize = sizeof(PyObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "ThreadSettings(): the calling thread's settings, kept in C where a replicated "
              "object's call reads them (every instance reads the same ones).",
    .tp_new = PyType_GenericNew,
    .tp_getset = ThreadSettings_getset,
};

/* A manager's cursor: each thread's last pick among its interpreters, kept in C under
 * the manager's slot (the ordinal of its first interpreter, which no other open manager
 * holds; a closed one's pick left there is a starting point like any other). */
typedef struct {
    PyObject_HEAD
    int slot;
} Cursor;

static int Cursor_init(Cursor *self, PyObject *args, PyObject *kwargs)
{
    if (kwargs || !PyArg_ParseTuple(args, "i:Cursor", &self->slot))
        return -1;
    if (self->slot < 0 || self->slot >= MULTIPY_MAX_INTERPRETERS) {
        PyErr_SetString(PyExc_ValueError, "no such interpreter");
        return -1;
    }
    return 0;
}

static PyObject *Cursor_get(Cursor *self, void *unused)
{
    (void)unused;
    return PyLong_FromLong(thread_cursors[self->slot]);
}

static int Cursor_set(Cursor *self, PyObject *value, void *unused)
{
    (void)unused;
    if (!value) {
        PyErr_SetString(PyExc_AttributeError, "a cursor cannot be deleted");
        return -1;
    }
    long index = PyLong_AsLong(value);
    if (index == -1 && PyErr_Occurred())
        return -1;
    if (index < 0 || index >= MULTIPY_MAX_INTERPRETERS) {
        PyErr_SetString(PyExc_ValueError, "a cursor is the index of one of the manager's "
                                          "interpreters");
        return -1;
    }
    thread_cursors[self->slot] = (int)index;
    return 0;
}

static PyGetSetDef Cursor_getset[] = {
    {"cursor", (getter)Cursor_get, (setter)Cursor_set,
     "The calling thread's last pick: an index among the manager's interpreters.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject CursorType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "multipy._host.Cursor",
    .tp_basicsize = sizeof(Cursor),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Cursor(slot): each thread's last pick among a manager's interpreters, kept "
              "in C where a replicated object's call reads it.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Cursor_init,
    .tp_getset = Cursor_getset,
};

/* -- a replicated object's call, in C (docs/design.md, "The common call in C") -- */

/* One interpreter's copy of a replicated object: target, an Obj, made there; NULL
 * before it is made (or after it is dropped). */
struct copy {
    PyObject *interpreter, *target;
    Occupancy *occupancy;
    Entry *entry;
    uint64_t handle, epoch;
};

/* The base of multipy.ReplicatedObj: its copies, by the interpreter's index in the
 * manager, and its call. */
typedef struct {
    PyObject_HEAD
    int slot;          /* its manager's Cursor's: each thread's last pick there */
    Py_ssize_t count;  /* its interpreters; 0: every call by _call */
    struct copy copies[MULTIPY_MAX_INTERPRETERS];
} Replicas;

static struct {
    PyObject *call, *thread, *index, *occupancy, *entry, *epoch, *handle; /* "_call", ... */
} replica_names;

static void copy_clear(struct copy *copy)
{
    Py_CLEAR(copy->interpreter);
    Py_CLEAR(copy->target);
    Py_CLEAR(copy->occupancy);
    Py_CLEAR(copy->entry);
}

static int Replicas_init(Replicas *self, PyObject *args, PyObject *kwargs)
{
    PyObject *manager;
    if (kwargs || !PyArg_ParseTuple(args, "O:Replicas", &manager))
        return -1;
    PyObject *cursor = PyObject_GetAttr(manager, replica_names.thread);
    Py_ssize_t count = cursor ? PyObject_Size(manager) : -1;
    if (count < 0 && (PyErr_ExceptionMatches(PyExc_AttributeError)
                      || PyErr_ExceptionMatches(PyExc_TypeError))) {
        PyErr_Clear(); /* not a manager's (a test's stand-in): every call by _call */
        count = 0;
    }
    int slot = cursor && Py_IS_TYPE(cursor, &CursorType) ? ((Cursor *)cursor)->slot : -1;
    Py_XDECREF(cursor);
    if (count > MULTIPY_MAX_INTERPRETERS)
        PyErr_SetString(PyExc_ValueError, "more interpreters than a process holds");
    if (count < 0 || count > MULTIPY_MAX_INTERPRETERS)
        return -1;
    for (Py_ssize_t i = 0; i < MULTIPY_MAX_INTERPRETERS; i++)
        copy_clear(&self->copies[i]);
    self->slot = slot;
    self->count = slot < 0 ? 0 : count; /* a cursor of Python's: every call by _call */
    return 0;
}

static int Replicas_traverse(Replicas *self, visitproc visit, void *arg)
{
    for (int i = 0; i < MULTIPY_MAX_INTERPRETERS; i++) {
        Py_VISIT(self->copies[i].interpreter);
        Py_VISIT(self->copies[i].target);
        Py_VISIT(self->copies[i].occupancy);
        Py_VISIT(self->copies[i].entry);
    }
    return 0;
}

static int Replicas_clear(Replicas *self)
{
    self->count = 0; /* a call after this takes the Python path */
    for (int i = 0; i < MULTIPY_MAX_INTERPRETERS; i++)
        copy_clear(&self->copies[i]);
    return 0;
}

static void Replicas_dealloc(Replicas *self)
{
    PyObject_GC_UnTrack(self);
    Replicas_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The copy's parts read from interpreter (its occupancy, entry and epoch) and target
 * (its handle) into copy: 0, or -1 with an exception. */
static int copy_read(struct copy *copy, PyObject *interpreter, PyObject *target)
{
    PyObject *occupancy = PyObject_GetAttr(interpreter, replica_names.occupancy);
    PyObject *entry = occupancy ? PyObject_GetAttr(interpreter, replica_names.entry) : NULL;
    PyObject *epoch = entry ? PyObject_GetAttr(interpreter, replica_names.epoch) : NULL;
    PyObject *handle = epoch ? PyObject_GetAttr(target, replica_names.handle) : NULL;
    int read = -1;
    if (handle && (!PyObject_TypeCheck(occupancy, &OccupancyType)
                   || !PyObject_TypeCheck(entry, &EntryType)))
        PyErr_SetString(PyExc_TypeError, "the C call path needs the C Occupancy and Entry");
    else if (handle && read_number(epoch, &copy->epoch) == 0
             && read_number(handle, &copy->handle) == 0) {
        copy->interpreter = Py_NewRef(interpreter);
        copy->target = Py_NewRef(target);
        copy->occupancy = (Occupancy *)Py_NewRef(occupancy);
        copy->entry = (Entry *)Py_NewRef(entry);
        read = 0;
    }
    Py_XDECREF(occupancy);
    Py_XDECREF(entry);
    Py_XDECREF(epoch);
    Py_XDECREF(handle);
    return read;
}

PyDoc_STRVAR(Replicas_note_doc,
"_note(interpreter, target: Obj | None) -> None\n\n"
"The copy made in interpreter (one of the manager's), which the call in C uses from now\n"
"on; None: dropped, the call takes the Python path there.");

static PyObject *Replicas_note(Replicas *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "_note(interpreter, target)");
        return NULL;
    }
    PyObject *number = PyObject_GetAttr(args[0], replica_names.index);
    Py_ssize_t index = number ? PyLong_AsSsize_t(number) : -1;
    Py_XDECREF(number);
    if (index == -1 && PyErr_Occurred())
        return NULL;
    if (!self->count) /* calls take the Python path */
        Py_RETURN_NONE;
    if (index < 0 || index >= self->count) {
        PyErr_SetString(PyExc_ValueError, "not an interpreter of this manager");
        return NULL;
    }
    struct copy copy = {NULL, NULL, NULL, NULL, 0, 0};
    if (args[1] != Py_None && copy_read(&copy, args[0], args[1]) < 0)
        return NULL;
    struct copy old = self->copies[index];
    self->copies[index] = copy;
    copy_clear(&old); /* last: dropping an Obj runs Python code */
    Py_RETURN_NONE;
}

/* The copy on the calling thread's last pick, counted busy, if it is made, idle and
 * may take new users (its occupancy is closed once the manager closes), and the call may
 * take this path (no multipy.timeout on this thread): 1 with *copy (new references), 0
 * for the Python path, -1 with an exception. */
static int take_free_copy(Replicas *self, struct copy *copy)
{
    if (!call_path.lent_type || !self->count || thread_timeout >= 0)
        return 0; /* before use_call_path, no manager's, or timed */
    struct copy *made = &self->copies[thread_cursors[self->slot] % self->count];
    int taken = made->target ? occupancy_take_if_idle(made->occupancy) : 0;
    if (taken > 0) {
        *copy = *made;
        Py_INCREF(copy->interpreter);
        Py_INCREF(copy->target);
        Py_INCREF(copy->occupancy);
        Py_INCREF(copy->entry);
    }
    return taken;
}

/* r(*args, **kwargs): on the calling thread's last pick if its copy is made and the
 * interpreter is free, in C, as ReplicatedObj._call would; else by _call itself. */
static PyObject *Replicas_call(Replicas *self, PyObject *args, PyObject *kwargs)
{
    struct copy copy;
    int taken = kwargs && PyDict_GET_SIZE(kwargs) ? 0 : take_free_copy(self, &copy);
    if (taken > 0) { /* (call_value only reads the keywords: one empty dict serves all) */
        PyObject *value = call_value(copy.entry, copy.interpreter, copy.target, copy.handle,
                                     copy.epoch, Py_None, args, no_keywords);
        copy.occupancy->users--; /* as hand_back() */
        copy_clear(&copy);
        return value;
    }
    PyObject *given = taken < 0 ? NULL : kwargs ? Py_NewRef(kwargs) : PyDict_New();
    PyObject *value = given ? PyObject_CallMethodObjArgs((PyObject *)self, replica_names.call,
                                                         Py_None, args, given, NULL)
                            : NULL;
    Py_XDECREF(given);
    return value;
}

static PyMethodDef Replicas_methods[] = {
    {"_note", (PyCFunction)(void (*)(void))Replicas_note, METH_FASTCALL, Replicas_note_doc},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ReplicasType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "multipy._host.Replicas",
    .tp_basicsize = sizeof(Replicas),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Replicas(manager): the base of multipy.ReplicatedObj, whose call runs in C "
              "when the calling thread's last pick is free and its copy made there (_note), "
              "and by the subclass's _call(None, args, kwargs) otherwise.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Replicas_init,
    .tp_dealloc = (destructor)Replicas_dealloc,
    .tp_traverse = (traverseproc)Replicas_traverse,
    .tp_clear = (inquiry)Replicas_clear,
    .tp_call = (ternaryfunc)Replicas_call,
    .tp_methods = Replicas_methods,
};

/* Readies the type and adds it to module: 0, or -1 with an exception. */
static int add_replicas(PyObject *module)
{
    static const char *names[] = {"_call", "_thread", "index", "occupancy", "_entry",
                                  "_epoch", "_handle"};
    PyObject **slots[] = {&replica_names.call, &replica_names.thread, &replica_names.index,
                          &replica_names.occupancy, &replica_names.entry,
                          &replica_names.epoch, &replica_names.handle};
    for (size_t i = 0; i < sizeof names / sizeof *names; i++)
        if (!(*slots[i] = PyUnicode_InternFromString(names[i])))
            return -1;
    if (!(no_keywords = PyDict_New()) || PyType_Ready(&ReplicasType) < 0
        || PyType_Ready(&ThreadSettingsType) < 0 || PyType_Ready(&CursorType) < 0
        || PyModule_AddObjectRef(module, "ThreadSettings", (PyObject *)&ThreadSettingsType) < 0
        || PyModule_AddObjectRef(module, "Cursor", (PyObject *)&CursorType) < 0)
        return -1;
    return PyModule_AddObjectRef(module, "Replicas", (PyObject *)&ReplicasType);
}

/* -- leaving without library destructors -- */

/* Once armed, the process leaves through _exit with exit()'s status before glibc runs
 * any library destructor: used when an interpreter could not be stopped, because its
 * libraries' destructors would wait for a GIL that a running call holds. */
static void exit_now(int status, void *unused)
{
    (void)unused;
    fflush(NULL);
    _exit(status);
}

static PyObject *skip_destructors_at_exit(PyObject *module, PyObject *unused)
{
    (void)module, (void)unused;
    if (on_exit(exit_now, NULL) != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

/* -- static TLS, as glibc reports it -- */

/* ld.so's own report of the static TLS area's size (GLIBC_PRIVATE, which the sanitizers
 * use too); weak, so that a glibc without it leaves the room unmeasured, not this module
 * unloadable. */
extern void _dl_get_tls_static_info(size_t *size, size_t *align) __attribute__((weak));

static PyObject *static_tls(PyObject *module, PyObject *unused)
{
    (void)module, (void)unused;
    if (!_dl_get_tls_static_info)
        Py_RETURN_NONE;
    size_t size, align;
    _dl_get_tls_static_info(&size, &align);
    return Py_BuildValue("nK", (Py_ssize_t)size,
                         (unsigned long long)(uintptr_t)__builtin_thread_pointer());
}

/* -- the fatal-signal report -- */

static const int fatal_signals[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT};
static struct sigaction previous[sizeof fatal_signals / sizeof *fatal_signals];

static void say(const char *text)
{
    size_t length = 0;
    while (text[length])
        length++;
    ssize_t ignored = write(STDERR_FILENO, text, length);
    (void)ignored;
}

static void say_number(long number)
{
    char digits[24];
    int at = (int)sizeof digits - 1;
    digits[at] = '\0';
    do {
        digits[--at] = (char)('0' + number % 10);
        number /= 10;
    } while (number && at > 0);
    say(digits + at);
}

/* Where a crash of the process's own stores which interpreter it hit (crash_cell): 8 bytes
 * the caller owns, e.g. in a shared mapping that a supervisor reads after the process
 * died; NULL for none. */
static volatile double *volatile crash_cell_address;

/* A crash in one interpreter takes the whole process down (one address space); before
 * it does, this names the interpreter and the call that the crashing thread ran.  A
 * fatal signal that another process sent (kill -SEGV, kill -ABRT) is not the call's
 * doing: it is only said to have come from that process. */
static void report_fatal_signal(int signal_number, siginfo_t *info, void *context)
{
    (void)context;
    /* si_code > 0: the kernel's (a real fault), which returning makes happen again;
     * <= 0: kill, tgkill or sigqueue, sent once: by another process, or by this one
     * (abort(), or a faulthandler in front of this handler passing the signal on) */
    int sent = info && info->si_code <= 0;
    int from_another_process = sent && info->si_pid != getpid();
    if (from_another_process) {
        volatile double *cell = crash_cell_address;
        if (cell) /* no call's doing: -1 says so to whoever reads the cell */
            *cell = -1.0;
        say("\nmultipy: signal ");
        say_number(signal_number);
        say(" sent by process ");
        say_number((long)info->si_pid);
        say("\n");
    } else {
        int tid = (int)syscall(SYS_gettid);
        for (int i = 0; i < RECORDS; i++) {
            if (records[i].tid == tid && records[i].interpreter >= 0) {
                const char *op = records[i].op, *target = records[i].target;
                volatile double *cell = crash_cell_address;
                if (cell) /* first, in case writing to stderr blocks */
                    *cell = (double)(records[i].interpreter + 1);
                say("\nmultipy: fatal signal ");
                say_number(signal_number);
                say(" in interpreter #");
                say_number(records[i].interpreter);
                say(" (thread ");
                say_number(tid);
                say(") while it ran: ");
                say(op ? op : "a request");
                if (op && target) {
                    say(" of ");
                    say(target);
                }
                say("\nmultipy: a crash in any interpreter ends the whole process.\n");
            }
        }
    }
    /* Hand the signal to whoever had it before (faulthandler, or the default action):
     * returning re-runs the faulting instruction; a sent signal would not come again,
     * so it is raised again, as faulthandler does (blocked while this runs, it arrives
     * as this returns, to the handler restored here). */
    for (size_t i = 0; i < sizeof fatal_signals / sizeof *fatal_signals; i++)
        if (fatal_signals[i] == signal_number)
            sigaction(signal_number, &previous[i], NULL);
    if (sent)
        raise(signal_number);
}

static PyObject *crash_cell(PyObject *module, PyObject *address)
{
    (void)module;
    void *pointer = PyLong_AsVoidPtr(address);
    if (!pointer && PyErr_Occurred())
        return NULL;
    crash_cell_address = pointer;
    Py_RETURN_NONE;
}

static PyObject *report_crashes(PyObject *module, PyObject *unused)
{
    (void)module, (void)unused;
    static int installed;
    if (installed) /* twice would make the handler its own "previous": a crash would loop */
        Py_RETURN_NONE;
    installed = 1;
    struct sigaction action = {0};
    action.sa_sigaction = report_fatal_signal;
    action.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&action.sa_mask);
    for (size_t i = 0; i < sizeof fatal_signals / sizeof *fatal_signals; i++)
        if (sigaction(fatal_signals[i], &action, &previous[i]) != 0)
            return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

static PyObject *set_main_thread(PyObject *module, PyObject *ident)
{
    (void)module;
    main_thread = PyLong_AsUnsignedLong(ident);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *next_serial(PyObject *module, PyObject *unused)
{
    (void)module, (void)unused;
    return PyLong_FromUnsignedLongLong(++serials);
}

static PyObject *interrupt_main(PyObject *module, PyObject *unused)
{
    (void)module, (void)unused;
    Entry *entry = main_call.entry;
    if (!entry)
        Py_RETURN_FALSE;
    return cancel_call(entry, main_thread, main_call.serial, MULTIPY_CANCEL_INTERRUPT);
}

static PyMethodDef module_methods[] = {
    LENT_ADDRESS_METHOD,
    PLAIN_METHOD,
    LEND_METHODS,
    {"use_call_path", (PyCFunction)(void (*)(void))use_call_path, METH_FASTCALL,
     "use_call_path(Lent, exports, alias): what Entry.call_value lends and aliases with "
     "(see multipy.session)."},
    {"set_main_thread", set_main_thread, METH_O,
     "set_main_thread(ident): the thread whose calls interrupt_main() cancels."},
    {"next_serial", next_serial, METH_NOARGS, "A new call number."},
    {"interrupt_main", interrupt_main, METH_NOARGS,
     "Raises KeyboardInterrupt in the call the main thread runs, if any; True if it did."},
    {"take_key", take_key, METH_NOARGS,
     "take_key() -> int: a pthread key of the process, held for good, for a new "
     "interpreter's namespace (RuntimeError if the process has none left)."},
    {"skip_destructors_at_exit", skip_destructors_at_exit, METH_NOARGS,
     "Makes the process leave without running library destructors."},
    {"static_tls", static_tls, METH_NOARGS,
     "static_tls() -> (size, thread pointer) or None: the size of every thread's static "
     "TLS area (TCB included, glibc's _dl_get_tls_static_info) and the calling thread's "
     "thread pointer; None where glibc does not say."},
    {"report_crashes", report_crashes, METH_NOARGS,
     "Installs the fatal-signal report that names the interpreter and call."},
    {"crash_cell", crash_cell, METH_O,
     "crash_cell(address: int) -> None: the address of 8 bytes (a double) that the caller "
     "owns, where a fatal signal of the process's own (a fault, or its abort()) stores "
     "the index + 1 of the interpreter whose call the crashing thread ran (nothing when "
     "it ran none), and one that another process sent stores -1.  0 clears it."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "multipy._host", "multipy's C in the host (docs/design.md).", -1,
    module_methods,
};

/* In a forked child: a queue's lock may have been held by a thread that is gone. */
static void reset_queues_in_child(void)
{
    for (int k = 0; k < MULTIPY_MAX_INTERPRETERS; k++)
        pthread_mutex_init(&queues[k].lock, NULL);
}

PyMODINIT_FUNC PyInit__host(void)
{
    if (PyType_Ready(&EntryType) < 0 || pthread_atfork(NULL, NULL, reset_queues_in_child)
        || !(unread_name = PyUnicode_InternFromString("unread")))
        return NULL;
    PyObject *module = PyModule_Create(&module_def);
    if (!module)
        return NULL;
    if (PyModule_AddObjectRef(module, "Entry", (PyObject *)&EntryType) < 0
        || add_occupancy(module) < 0 || add_replicas(module) < 0
        || PyModule_AddIntConstant(module, "MAX_INTERPRETERS", MULTIPY_MAX_INTERPRETERS) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
