/*
 * An interpreter's users as the load balancer counts them (docs/design.md, "The call
 * path"): the sessions open on it and the calls of replicated objects running on it.
 * Every method runs with the host's GIL held and runs no Python code, so that a check
 * and its count happen at once for every host thread, with no lock of their own.
 * Included by the host's C alone; multipy.session keeps the Python reference.
 */
#ifndef MULTIPY_OCCUPANCY_H
#define MULTIPY_OCCUPANCY_H

#include <Python.h>
#include <structmember.h>

typedef struct {
    PyObject_HEAD
    Py_ssize_t users;
    int closed;
    PyObject *runtime; /* its out_of_room and abandoned_calls keep new users away */
} Occupancy;

static PyObject *out_of_room_name, *abandoned_calls_name;

static int Occupancy_init(Occupancy *self, PyObject *args, PyObject *kwargs)
{
    PyObject *runtime;
    if (kwargs || !PyArg_ParseTuple(args, "O:Occupancy", &runtime))
        return -1;
    Py_XSETREF(self->runtime, Py_NewRef(runtime));
    return 0;
}

static void Occupancy_dealloc(Occupancy *self)
{
    Py_XDECREF(self->runtime);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Whether the runtime takes new users: 1, 0, or -1 with an exception. */
static int runtime_open(PyObject *runtime)
{
    PyObject *room = PyObject_GetAttr(runtime, out_of_room_name);
    if (!room)
        return -1;
    int full = room != Py_None;
    Py_DECREF(room);
    if (full)
        return 0;
    PyObject *abandoned = PyObject_GetAttr(runtime, abandoned_calls_name);
    if (!abandoned)
        return -1;
    int running = PyObject_IsTrue(abandoned); /* a set: no Python code runs */
    Py_DECREF(abandoned);
    return running < 0 ? -1 : !running;
}

/* Counts one user if there is none, it is not closed and its runtime takes new users:
 * 1 if it did, 0 if not, -1 with an exception. */
static int occupancy_take_if_idle(Occupancy *self)
{
    if (self->users || self->closed)
        return 0;
    int open = runtime_open(self->runtime);
    if (open > 0)
        self->users = 1;
    return open;
}

static PyObject *Occupancy_take_if_idle(Occupancy *self, PyObject *unused)
{
    (void)unused;
    int taken = occupancy_take_if_idle(self);
    return taken < 0 ? NULL : PyBool_FromLong(taken);
}

static PyObject *Occupancy_take(Occupancy *self, PyObject *unused)
{
    (void)unused;
    self->users++;
    Py_RETURN_NONE;
}

static PyObject *Occupancy_give_back(Occupancy *self, PyObject *unused)
{
    (void)unused;
    self->users--;
    Py_RETURN_NONE;
}

static PyObject *Occupancy_close(Occupancy *self, PyObject *unused)
{
    (void)unused;
    self->closed = 1;
    Py_RETURN_NONE;
}

static PyMethodDef Occupancy_methods[] = {
    {"take_if_idle", (PyCFunction)Occupancy_take_if_idle, METH_NOARGS,
     "Counts one user if there is none, it is not closed, and its runtime has room and "
     "runs no abandoned call; whether it did."},
    {"take", (PyCFunction)Occupancy_take, METH_NOARGS, "Counts one more user."},
    {"give_back", (PyCFunction)Occupancy_give_back, METH_NOARGS, "Counts one user less."},
    {"close", (PyCFunction)Occupancy_close, METH_NOARGS,
     "From now on take_if_idle() takes no one."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Occupancy_members[] = {
    {"users", T_PYSSIZET, offsetof(Occupancy, users), READONLY, "The users counted now."},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject OccupancyType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "multipy._host.Occupancy",
    .tp_basicsize = sizeof(Occupancy),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Occupancy(runtime): an interpreter's users as the load balancer counts them; "
              "the runtime's out_of_room and abandoned_calls keep new ones away.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Occupancy_init,
    .tp_dealloc = (destructor)Occupancy_dealloc,
    .tp_methods = Occupancy_methods,
    .tp_members = Occupancy_members,
};

/* Readies the type and adds it to module: 0, or -1 with an exception. */
static int add_occupancy(PyObject *module)
{
    if (!(out_of_room_name = PyUnicode_InternFromString("out_of_room"))
        || !(abandoned_calls_name = PyUnicode_InternFromString("abandoned_calls"))
        || PyType_Ready(&OccupancyType) < 0)
        return -1;
    return PyModule_AddObjectRef(module, "Occupancy", (PyObject *)&OccupancyType);
}

#endif
