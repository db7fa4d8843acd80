/*
 * Lending the tensors of a flat call or reply, in C (docs/design.md, "memory"): the
 * fast path of multipy._sharing.lend_flat and alias_flat, which every call with a few
 * tensors among scalars takes.  A torch tensor is lent and aliased here, through torch's
 * own functions (registered by use_torch); anything else that is not a scalar goes to
 * the Python fallback that the caller passes (numpy arrays, and anything pickled).
 * Included by the host's C and by the C inside each interpreter.
 */
#ifndef MULTIPY_LEND_H
#define MULTIPY_LEND_H

#include <Python.h>

#include "_dlpack.h"

/* Where the tokens of aliases made here go back to, for the side that lent (source). */
static struct release_queue *alias_queue(long source);

/* This side's torch, once use_torch has run: the tensor type that is lent (exactly:
 * subclasses are pickled), the methods a tensor is checked with and its storage read
 * with, and its DLPack functions.  NULL before. */
static struct {
    PyObject *tensor, *is_conj, *is_neg, *untyped_storage, *to_dlpack, *from_dlpack;
} torch_api;
static PyObject *torch_kind; /* "torch": a lent tensor's record starts with it */

static PyObject *use_torch(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 3 || !PyType_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "use_torch(Tensor, to_dlpack, from_dlpack)");
        return NULL;
    }
    if (torch_api.tensor) /* once: other threads may be calling the functions kept */
        Py_RETURN_NONE;
    PyObject *is_conj = PyObject_GetAttrString(args[0], "is_conj");
    PyObject *is_neg = is_conj ? PyObject_GetAttrString(args[0], "is_neg") : NULL;
    PyObject *storage = is_neg ? PyObject_GetAttrString(args[0], "untyped_storage") : NULL;
    if (!torch_kind)
        torch_kind = PyUnicode_InternFromString("torch");
    if (!storage || !torch_kind) {
        Py_XDECREF(is_conj);
        Py_XDECREF(is_neg);
        Py_XDECREF(storage);
        return NULL;
    }
    torch_api.is_conj = is_conj;
    torch_api.is_neg = is_neg;
    torch_api.untyped_storage = storage;
    torch_api.to_dlpack = Py_NewRef(args[1]);
    torch_api.from_dlpack = Py_NewRef(args[2]);
    torch_api.tensor = Py_NewRef(args[0]); /* last: the others are ready */
    Py_RETURN_NONE;
}

/* 1 if method(tensor) is true, 0 if not, -1 with an exception. */
static int tensor_says(PyObject *method, PyObject *tensor)
{
    PyObject *answer = PyObject_CallOneArg(method, tensor);
    if (!answer)
        return -1;
    int truth = PyObject_IsTrue(answer);
    Py_DECREF(answer);
    return truth;
}

/* Where one message lends into: its multipy._sharing.Lent's list `tokens` (NULL where
 * the caller gives back what it lent itself), its exports' dict `objects` and token
 * iterator `counter`, read once a message (by names interned once), not once a tensor. */
struct loan {
    PyObject *tokens, *objects, *counter;
};
static PyObject *loan_names[3]; /* "tokens", "objects", "counter" */

/* Reads lent's parts into loan: 0, or -1 with an exception (loan_close still due). */
static int loan_open(struct loan *loan, PyObject *lent)
{
    static const char *names[3] = {"tokens", "objects", "counter"};
    PyObject **parts[3] = {&loan->tokens, &loan->objects, &loan->counter};
    for (int i = 0; i < 3; i++) {
        if (!loan_names[i] && !(loan_names[i] = PyUnicode_InternFromString(names[i])))
            return -1;
        if (!(*parts[i] = PyObject_GetAttr(lent, loan_names[i])))
            return -1;
    }
    return 0;
}

static void loan_close(struct loan *loan)
{
    Py_CLEAR(loan->tokens);
    Py_CLEAR(loan->objects);
    Py_CLEAR(loan->counter);
}

/* 0, the exception cleared, if torch refused a tensor as it refuses sparse, quantized or
 * nested ones (its DLPack or its storage); -1 with any other exception. */
static int refused(void)
{
    if (PyErr_ExceptionMatches(PyExc_RuntimeError) || PyErr_ExceptionMatches(PyExc_BufferError)
        || PyErr_ExceptionMatches(PyExc_TypeError)) {
        PyErr_Clear();
        return 0;
    }
    return -1;
}

/* DLPack's type code of complex numbers: the only tensors that torch marks conjugate. */
#define MULTIPY_DL_COMPLEX 5

/* Lends tensor into loan, token noted (in its tokens, if it has a list) before the
 * capsule is kept: 1 with its token and address (its DLManagedTensor) in *token and
 * *address; 0 if it is not lent (a lazy conjugate or negative view, which DLPack would
 * export without saying so; not in host memory; one DLPack refuses); -1 with an
 * exception.  With with_storage, its storage is kept beside the capsule (which holds the
 * tensor), so that set_() on the tensor cannot free the memory that is lent; without,
 * the capsule alone, for a tensor that nothing can re-point while the other side uses
 * it (one no one else holds) or until the caller keeps it (keep_storage, _host.c).  (The
 * capsule first: its type code spares a real tensor the question of its conjugate bit, a
 * torch call of its own.) */
static int lend_torch_at(PyObject *tensor, struct loan *loan, int with_storage,
                         uint64_t *token, uint64_t *address)
{
    PyObject *capsule = PyObject_CallOneArg(torch_api.to_dlpack, tensor);
    if (!capsule)
        return refused();
    DLManagedTensor *managed = PyCapsule_GetPointer(capsule, "dltensor");
    int lazy = !managed ? -1 : managed->dl_tensor.device.device_type != MULTIPY_DL_CPU;
    if (lazy == 0 && managed->dl_tensor.dtype.code == MULTIPY_DL_COMPLEX)
        lazy = tensor_says(torch_api.is_conj, tensor);
    if (lazy == 0)
        lazy = tensor_says(torch_api.is_neg, tensor);
    if (lazy) {
        Py_DECREF(capsule);
        return lazy < 0 ? -1 : 0;
    }
    PyObject *storage = with_storage ? PyObject_CallOneArg(torch_api.untyped_storage, tensor)
                                     : NULL;
    if (with_storage && !storage) {
        Py_DECREF(capsule);
        return refused();
    }
    int lent = -1;
    PyObject *kept = storage ? PyTuple_Pack(2, capsule, storage) : Py_NewRef(capsule);
    PyObject *number = kept ? PyIter_Next(loan->counter) : NULL;
    if (kept && !number && !PyErr_Occurred())
        PyErr_SetNone(PyExc_StopIteration); /* the tokens ran out */
    if (number && (!loan->tokens || PyList_Append(loan->tokens, number) == 0)
        && PyDict_SetItem(loan->objects, number, kept) == 0) {
        *token = PyLong_AsUnsignedLongLong(number);
        *address = (uint64_t)(uintptr_t)managed;
        lent = PyErr_Occurred() ? -1 : 1;
    }
    Py_XDECREF(number);
    Py_XDECREF(kept);
    Py_DECREF(capsule);
    Py_XDECREF(storage);
    return lent;
}

/* lend_torch_at's record (kind, token, address) of tensor, None if it is not lent, or
 * NULL with an exception. */
static PyObject *lend_torch(PyObject *tensor, struct loan *loan)
{
    uint64_t token, address;
    int lent = lend_torch_at(tensor, loan, 1, &token, &address);
    if (lent <= 0)
        return lent < 0 ? NULL : Py_NewRef(Py_None);
    PyObject *record = PyTuple_New(3), *number = PyLong_FromUnsignedLongLong(token);
    PyObject *at = PyLong_FromUnsignedLongLong(address);
    if (!record || !number || !at) {
        Py_XDECREF(record);
        Py_XDECREF(number);
        Py_XDECREF(at);
        return NULL; /* the loan keeps the token: its owner takes it back */
    }
    PyTuple_SET_ITEM(record, 0, Py_NewRef(torch_kind));
    PyTuple_SET_ITEM(record, 1, number);
    PyTuple_SET_ITEM(record, 2, at);
    return record;
}

/* lend_tensor(tensor, lent) -> record | None: see lend_torch (use_torch first). */
static PyObject *lend_tensor(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 2 || !torch_api.tensor) {
        PyErr_SetString(PyExc_TypeError, "lend_tensor(tensor, lent), after use_torch");
        return NULL;
    }
    struct loan loan = {NULL, NULL, NULL};
    PyObject *record = loan_open(&loan, args[1]) == 0 ? lend_torch(args[0], &loan) : NULL;
    loan_close(&loan);
    return record;
}

static int is_scalar(PyObject *value)
{
    PyTypeObject *type = Py_TYPE(value);
    return value == Py_None || type == &PyBool_Type || type == &PyLong_Type
           || type == &PyFloat_Type || type == &PyComplex_Type || type == &PyUnicode_Type
           || type == &PyBytes_Type;
}

/* Whether value needs no lending: a scalar, or a tuple of scalars. */
static int needs_no_lending(PyObject *value)
{
    if (is_scalar(value))
        return 1;
    if (!PyTuple_CheckExact(value))
        return 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(value); i++)
        if (!is_scalar(PyTuple_GET_ITEM(value, i)))
            return 0;
    return 1;
}

/* A new tuple of count items (records take the places of the values in it). */
static PyObject *copy_items(PyObject *const *items, Py_ssize_t count)
{
    PyObject *copy = PyTuple_New(count);
    for (Py_ssize_t i = 0; copy && i < count; i++)
        PyTuple_SET_ITEM(copy, i, Py_NewRef(items[i]));
    return copy;
}

/* Gives back what one message lent: lent.take_back() if lent is given, else every token
 * of loan (open), as Lent.take_back would.  Keeps any exception raised before (the first
 * is the one to report); -1 if it raised (Ctrl-C, say) and none had been. */
static int take_back(PyObject *lent, struct loan *loan)
{
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyObject *done = NULL;
    if (lent) {
        done = PyObject_CallMethod(lent, "take_back", NULL);
        Py_XDECREF(done);
    } else {
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(loan->tokens); i++)
            if (PyDict_DelItem(loan->objects, PyList_GET_ITEM(loan->tokens, i)) < 0)
                PyErr_Clear(); /* given back already */
        done = PyList_SetSlice(loan->tokens, 0, PyList_GET_SIZE(loan->tokens), NULL) == 0
               ? Py_None : NULL;
    }
    if (!type)
        return done ? 0 : -1;
    PyErr_Clear();
    PyErr_Restore(type, value, traceback);
    return 0;
}

/* What lend_flat does, with torch tensors lent into loan: opened from lent at the first
 * if it is not open (its tokens NULL; the caller closes it).  describe(value, lent)
 * lends what is not a torch tensor; without lent and describe, only torch tensors are
 * lent (anything else makes it None).  Whatever it raises, and if None, nothing stays
 * lent. */
static PyObject *lend_values(PyObject *values_in, struct loan *loan, PyObject *lent,
                             PyObject *describe)
{
    /* values as they came (a list could change while describe runs), and a copy where
     * records take the places of what is lent */
    PyObject *values = PySequence_Tuple(values_in), *flat = NULL, *met = NULL;
    PyObject *positions = PyList_New(0);
    if (!values || !positions
        || !(flat = copy_items(PySequence_Fast_ITEMS(values), PyTuple_GET_SIZE(values))))
        goto failed;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(flat); i++) {
        PyObject *value = PyTuple_GET_ITEM(flat, i), *record = NULL, *key, *earlier;
        if (needs_no_lending(value))
            continue;
        /* met: id(value) -> its record, so that one met again has one token, as in
         * pickle's memo (an equal copy of its record: plain values share nothing) */
        if ((!met && !(met = PyDict_New())) || !(key = PyLong_FromVoidPtr(value)))
            goto failed;
        if ((earlier = PyDict_GetItemWithError(met, key)))
            record = copy_items(PySequence_Fast_ITEMS(earlier), 3);
        else if (PyErr_Occurred())
            record = NULL;
        else if (torch_api.tensor && (PyObject *)Py_TYPE(value) == torch_api.tensor)
            record = loan->tokens || loan_open(loan, lent) == 0 ? lend_torch(value, loan) : NULL;
        else
            record = describe ? PyObject_CallFunctionObjArgs(describe, value, lent, NULL)
                              : Py_NewRef(Py_None);
        if (record == Py_None) { /* not lent: this value is pickled, and so is the rest */
            Py_DECREF(key);
            Py_DECREF(values);
            Py_DECREF(flat);
            Py_DECREF(positions);
            Py_DECREF(met);
            if (take_back(lent, loan) < 0) {
                Py_DECREF(record);
                return NULL;
            }
            return record;
        }
        PyObject *position = record ? PyLong_FromSsize_t(i) : NULL;
        int noted = position && PyList_Append(positions, position) == 0
                    && (earlier || PyDict_SetItem(met, key, record) == 0);
        Py_XDECREF(position);
        Py_DECREF(key);
        if (!record)
            goto failed;
        PyTuple_SET_ITEM(flat, i, record); /* the copy's own reference to value goes */
        Py_DECREF(value);
        if (!noted)
            goto failed;
    }
    Py_DECREF(values);
    Py_XDECREF(met);
    values = met = NULL;
    PyObject *places = PyList_AsTuple(positions);
    Py_DECREF(positions);
    if (!places) {
        positions = NULL;
        goto failed;
    }
    PyObject *result = PyTuple_Pack(2, flat, places);
    Py_DECREF(flat);
    Py_DECREF(places);
    if (!result)
        take_back(lent, loan);
    return result;
failed:
    take_back(lent, loan);
    Py_XDECREF(met);
    Py_XDECREF(values);
    Py_XDECREF(flat);
    Py_XDECREF(positions);
    return NULL;
}

/* lend_flat(values, lent, describe) -> (values, positions) | None: see
 * multipy._sharing.lend_flat, whose fast path this is; describe(value, lent) lends
 * what is not a torch tensor (or returns None). */
static PyObject *lend_flat(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "lend_flat(values, lent, describe)");
        return NULL;
    }
    struct loan loan = {NULL, NULL, NULL}; /* opened at the first torch tensor */
    PyObject *result = lend_values(args[0], &loan, args[1], args[2]);
    loan_close(&loan);
    return result;
}

/* The torch tensor over the memory a torch record (kind, token, address) describes,
 * whose token goes to queue once it is unused; the token is appended to aliased (a
 * list, or None) first.  In this order, the capsule gives the token back if no tensor
 * takes it.  NULL with an exception. */
static PyObject *alias_torch(PyObject *record, struct release_queue *queue, PyObject *aliased)
{
    PyObject *token = PyTuple_GET_ITEM(record, 1), *tensor = NULL;
    PyObject *address_token[2] = {PyTuple_GET_ITEM(record, 2), token};
    PyObject *capsule = make_alias_capsule(address_token, 2, queue);
    if (capsule && (aliased == Py_None || PyList_Append(aliased, token) == 0))
        tensor = PyObject_CallOneArg(torch_api.from_dlpack, capsule);
    Py_XDECREF(capsule);
    return tensor;
}

/* The torch tensor over what the other side lent at address under token, with no record
 * (a CALL_TENSOR's or TENSOR reply's): as alias_torch, the token appended to aliased (a
 * list) once the capsule holds it; without aliased (NULL), the token goes to queue even
 * if no capsule is made.  NULL with an exception. */
static PyObject *alias_lent_at(uint64_t token, uint64_t address, struct release_queue *queue,
                               PyObject *aliased)
{
    PyObject *capsule = capsule_of((DLManagedTensor *)(uintptr_t)address, token, 0, queue);
    if (!capsule && !aliased)
        queue_push(queue, token); /* no one else gives it back */
    PyObject *number = capsule && aliased ? PyLong_FromUnsignedLongLong(token) : NULL;
    PyObject *tensor = NULL;
    if (capsule && (!aliased || (number && PyList_Append(aliased, number) == 0)))
        tensor = PyObject_CallOneArg(torch_api.from_dlpack, capsule);
    Py_XDECREF(number);
    Py_XDECREF(capsule); /* if no tensor took it, it gives the token back itself */
    return tensor;
}

/* The queue for the side that lent, source; NULL with an exception if there is none. */
static struct release_queue *source_queue(PyObject *source)
{
    long number = PyLong_AsLong(source);
    if (number == -1 && PyErr_Occurred())
        return NULL;
    struct release_queue *queue = alias_queue(number);
    if (!queue)
        PyErr_Format(PyExc_ValueError, "no interpreter %ld lends here", number);
    return queue;
}

/* alias_tensor(record, source, aliased) -> tensor: see alias_torch (use_torch first). */
static PyObject *alias_tensor(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 3 || !torch_api.from_dlpack || !PyTuple_CheckExact(args[0])
        || PyTuple_GET_SIZE(args[0]) != 3 || !(args[2] == Py_None || PyList_CheckExact(args[2]))) {
        PyErr_SetString(PyExc_TypeError, "alias_tensor((kind, token, address), source, "
                                         "aliased: list | None), after use_torch");
        return NULL;
    }
    struct release_queue *queue = source_queue(args[1]);
    return queue ? alias_torch(args[0], queue, args[2]) : NULL;
}

/* alias_capsule(address, token, source, versioned=False) -> capsule for this side's
 * numpy (versioned) or torch: what source lent at address; see make_alias_capsule. */
static PyObject *alias_capsule(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs < 3 || nargs > 4) {
        PyErr_SetString(PyExc_TypeError, "alias_capsule(address, token, source, versioned=False)");
        return NULL;
    }
    struct release_queue *queue = source_queue(args[2]);
    return queue ? make_alias_capsule(args, nargs, queue) : NULL;
}

/* alias_flat(values, positions, source, aliased, alias) -> list: see
 * multipy._sharing.alias_flat, whose fast path this is; alias(record, source, aliased)
 * makes the alias of what is not a torch tensor. */
static PyObject *alias_flat(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 5 || !PyTuple_CheckExact(args[0]) || !PyTuple_CheckExact(args[1])
        || !PyList_CheckExact(args[3])) {
        PyErr_SetString(PyExc_TypeError, "alias_flat(values: tuple, positions: tuple, "
                                         "source, aliased: list, alias)");
        return NULL;
    }
    PyObject *values = args[0], *positions = args[1], *aliased = args[3], *alias = args[4];
    struct release_queue *queue = source_queue(args[2]);
    if (!queue)
        return NULL;
    PyObject *out = PySequence_List(values), *made_by_token = PyDict_New();
    if (!out || !made_by_token)
        goto failed;
    Py_ssize_t count = PyTuple_GET_SIZE(positions), size = PyTuple_GET_SIZE(values);
    for (Py_ssize_t k = 0; k < count; k++) {
        Py_ssize_t at = PyLong_AsSsize_t(PyTuple_GET_ITEM(positions, k));
        PyObject *record = at >= 0 && at < size ? PyTuple_GET_ITEM(values, at) : NULL;
        if (!record || !PyTuple_CheckExact(record) || PyTuple_GET_SIZE(record) != 3) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "no lent record (kind, token, address) "
                                                  "at a position");
            goto failed;
        }
        PyObject *token = PyTuple_GET_ITEM(record, 1), *kind = PyTuple_GET_ITEM(record, 0);
        PyObject *made = PyDict_GetItemWithError(made_by_token, token); /* one alias a record */
        if (made)
            Py_INCREF(made);
        else if (PyErr_Occurred())
            goto failed;
        else if (torch_api.from_dlpack && PyUnicode_Check(kind)
                 && PyUnicode_Compare(kind, torch_kind) == 0) {
            made = alias_torch(record, queue, aliased);
        } else {
            made = PyObject_CallFunctionObjArgs(alias, record, args[2], aliased, NULL);
        }
        if (!made || PyDict_SetItem(made_by_token, token, made) < 0) {
            Py_XDECREF(made);
            goto failed;
        }
        PyList_SetItem(out, at, made); /* in place of the record */
    }
    Py_DECREF(made_by_token);
    return out;
failed:
    Py_XDECREF(made_by_token);
    Py_XDECREF(out);
    return NULL;
}

#define LEND_METHODS                                                                      \
    {"use_torch", (PyCFunction)(void (*)(void))use_torch, METH_FASTCALL,                  \
     "use_torch(Tensor, to_dlpack, from_dlpack): lend and alias tensors with these."},     \
    {"lend_tensor", (PyCFunction)(void (*)(void))lend_tensor, METH_FASTCALL,              \
     "lend_tensor(tensor, lent) -> (kind, token, address) | None: lends a tensor."},      \
    {"lend_flat", (PyCFunction)(void (*)(void))lend_flat, METH_FASTCALL,                  \
     "lend_flat(values, lent, describe) -> (values, positions) | None: see "             \
     "multipy._sharing.lend_flat."},                                                      \
    {"alias_flat", (PyCFunction)(void (*)(void))alias_flat, METH_FASTCALL,                \
     "alias_flat(values, positions, source, aliased, alias) -> list: see "               \
     "multipy._sharing.alias_flat."},                                                     \
    {"alias_tensor", (PyCFunction)(void (*)(void))alias_tensor, METH_FASTCALL,            \
     "alias_tensor(record, source, aliased) -> tensor: the alias of a lent torch tensor; " \
     "its token goes back to source when unused, and is appended to aliased (or None)."}, \
    {"alias_capsule", (PyCFunction)(void (*)(void))alias_capsule, METH_FASTCALL,          \
     "alias_capsule(address, token, source, versioned=False) -> capsule: what source "    \
     "lent at address, for numpy.from_dlpack (versioned) or torch's; the token goes "     \
     "back to source when unused."}

#endif
