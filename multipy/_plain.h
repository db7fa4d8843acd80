/*
 * Plain values cross by marshal (docs/design.md, "The call path"): None, bool, int,
 * float, complex, str and bytes, and tuples, lists and dicts of them, every type exact
 * (a subclass, or anything else, is not plain: it crosses by pickle).
 * Host and interpreters run the same CPython, so its marshal format is theirs.
 * Included by the host's C and by the C inside each interpreter.
 */
#ifndef MULTIPY_PLAIN_H
#define MULTIPY_PLAIN_H

#include <Python.h>
#include <marshal.h>

#define PLAIN_DEPTH 16 /* deeper values take the general path */
#define PLAIN_SHARED 64 /* at most this many objects that may be met twice, see below */
#define PLAIN_LONG_TEXT 256 /* str and bytes from this length count as shared objects */
/* Version 2: no table of references between objects (version 3 and later allocate one
 * for every message).  So a plain value must be a tree: marshal would write an object
 * met twice twice (a list in two places would come back as two lists, and [[x] * 10]
 * * 10 ... grows exponentially), and pickle, which keeps it shared, must take it. */
#define PLAIN_MARSHAL_VERSION 2

/* The containers and long texts met so far that something else also refers to. */
struct plain_walk {
    PyObject *shared[PLAIN_SHARED];
    int count;
};

/* Whether value is met for the first time in this walk (an object only its container
 * refers to cannot be met again); 0 if it was met before, or too many such were. */
static int first_meeting(struct plain_walk *walk, PyObject *value)
{
    if (Py_REFCNT(value) == 1)
        return 1;
    for (int i = 0; i < walk->count; i++)
        if (walk->shared[i] == value)
            return 0;
    if (walk->count == PLAIN_SHARED)
        return 0;
    walk->shared[walk->count++] = value;
    return 1;
}

/* Whether value is plain, and no object in it met twice: 1 yes, 0 no (never raises). */
static int is_plain_value(PyObject *value, int depth, struct plain_walk *walk)
{
    PyTypeObject *type = Py_TYPE(value);
    if (type == &PyUnicode_Type)
        return PyUnicode_GET_LENGTH(value) < PLAIN_LONG_TEXT || first_meeting(walk, value);
    if (type == &PyBytes_Type)
        return PyBytes_GET_SIZE(value) < PLAIN_LONG_TEXT || first_meeting(walk, value);
    if (value == Py_None || type == &PyBool_Type || type == &PyLong_Type
        || type == &PyFloat_Type || type == &PyComplex_Type)
        return 1;
    if (depth >= PLAIN_DEPTH)
        return 0;
    if (type == &PyTuple_Type || type == &PyList_Type) {
        if (type == &PyTuple_Type && Py_SIZE(value) == 0) /* () is one object anywhere */
            return 1;
        if (!first_meeting(walk, value))
            return 0;
        for (Py_ssize_t i = 0; i < Py_SIZE(value); i++) {
            PyObject *item = type == &PyTuple_Type ? PyTuple_GET_ITEM(value, i)
                                                   : PyList_GET_ITEM(value, i);
            if (!is_plain_value(item, depth + 1, walk))
                return 0;
        }
        return 1;
    }
    if (type == &PyDict_Type) {
        if (!first_meeting(walk, value))
            return 0;
        Py_ssize_t at = 0;
        PyObject *key, *item;
        while (PyDict_Next(value, &at, &key, &item))
            if (!is_plain_value(key, depth + 1, walk) || !is_plain_value(item, depth + 1, walk))
                return 0;
        return 1;
    }
    return 0;
}

/* plain(value) -> bytes | None: value marshalled if it is plain, else None. */
static PyObject *plain(PyObject *module, PyObject *value)
{
    (void)module;
    struct plain_walk walk;
    walk.count = 0;
    if (!is_plain_value(value, 0, &walk))
        Py_RETURN_NONE;
    PyObject *data = PyMarshal_WriteObjectToString(value, PLAIN_MARSHAL_VERSION);
    if (!data && PyErr_ExceptionMatches(PyExc_ValueError)) {
        PyErr_Clear(); /* a str or bytes of 2 GiB or more, which marshal refuses: pickle */
        Py_RETURN_NONE;
    }
    return data;
}

#define PLAIN_METHOD                                                                  \
    {"plain", plain, METH_O,                                                          \
     "plain(value) -> bytes | None: value by marshal if it is plain (scalars, and "   \
     "tuples, lists and dicts of plain values, exact types, no object met twice), "   \
     "else None."}

#endif
