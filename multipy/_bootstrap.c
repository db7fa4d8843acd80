/*
 * The only C in multipy: a plain shared library that the host loads into each
 * interpreter's link-map namespace, after that namespace's libpython.
 *
 * Its single job is to start the interpreter's thread with the namespace's own
 * pthread_create (a thread must never run two namespaces' Python: DESIGN.md 3.1),
 * initialise CPython on that thread, run the Python entry code given by the host
 * until it returns, and finalise.  All Py* symbols resolve to the namespace's
 * libpython, which is the namespace's root object.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdio.h>
#include <signal.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

/* Owned by the host, which keeps it alive until the thread has been joined. */
struct multipy_start {
    const char *program; /* the host's sys.executable: gives the same prefix, venv and site */
    const char *code;    /* Python source run in __main__ once initialised */
    int error_fd;        /* receives a message if initialisation fails */
};

static void *interpreter_thread(void *arg)
{
    struct multipy_start *start = arg;
    /* Signals sent to the process are the host's: leave them to host threads. */
    sigset_t blocked;
    sigfillset(&blocked);
    int synchronous[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGTRAP, SIGABRT, SIGSYS};
    for (size_t i = 0; i < sizeof synchronous / sizeof *synchronous; i++)
        sigdelset(&blocked, synchronous[i]);
    pthread_sigmask(SIG_BLOCK, &blocked, NULL);

    PyConfig config;
    PyConfig_InitPythonConfig(&config);
    config.install_signal_handlers = 0; /* signal dispositions belong to the host */
    config.parse_argv = 0;
    PyStatus status = PyConfig_SetBytesString(&config, &config.program_name, start->program);
    if (!PyStatus_Exception(status))
        status = Py_InitializeFromConfig(&config);
    PyConfig_Clear(&config);
    if (PyStatus_Exception(status)) {
        dprintf(start->error_fd, "%s: %s", status.func ? status.func : "Py_InitializeFromConfig",
                status.err_msg ? status.err_msg : "failed");
        return NULL;
    }
    if (PyRun_SimpleString(start->code) != 0)
        dprintf(start->error_fd, "the interpreter's entry code failed (traceback on stderr)");
    Py_FinalizeEx();
    return NULL;
}

/* Starts the interpreter's thread; returns 0 or an errno value. */
int multipy_start(struct multipy_start *start, pthread_t *thread)
{
    return pthread_create(thread, NULL, interpreter_thread, start);
}

/* Waits up to timeout seconds for the thread to end; returns 0, ETIMEDOUT or an errno value. */
int multipy_join(pthread_t thread, double timeout)
{
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_sec += (time_t)timeout;
    deadline.tv_nsec += (long)((timeout - (double)(time_t)timeout) * 1e9);
    if (deadline.tv_nsec >= 1000000000L) {
        deadline.tv_sec += 1;
        deadline.tv_nsec -= 1000000000L;
    }
    return pthread_timedjoin_np(thread, NULL, &deadline);
}

/*
 * Loaded into the host's own namespace.  Once armed, the process leaves through
 * _exit with exit()'s status before glibc runs any library destructor: used when an
 * interpreter could not be stopped, because its libraries' destructors would wait
 * for a GIL that its still-running thread holds (DESIGN.md 3.7).
 */
static void exit_now(int status, void *unused)
{
    (void)unused;
    fflush(NULL);
    _exit(status);
}

int multipy_skip_destructors_at_exit(void)
{
    return on_exit(exit_now, NULL);
}
