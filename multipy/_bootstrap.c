/*
 * The C inside each interpreter: a plain shared library that the host loads into the
 * interpreter's link-map namespace right after the namespace's libpython, so that every
 * Py* symbol here is that interpreter's (docs/design.md).
 *
 * - multipy_start starts the interpreter's own thread, which initialises CPython, runs
 *   the entry code, and waits without the GIL until the host stops it; then it
 *   finalises.  (The namespace's pthread keys are _keys.c's, its root object.)
 * - multipy_enter runs one request on the calling host thread: it takes this
 *   interpreter's GIL with the thread's own state here (made on first entry, kept until
 *   the thread exits: multipy_forget), calls the Python handler, and gives the GIL back.
 * - multipy_cancel raises an exception in a call that another thread runs.
 *
 * Both sides' cancellable calls, the host's entries and the interpreter's own
 * (_multipy_bootstrap.call, which the serve front end's worker uses), go through one
 * registry of calls in progress, each named by its thread and serial number: a cancel
 * reaches only the call it names, never runs one that has not started, and one that
 * comes as the call ends is cleared before the thread runs anything else.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <ctype.h>
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "_dlpack.h"
#include "_entry.h"
#include "_lend.h"
#include "_plain.h"

enum { STARTING, SERVING, STOPPING };
#define EARLY_CANCELS 64
#define KEPT_BUFFER (1 << 20) /* a thread's reply buffer is kept between calls up to this */

/* A call in progress, on its thread's stack; the list is guarded by the GIL. */
struct call {
    struct call *next;
    unsigned long thread;
    uint64_t serial;
    int cancelled;
};

struct runtime {
    char *program;     /* the host's sys.executable: the same prefix, venv and site */
    char *code;        /* run in __main__ once initialised; binds `handler` */
    int status_fd;     /* gets "ready", or why the interpreter could not start */
    int stop_fd;       /* the thread waits on it, then finalises */
    pthread_t thread;
    PyObject *handler; /* handler(op, handle, epoch, body) -> (status, handle, payload) */
    /* The handler's tables, where releases are applied in C, before any Python runs:
     * handle -> object, token -> object lent to the host, handle -> crash-report name.
     * Never released: what was lent to the host stays alive through finalisation,
     * since the host may still read it as it exits. */
    PyObject *objects, *lent, *names;
    atomic_int state;
    atomic_int active; /* entries in progress: stopping waits for none */
    struct call *calls;
    /* Cancels that came before their call started (guarded by the GIL). */
    struct {
        unsigned long thread;
        uint64_t serial;
    } early[EARLY_CANCELS];
    unsigned next_early;
    unsigned earlies; /* how many of them are there (a call looks only if any is) */
    /* This namespace's libc sets its <ctype.h> tables per thread when its own
     * pthread_create starts a thread; a host thread gets them at its first entry. */
    const unsigned short *ctype_b;
    const int *ctype_tolower, *ctype_toupper;
};

static __thread PyThreadState *own_state;         /* this thread's state here */
static __thread char *buffer;                     /* the reply, until the host has copied it */
static __thread size_t capacity;
static __thread struct multipy_record *record;    /* this thread's line in the crash report */
static __thread PyObject *thread_torch;           /* the torch settings it was given, or NULL */
static PyObject *cancelled_type;                  /* raised in a call by a timeout */
static struct runtime *runtime_here; /* this namespace's (the library is loaded once in each) */
/* Tokens of host tensors that aliases here no longer use (_dlpack.h). */
static struct release_queue released_tensors = RELEASE_QUEUE_INIT;

static struct release_queue *alias_queue(long source)
{
    return source == 0 ? &released_tensors : NULL; /* only the host lends to an interpreter */
}

/* Whether a cancel for this call came before it started (and forgets it). */
static int cancelled_early(struct runtime *rt, unsigned long thread, uint64_t serial)
{
    for (unsigned i = 0; rt->earlies && i < EARLY_CANCELS; i++)
        if (rt->early[i].serial == serial && rt->early[i].thread == thread) {
            rt->early[i].serial = 0;
            rt->earlies--;
            return 1;
        }
    return 0;
}

/* -- the calls in progress, which a cancel names (under the GIL) -- */

/* Registers call, on the calling thread's stack, under this thread and serial; whether a
 * cancel for it came first (call->cancelled: then it must not run).  end_call undoes it. */
static int begin_call(struct runtime *rt, struct call *call, uint64_t serial)
{
    call->thread = (unsigned long)pthread_self();
    call->serial = serial;
    call->cancelled = cancelled_early(rt, call->thread, serial);
    call->next = rt->calls;
    rt->calls = call;
    return call->cancelled;
}

/* Unregisters call; a cancel that came as it ended is cleared, so that it cannot hit
 * what the thread runs next. */
static void end_call(struct runtime *rt, struct call *call)
{
    for (struct call **at = &rt->calls; *at; at = &(*at)->next)
        if (*at == call) {
            *at = call->next;
            break;
        }
    if (call->cancelled)
        PyThreadState_SetAsyncExc(call->thread, NULL);
}

/* Raises exception in the call that thread runs under serial, at its next bytecode;
 * whether it did.  If it runs none (not started yet, or over), the cancel is remembered:
 * that call, if it starts, does not run. */
static int cancel_call(struct runtime *rt, unsigned long thread, uint64_t serial,
                       PyObject *exception)
{
    int found = 0;
    for (struct call *call = rt->calls; call; call = call->next)
        if (call->thread == thread && call->serial == serial && !call->cancelled) {
            call->cancelled = 1;
            found = PyThreadState_SetAsyncExc(thread, exception) > 0;
        }
    if (!found) {
        if (!rt->early[rt->next_early].serial)
            rt->earlies++;
        rt->early[rt->next_early].thread = thread;
        rt->early[rt->next_early].serial = serial;
        rt->next_early = (rt->next_early + 1) % EARLY_CANCELS;
    }
    return found;
}

/* -- the module that the interpreter's own Python sees as _multipy_bootstrap -- */

static PyObject *note(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 2 || !PyBytes_Check(args[0]) || !PyBytes_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "note() takes two bytes");
        return NULL;
    }
    if (record) { /* the caller keeps both alive */
        record->op = PyBytes_AS_STRING(args[0]);
        record->target = PyBytes_AS_STRING(args[1]);
    }
    Py_RETURN_NONE;
}

int multipy_keys_in_use(void); /* _keys.c */
void multipy_keys_thread_exit(void);

static PyObject *keys_in_use(PyObject *module, PyObject *unused)
{
    (void)module, (void)unused;
    return PyLong_FromLong(multipy_keys_in_use());
}

static PyObject *thread_states(PyObject *module, PyObject *unused)
{
    (void)module, (void)unused;
    long count = 0;
    PyThreadState *state = PyInterpreterState_ThreadHead(PyInterpreterState_Get());
    for (; state; state = PyThreadState_Next(state))
        count++;
    return PyLong_FromLong(count);
}

static PyObject *call(PyObject *module, PyObject *const *args, Py_ssize_t nargsf,
                      PyObject *kwnames)
{
    (void)module;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs < 2) {
        PyErr_SetString(PyExc_TypeError, "call() takes a serial number and a function");
        return NULL;
    }
    uint64_t serial = PyLong_AsUnsignedLongLong(args[0]);
    if (serial == (uint64_t)-1 && PyErr_Occurred())
        return NULL;
    struct call registered;
    PyObject *result = NULL;
    if (begin_call(runtime_here, &registered, serial))
        PyErr_SetNone(cancelled_type);
    else /* the function's arguments as they came: no tuple, no dict */
        result = PyObject_Vectorcall(args[1], args + 2, nargs - 2, kwnames);
    end_call(runtime_here, &registered);
    return result;
}

static PyObject *cancel(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "cancel() takes a thread id and a serial number");
        return NULL;
    }
    unsigned long thread = PyLong_AsUnsignedLong(args[0]);
    if (thread == (unsigned long)-1 && PyErr_Occurred())
        return NULL;
    uint64_t serial = PyLong_AsUnsignedLongLong(args[1]);
    if (serial == (uint64_t)-1 && PyErr_Occurred())
        return NULL;
    return PyBool_FromLong(cancel_call(runtime_here, thread, serial, cancelled_type));
}

static PyObject *get_thread_torch(PyObject *module, PyObject *unused)
{
    (void)module, (void)unused;
    return Py_NewRef(thread_torch ? thread_torch : Py_None);
}

static PyObject *set_thread_torch(PyObject *module, PyObject *settings)
{
    (void)module;
    Py_XSETREF(thread_torch, settings == Py_None ? NULL : Py_NewRef(settings));
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    LENT_ADDRESS_METHOD,
    PLAIN_METHOD,
    LEND_METHODS,
    {"note", (PyCFunction)(void (*)(void))note, METH_FASTCALL,
     "note(op: bytes, target: bytes): what this thread runs now, for the fatal-signal "
     "report; the caller keeps both alive while it runs"},
    {"keys_in_use", keys_in_use, METH_NOARGS,
     "keys_in_use() -> int: how many pthread keys this namespace's libraries hold"},
    {"call", (PyCFunction)(void (*)(void))call, METH_FASTCALL | METH_KEYWORDS,
     "call(serial: int, function, *args, **kwargs) -> function(*args, **kwargs), run as "
     "this thread's call number serial, which cancel names; CallCancelled without running "
     "it if cancelled already.  The serial must be unique: the host's calls take theirs "
     "from 1 up"},
    {"cancel", (PyCFunction)(void (*)(void))cancel, METH_FASTCALL,
     "cancel(thread_id: int, serial: int) -> bool: raises CallCancelled at its next "
     "bytecode in the call that thread runs as number serial (call); False if it runs "
     "none, and then that call does not run if it starts later.  A cancel that comes as "
     "the call ends is cleared there: it never reaches what the thread runs next"},
    {"thread_torch", get_thread_torch, METH_NOARGS,
     "thread_torch() -> the torch settings object this thread was given last "
     "(set_thread_torch), or None: multipy._inside's, kept here for its fast path"},
    {"set_thread_torch", set_thread_torch, METH_O,
     "set_thread_torch(settings): see thread_torch; a host thread's goes when it exits"},
    {"thread_states", thread_states, METH_NOARGS,
     "thread_states() -> int: how many thread states this interpreter has"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_multipy_bootstrap",
    "What multipy's C gives the code inside an interpreter.", -1, methods,
};

static PyObject *init_module(void)
{
    PyObject *module = PyModule_Create(&module_def);
    if (!module)
        return NULL;
    cancelled_type = PyErr_NewExceptionWithDoc(
        "_multipy_bootstrap.CallCancelled",
        "Raised in a call whose caller gave up on it (multipy.timeout).",
        PyExc_BaseException, NULL);
    if (!cancelled_type || PyModule_AddObjectRef(module, "CallCancelled", cancelled_type) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}

/* -- the fast path of the common call (docs/design.md, "The call path") -- */

/* What the fast path reads of the handler's side (multipy._inside.main's fast_path);
 * interpreter is NULL when it is off (MULTIPY_CALL_PATH=python). */
static struct {
    PyObject *interpreter; /* the _Interpreter: its epoch and torch_settings */
    PyObject *attributes;  /* its __dict__, where both are read (neither is a descriptor) */
    PyObject *globals;     /* _sharing's, where cuda_aliases is read */
    PyObject *counter;     /* the tokens of what it lends (its exports' counter) */
    PyObject *sharing;     /* multipy._sharing: cuda_aliases */
    PyObject *value_reply, *failed, *apply_torch_settings, *order_after_call, *alias;
    PyObject *epoch, *torch_settings, *cuda_aliases; /* names, interned */
    PyObject *zero;        /* 0: the host, the source of what a request lends */
} fast;

/* Reads the fast path's parts, (interpreter, its tokens, _sharing), or leaves it off
 * for None; 0, or -1 with an exception. */
static int fast_path_start(PyObject *parts)
{
    if (parts == Py_None)
        return 0;
    if (!PyArg_ParseTuple(parts, "OOO", &fast.interpreter, &fast.counter, &fast.sharing))
        return -1;
    Py_INCREF(fast.counter);
    Py_INCREF(fast.sharing);
    if (!(fast.value_reply = PyObject_GetAttrString(fast.interpreter, "value_reply"))
        || !(fast.failed = PyObject_GetAttrString(fast.interpreter, "failed"))
        || !(fast.apply_torch_settings = PyObject_GetAttrString(fast.interpreter,
                                                                "apply_torch_settings"))
        || !(fast.order_after_call = PyObject_GetAttrString(fast.sharing, "order_after_call"))
        || !(fast.alias = PyObject_GetAttrString(fast.sharing, "alias"))
        || !(fast.epoch = PyUnicode_InternFromString("epoch"))
        || !(fast.torch_settings = PyUnicode_InternFromString("torch_settings"))
        || !(fast.cuda_aliases = PyUnicode_InternFromString("cuda_aliases"))
        || !(fast.attributes = PyObject_GenericGetDict(fast.interpreter, NULL))
        || !(fast.globals = Py_XNewRef(PyModule_GetDict(fast.sharing)))
        || !(fast.zero = PyLong_FromLong(0))) {
        fast.interpreter = NULL;
        return -1;
    }
    Py_INCREF(fast.interpreter); /* last: the fast path is on */
    return 0;
}

/* The value of name in dict (fast.attributes or fast.globals), borrowed; NULL with an
 * exception if it is not there. */
static PyObject *read_name(PyObject *dict, PyObject *name)
{
    PyObject *value = PyDict_GetItemWithError(dict, name);
    if (!value && !PyErr_Occurred())
        PyErr_SetObject(PyExc_AttributeError, name);
    return value;
}

/* Whether this thread runs with the interpreter's torch settings (the handler's
 * `thread_torch() is self.torch_settings`): 1, 0, or -1 with an exception. */
static int settings_applied(void)
{
    PyObject *wanted = read_name(fast.attributes, fast.torch_settings);
    return wanted ? (thread_torch ? thread_torch : Py_None) == wanted : -1;
}

/* Whether requests of epoch are this interpreter's (not of a manager that closed). */
static int current_epoch(uint64_t epoch)
{
    PyObject *now = read_name(fast.attributes, fast.epoch);
    int same = now && PyLong_AsUnsignedLongLong(now) == epoch && !PyErr_Occurred();
    PyErr_Clear();
    return same;
}

/* The ERROR reply for the exception being raised (the handler's `failed`): aliased, the
 * host's tokens aliased so far if the request was not read whole, else NULL.  NULL with
 * an exception if even that failed (then the entry replies BROKEN). */
static PyObject *fail(PyObject *aliased)
{
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyErr_NormalizeException(&type, &value, &traceback);
    if (traceback)
        PyException_SetTraceback(value, traceback);
    PyObject *tokens = aliased ? PyList_AsTuple(aliased) : Py_NewRef(Py_None);
    PyObject *reply = tokens ? PyObject_CallFunctionObjArgs(fast.failed, value, tokens, NULL)
                             : NULL;
    Py_XDECREF(tokens);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(traceback);
    return reply;
}

/* After the call, as the handler does: what it wrote to CUDA aliases ordered before the
 * host's next use, and this thread's torch settings applied if the call imported torch
 * or changed them; 0, or -1 with an exception. */
static int after_call(void)
{
    PyObject *cuda = read_name(fast.globals, fast.cuda_aliases);
    int ordering = cuda ? PyObject_IsTrue(cuda) : -1;
    PyObject *done = ordering > 0 ? PyObject_CallNoArgs(fast.order_after_call) : NULL;
    if (ordering < 0 || (ordering && !done))
        return -1;
    Py_XDECREF(done);
    int applied = settings_applied();
    done = applied == 0 ? PyObject_CallNoArgs(fast.apply_torch_settings) : NULL;
    if (applied < 0 || (!applied && !done))
        return -1;
    Py_XDECREF(done);
    return 0;
}

/* Whether Python code other than its caller may hold tensor, a call's result: another
 * reference or a weak reference to it (its list where CPython keeps it: at the type's
 * offset, which from 3.12 on is negative for a class that gets its weak references
 * managed, as torch.Tensor does). */
static int held_elsewhere(PyObject *tensor)
{
    Py_ssize_t offset = Py_TYPE(tensor)->tp_weaklistoffset;
    return Py_REFCNT(tensor) > 1 || (offset && *(PyObject **)((char *)tensor + offset));
}

/* The reply for a call's result: a CPU torch tensor lent here, its record in *lent, and
 * None for the TENSOR reply that carries it (the common case); anything else, the reply
 * of the handler's value_reply.  NULL with an exception, nothing lent. */
static PyObject *value_reply(struct runtime *rt, PyObject *result,
                             struct multipy_lent_tensor *lent)
{
    if (!torch_api.tensor || (PyObject *)Py_TYPE(result) != torch_api.tensor)
        return PyObject_CallOneArg(fast.value_reply, result);
    struct loan loan = {NULL, rt->lent, fast.counter}; /* not closed: no list of tokens */
    /* one no one else holds cannot be re-pointed here: its storage need not be kept */
    int lending = lend_torch_at(result, &loan, held_elsewhere(result), &lent->token,
                                &lent->address);
    if (lending == 0) /* not lent (a CUDA tensor, a lazy view): value_reply says how */
        return PyObject_CallOneArg(fast.value_reply, result);
    return lending > 0 ? Py_NewRef(Py_None) : NULL;
}

/* Calls target (or its method) with the request's values, its lent tensors aliased:
 * the reply, the error reply included, or None for a TENSOR reply of *lent
 * (value_reply); NULL with an exception if even that failed. */
static PyObject *call_lent(struct runtime *rt, PyObject *target, PyObject *request,
                           struct multipy_lent_tensor *lent)
{
    PyObject *method = PyTuple_GET_ITEM(request, 0), *kwargs = PyTuple_GET_ITEM(request, 3);
    PyObject *aliased = PyList_New(0), *reply;
    PyObject *alias_args[5] = {PyTuple_GET_ITEM(request, 1), PyTuple_GET_ITEM(request, 2),
                               fast.zero, aliased, fast.alias};
    PyObject *args = aliased ? alias_flat(NULL, alias_args, 5) : NULL;
    if (!args) {
        reply = aliased ? fail(aliased) : NULL;
        Py_XDECREF(aliased);
        return reply;
    }
    Py_DECREF(aliased); /* read whole: the host takes back nothing now */
    PyObject *callable = method == Py_None ? Py_NewRef(target) : PyObject_GetAttr(target, method);
    PyObject *result = NULL;
    if (callable && PyDict_GET_SIZE(kwargs) == 0) {
        result = PyObject_Vectorcall(callable, PySequence_Fast_ITEMS(args),
                                     PyList_GET_SIZE(args), NULL);
    } else if (callable) {
        PyObject *positional = PyList_AsTuple(args);
        result = positional ? PyObject_Call(callable, positional, kwargs) : NULL;
        Py_XDECREF(positional);
    }
    Py_XDECREF(callable);
    Py_DECREF(args);
    reply = result && after_call() == 0 ? value_reply(rt, result, lent) : NULL;
    Py_XDECREF(result);
    return reply ? reply : fail(NULL);
}

/* Calls target with the one tensor a CALL_TENSOR lends, aliased here (its token goes
 * back by the queue even if no alias is made): the reply, the error reply included, or
 * None for a TENSOR reply of *lent (value_reply); NULL with an exception if even that
 * failed. */
static PyObject *call_tensor(struct runtime *rt, PyObject *target,
                             const struct multipy_request *request,
                             struct multipy_lent_tensor *lent)
{
    struct multipy_lent_tensor in;
    memcpy(&in, request->body, sizeof in);
    PyObject *tensor = alias_lent_at(in.token, in.address, alias_queue(0), NULL), *reply;
    if (!tensor)
        return fail(NULL);
    PyObject *result = PyObject_CallOneArg(target, tensor);
    Py_DECREF(tensor);
    reply = result && after_call() == 0 ? value_reply(rt, result, lent) : NULL;
    Py_XDECREF(result);
    return reply ? reply : fail(NULL);
}

/* Whether args is the body of a CALL_LENT as the handler reads it: (method or None,
 * values, positions, kwargs). */
static int lent_call_body(PyObject *args)
{
    PyObject *method = args && PyTuple_CheckExact(args) && PyTuple_GET_SIZE(args) == 4
                       ? PyTuple_GET_ITEM(args, 0) : NULL;
    return method && (method == Py_None || PyUnicode_CheckExact(method))
           && PyTuple_CheckExact(PyTuple_GET_ITEM(args, 1))
           && PyTuple_CheckExact(PyTuple_GET_ITEM(args, 2))
           && PyDict_CheckExact(PyTuple_GET_ITEM(args, 3));
}

/* Runs request here, without the handler, if it is the common call: CALL_LENT of a
 * known object, by marshal, or CALL_TENSOR of one once torch is imported, in this
 * interpreter's epoch, on a thread that runs with its torch settings (the handler's own
 * path, step by step).  1 with *reply set as the handler would set it (NULL with an
 * exception where the handler would raise), or to None for a TENSOR reply of *lent; 0,
 * having run nothing, for the handler to run it. */
static int fast_call(struct runtime *rt, const struct multipy_request *request,
                     PyObject **reply, struct multipy_lent_tensor *lent)
{
    int tensor = request->op == MULTIPY_CALL_TENSOR;
    if (!fast.interpreter || !(tensor || request->op == MULTIPY_CALL_LENT) || !request->handle
        || (tensor ? request->size != sizeof(struct multipy_lent_tensor) || !torch_api.from_dlpack
                   : !request->size || (unsigned char)request->body[0] == MULTIPY_PICKLED)
        || !current_epoch(request->epoch))
        return 0;
    PyObject *key = PyLong_FromUnsignedLongLong(request->handle);
    PyObject *target = key ? PyDict_GetItemWithError(rt->objects, key) : NULL;
    PyObject *name = target ? PyDict_GetItemWithError(rt->names, key) : NULL;
    Py_XDECREF(key);
    int ready = name && PyBytes_Check(name) && settings_applied() == 1;
    PyObject *args = ready && !tensor
                     ? PyMarshal_ReadObjectFromString(request->body, (Py_ssize_t)request->size)
                     : NULL;
    if (!ready || (!tensor && !lent_call_body(args))) {
        Py_XDECREF(args); /* the handler reads it again, and says what is wrong */
        PyErr_Clear();
        return 0;
    }
    Py_INCREF(target); /* the call may drop them from their tables */
    Py_INCREF(name);
    if (record) {
        record->op = "call";
        record->target = PyBytes_AS_STRING(name);
    }
    *reply = tensor ? call_tensor(rt, target, request, lent) : call_lent(rt, target, args, lent);
    Py_DECREF(target);
    Py_DECREF(name);
    Py_XDECREF(args);
    return 1;
}

/* -- the interpreter's own thread -- */

static void *interpreter_thread(void *arg)
{
    struct runtime *rt = arg;
    /* Signals sent to the process are the host's: leave them to host threads. */
    sigset_t blocked;
    sigfillset(&blocked);
    int synchronous[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGTRAP, SIGABRT, SIGSYS};
    for (size_t i = 0; i < sizeof synchronous / sizeof *synchronous; i++)
        sigdelset(&blocked, synchronous[i]);
    pthread_sigmask(SIG_BLOCK, &blocked, NULL);

    PyImport_AppendInittab("_multipy_bootstrap", init_module);
    PyConfig config;
    PyConfig_InitPythonConfig(&config);
    config.install_signal_handlers = 0; /* signal dispositions belong to the host */
    config.parse_argv = 0;
    PyStatus status = PyConfig_SetBytesString(&config, &config.program_name, rt->program);
    if (!PyStatus_Exception(status))
        status = Py_InitializeFromConfig(&config);
    PyConfig_Clear(&config);
    if (PyStatus_Exception(status)) {
        dprintf(rt->status_fd, "%s: %s", status.func ? status.func : "Py_InitializeFromConfig",
                status.err_msg ? status.err_msg : "failed");
        return NULL;
    }
    PyObject *main_module = PyImport_AddModule("__main__"), *fast_path = NULL;
    if (PyRun_SimpleString(rt->code) != 0
        || !(rt->handler = PyObject_GetAttrString(main_module, "handler"))
        || !(rt->objects = PyObject_GetAttrString(main_module, "objects"))
        || !(rt->lent = PyObject_GetAttrString(main_module, "lent"))
        || !(rt->names = PyObject_GetAttrString(main_module, "names"))
        || !(fast_path = PyObject_GetAttrString(main_module, "fast_path"))
        || fast_path_start(fast_path) < 0) {
        PyErr_Clear();
        dprintf(rt->status_fd, "the interpreter's entry code failed (traceback on stderr)");
        Py_FinalizeEx();
        return NULL;
    }
    Py_DECREF(fast_path);
    rt->ctype_b = *__ctype_b_loc();
    rt->ctype_tolower = *__ctype_tolower_loc();
    rt->ctype_toupper = *__ctype_toupper_loc();
    PyThreadState *main_state = PyEval_SaveThread();
    atomic_store(&rt->state, SERVING);
    dprintf(rt->status_fd, "ready");
    char byte;
    while (read(rt->stop_fd, &byte, 1) < 0 && errno == EINTR)
        ;
    PyEval_RestoreThread(main_state);
    Py_FinalizeEx();
    return NULL;
}

/*
 * This namespace's libc took the host's array of environment strings as it was when the
 * namespace was made, and the host's setenv may move that array and free it (and
 * os.putenv free its strings).  So the interpreter gets a copy of the host's environment
 * as it is now, in its own heap, as a child process does: its getenv never reads freed
 * memory, and its setenv changes its own.  0, or -1 out of memory.
 */
static int copy_environment(char *const *host)
{
    size_t count = 0;
    while (host && host[count])
        count++;
    char **copy = calloc(count + 1, sizeof *copy);
    if (!copy)
        return -1;
    for (size_t i = 0; i < count; i++)
        if (!(copy[i] = strdup(host[i])))
            return -1; /* the process is out of memory: what was copied stays */
    environ = copy;
    return 0;
}

/*
 * Gives the interpreter its environment (the host's, host_environment, copied) and
 * starts its thread; returns the runtime, or NULL with the reason in error.  Readiness
 * (or failure) comes on status_fd.
 */
void *multipy_start(const char *program, const char *code, char *const *host_environment,
                    int status_fd, int stop_fd, char *error, size_t size)
{
    if (copy_environment(host_environment) != 0) {
        snprintf(error, size, "out of memory");
        return NULL;
    }
    struct runtime *rt = calloc(1, sizeof *rt); /* lives as long as the process */
    if (!rt || !(rt->program = strdup(program)) || !(rt->code = strdup(code))) {
        snprintf(error, size, "out of memory");
        return NULL;
    }
    rt->status_fd = status_fd;
    rt->stop_fd = stop_fd;
    atomic_init(&rt->state, STARTING);
    runtime_here = rt;
    int failed = pthread_create(&rt->thread, NULL, interpreter_thread, rt);
    if (failed) {
        snprintf(error, size, "cannot start the interpreter's thread: %s", strerror(failed));
        return NULL;
    }
    return rt;
}

/* Refuses entries from now on; the host then waits for multipy_active to reach 0. */
void multipy_stop(void *runtime)
{
    atomic_store(&((struct runtime *)runtime)->state, STOPPING);
}

int multipy_active(void *runtime)
{
    return atomic_load(&((struct runtime *)runtime)->active);
}

/* Waits up to timeout seconds for the thread to end; returns 0, ETIMEDOUT or an errno value. */
int multipy_join(void *runtime, double timeout)
{
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_sec += (time_t)timeout;
    deadline.tv_nsec += (long)((timeout - (double)(time_t)timeout) * 1e9);
    if (deadline.tv_nsec >= 1000000000L) {
        deadline.tv_sec += 1;
        deadline.tv_nsec -= 1000000000L;
    }
    return pthread_timedjoin_np(((struct runtime *)runtime)->thread, NULL, &deadline);
}

/* -- entering from host threads -- */

static int admit(struct runtime *rt)
{
    atomic_fetch_add(&rt->active, 1);
    if (atomic_load(&rt->state) == SERVING)
        return 1;
    atomic_fetch_sub(&rt->active, 1);
    return 0;
}

void multipy_leave(void *runtime)
{
    if (capacity > KEPT_BUFFER) { /* a big reply: give its memory back now */
        free(buffer);
        buffer = NULL;
        capacity = 0;
    }
    atomic_fetch_sub(&((struct runtime *)runtime)->active, 1);
}

/* Gives a thread that this namespace's libc did not start what that libc sets up per
 * thread and Python needs: the <ctype.h> tables (the rest is in its TLS image). */
static void adopt_thread(struct runtime *rt)
{
    *__ctype_b_loc() = rt->ctype_b;
    *__ctype_tolower_loc() = rt->ctype_tolower;
    *__ctype_toupper_loc() = rt->ctype_toupper;
}

/* Takes this interpreter's GIL with the calling thread's own state here. */
static void take_gil(struct runtime *rt)
{
    if (own_state) {
        PyEval_RestoreThread(own_state);
    } else {
        adopt_thread(rt);
        PyGILState_Ensure(); /* makes the state and binds it to this thread; never released */
        own_state = PyThreadState_Get();
    }
}

/* "module.Type: message" of the exception being raised, as bytes (cleared). */
static PyObject *describe_exception(void)
{
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyErr_NormalizeException(&type, &value, &traceback);
    PyObject *text = value ? PyObject_Str(value) : NULL;
    PyObject *name = type ? PyObject_GetAttrString(type, "__name__") : NULL;
    const char *name_text = name ? PyUnicode_AsUTF8(name) : NULL;
    PyErr_Clear();
    const char *message = text ? PyUnicode_AsUTF8(text) : NULL; /* NULL for lone surrogates */
    PyErr_Clear();
    PyObject *bytes = PyBytes_FromFormat("%s: %s", name_text ? name_text : "?",
                                         message ? message : "?");
    PyErr_Clear();
    Py_XDECREF(text);
    Py_XDECREF(name);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(traceback);
    return bytes;
}

/* Drops what the host released: handles (and their names) or tokens of objects lent to
 * it.  In C, so that an exception raised by a cancel cannot stop it half-way. */
static void apply_releases(struct runtime *rt, const uint64_t *numbers, size_t count)
{
    for (size_t i = 0; i < count; i++) {
        PyObject *key = PyLong_FromUnsignedLongLong(numbers[i]);
        if (!key) {
            PyErr_Clear();
            continue;
        }
        /* a token (the commoner) or a handle, asked before it is dropped: a KeyError
         * costs more */
        int token = PyDict_Contains(rt->lent, key);
        if (token > 0)
            PyDict_DelItem(rt->lent, key);
        else if (token == 0 && PyDict_Contains(rt->objects, key) > 0
                 && PyDict_DelItem(rt->objects, key) == 0)
            PyDict_DelItem(rt->names, key);
        PyErr_Clear(); /* whatever failed: the number is skipped */
        Py_DECREF(key);
    }
}

/* Copies the reply into this thread's buffer (the handler's objects are dropped under
 * the GIL; the host copies the buffer without it), after the host tokens that aliases
 * here gave back (taken from their queue); 0, or -1 out of memory. */
static int keep_reply(struct multipy_reply *reply, const char *data, size_t size)
{
    size_t queued = queue_length(&released_tensors);
    size_t released_size = queued * 8, need = released_size + size;
    if (need > capacity) {
        char *grown = realloc(buffer, need);
        if (!grown)
            return -1;
        buffer = grown;
        capacity = need;
    }
    size_t count = queue_take(&released_tensors, (uint64_t *)buffer, queued);
    if (size)
        memcpy(buffer + released_size, data, size);
    reply->released = (const uint64_t *)buffer;
    reply->n_released = count;
    reply->data = buffer + released_size;
    reply->size = size;
    return 0;
}

/* After the handler: the memoryview over host memory must not outlive the call.  Keeps
 * the exception the handler raised, if any (BROKEN replies describe it). */
static void release_view(PyObject *view)
{
    if (view && Py_REFCNT(view) > 1) { /* kept, by a traceback for instance */
        PyObject *type, *value, *traceback;
        PyErr_Fetch(&type, &value, &traceback);
        PyObject *done = PyObject_CallMethod(view, "release", NULL);
        Py_XDECREF(done);
        PyErr_Clear();
        PyErr_Restore(type, value, traceback);
    }
    Py_XDECREF(view);
}

/* handler(op, handle, epoch, body): the body as a memoryview over the host's bytes. */
static PyObject *run_handler(struct runtime *rt, const struct multipy_request *request,
                             PyObject **view)
{
    PyObject *args[4] = {PyLong_FromLong(request->op),
                         PyLong_FromUnsignedLongLong(request->handle),
                         PyLong_FromUnsignedLongLong(request->epoch),
                         PyMemoryView_FromMemory((char *)request->body,
                                                 (Py_ssize_t)request->size, PyBUF_READ)};
    *view = args[3];
    PyObject *result = NULL;
    if (args[0] && args[1] && args[2] && args[3])
        result = PyObject_Vectorcall(rt->handler, args, 4, NULL);
    Py_XDECREF(args[0]);
    Py_XDECREF(args[1]);
    Py_XDECREF(args[2]);
    return result;
}

int multipy_enter(void *runtime, const struct multipy_request *request,
                  struct multipy_record *line, struct multipy_reply *reply)
{
    struct runtime *rt = runtime;
    memset(reply, 0, sizeof *reply);
    if (!admit(rt)) {
        reply->status = MULTIPY_CLOSED;
        return -1;
    }
    take_gil(rt);
    record = line;
    struct call call;
    begin_call(rt, &call, request->serial);
    apply_releases(rt, request->releases, request->n_releases);

    PyObject *result = NULL;
    struct multipy_lent_tensor lent = {0, 0}; /* a TENSOR reply's, from fast_call */
    if (!call.cancelled && !fast_call(rt, request, &result, &lent)) {
        PyObject *view = NULL;
        result = run_handler(rt, request, &view);
        release_view(view);
    }
    end_call(rt, &call);

    int kept = -1;
    if (result == Py_None && lent.address) { /* fast_call's TENSOR reply */
        reply->status = MULTIPY_TENSOR;
        kept = keep_reply(reply, (const char *)&lent, sizeof lent);
        PyObject *token = kept ? PyLong_FromUnsignedLongLong(lent.token) : NULL;
        if (token) /* not sent: the tensor stays lent to no one */
            PyDict_DelItem(rt->lent, token);
        Py_XDECREF(token);
    } else if (result && PyTuple_Check(result) && PyTuple_GET_SIZE(result) == 3
        && PyBytes_Check(PyTuple_GET_ITEM(result, 2))) {
        reply->status = (int)PyLong_AsLong(PyTuple_GET_ITEM(result, 0));
        reply->handle = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(result, 1));
        PyObject *payload = PyTuple_GET_ITEM(result, 2);
        kept = keep_reply(reply, PyBytes_AS_STRING(payload), (size_t)PyBytes_GET_SIZE(payload));
    } else if (call.cancelled && !result && !PyErr_Occurred()) { /* cancelled before it ran */
        reply->status = MULTIPY_CANCELLED;
        kept = keep_reply(reply, NULL, 0);
    }
    if (kept != 0) { /* the handler itself failed: an exception a cancel raised in it, say */
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_MemoryError, "no memory for multipy's reply");
        PyObject *text = describe_exception();
        reply->status = MULTIPY_BROKEN;
        if (!text || keep_reply(reply, PyBytes_AS_STRING(text), (size_t)PyBytes_GET_SIZE(text)))
            keep_reply(reply, "MemoryError: ?", 14);
        Py_XDECREF(text);
    }
    Py_XDECREF(result);
    PyErr_Clear();
    record = NULL;
    PyEval_SaveThread();
    return 0;
}

int multipy_cancel(void *runtime, unsigned long thread, uint64_t serial, int kind)
{
    struct runtime *rt = runtime;
    if (!admit(rt))
        return 0;
    if (!own_state)
        adopt_thread(rt);
    PyGILState_STATE state = PyGILState_Ensure();
    int found = cancel_call(rt, thread, serial, kind == MULTIPY_CANCEL_INTERRUPT
                                                    ? PyExc_KeyboardInterrupt : cancelled_type);
    PyGILState_Release(state);
    multipy_leave(rt);
    return found;
}

void multipy_forget(void *runtime)
{
    struct runtime *rt = runtime;
    if (admit(rt)) {
        if (own_state) {
            PyEval_RestoreThread(own_state);
            Py_CLEAR(thread_torch);
            PyGILState_Release(PyGILState_UNLOCKED); /* the last one: deletes the state */
        }
        multipy_keys_thread_exit(); /* after the state, as when a thread of its own exits */
        multipy_leave(rt);
    }
    own_state = NULL;
    free(buffer);
    buffer = NULL;
    capacity = 0;
}
