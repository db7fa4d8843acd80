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

#define PLAIN_DEPTH 16 /* deeper values (and cycles) take the general path */
/* Version 2: no references between objects (version 3 and later allocate a table of
 * them for every message); plain values are trees, so they need none. */
#define PLAIN_MARSHAL_VERSION 2

/* Whether value is plain: 1 yes, 0 no (never raises). */
static int is_plain_value(PyObject *value, int depth)
{
    PyTypeObject *type = Py_TYPE(value);
    if (value == Py_None || type == &PyBool_Type || type == &PyLong_Type
        || type == &PyFloat_Type || type == &PyUnicode_Type || type == &PyBytes_Type
        || type == &PyComplex_Type)
        return 1;
    if (depth >= PLAIN_DEPTH)
        return 0;
    if (type == &PyTuple_Type || type == &PyList_Type) {
        /* a list may change while it is walked: read its size at every step */
        for (Py_ssize_t i = 0; i < Py_SIZE(value); i++) {
            PyObject *item = type == &PyTuple_Type ? PyTuple_GET_ITEM(value, i)
                                                   : PyList_GET_ITEM(value, i);
            if (!is_plain_value(item, depth + 1))
                return 0;
        }
        return 1;
    }
    if (type == &PyDict_Type) {
        Py_ssize_t at = 0;
        PyObject *key, *item;
        while (PyDict_Next(value, &at, &key, &item))
            if (!is_plain_value(key, depth + 1) || !is_plain_value(item, depth + 1))
                return 0;
        return 1;
    }
    return 0;
}

/* plain(value) -> bytes | None: value marshalled if it is plain, else None. */
static PyObject *plain(PyObject *module, PyObject *value)
{
    (void)module;
    if (!is_plain_value(value, 0))
        Py_RETURN_NONE;
    return PyMarshal_WriteObjectToString(value, PLAIN_MARSHAL_VERSION);
}

#define PLAIN_METHOD                                                                  \
    {"plain", plain, METH_O,                                                          \
     "plain(value) -> bytes | None: value by marshal if it is plain (scalars, and "   \
     "tuples, lists and dicts of plain values, exact types), else None."}

#endif
