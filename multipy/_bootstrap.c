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
#include <sys/syscall.h>
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

/*
 * Fatal-signal report, installed in the host's namespace.  A crash in one interpreter
 * takes the whole process down (one address space); before it does, this names the
 * interpreter and the call it was running.  Each interpreter's thread fills its slot:
 * its kernel thread id once, and a short description before each call.
 */
struct multipy_slot {
    volatile int tid;
    int index;
    char what[112];
};

#define MULTIPY_SLOTS 16
static struct multipy_slot slots[MULTIPY_SLOTS];
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

static void report_fatal_signal(int signal_number, siginfo_t *info, void *context)
{
    (void)info;
    (void)context;
    int tid = (int)syscall(SYS_gettid);
    for (int i = 0; i < MULTIPY_SLOTS; i++) {
        if (slots[i].tid == tid) {
            say("\nmultipy: fatal signal ");
            say_number(signal_number);
            say(" in interpreter #");
            say_number(slots[i].index);
            say(" (thread ");
            say_number(tid);
            say(") while it ran: ");
            say(slots[i].what);
            say("\nmultipy: a crash in any interpreter ends the whole process.\n");
        }
    }
    /* Hand the signal to whoever had it before (faulthandler, or the default action):
     * returning re-runs the faulting instruction, or abort() raises it again. */
    for (size_t i = 0; i < sizeof fatal_signals / sizeof *fatal_signals; i++)
        if (fatal_signals[i] == signal_number)
            sigaction(signal_number, &previous[i], NULL);
}

/* The slot of interpreter number index (0 to 15). */
struct multipy_slot *multipy_crash_slot(int index)
{
    return &slots[index];
}

int multipy_report_crashes(void)
{
    struct sigaction action = {0};
    action.sa_sigaction = report_fatal_signal;
    action.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&action.sa_mask);
    for (size_t i = 0; i < sizeof fatal_signals / sizeof *fatal_signals; i++)
        if (sigaction(fatal_signals[i], &action, &previous[i]) != 0)
            return -1;
    return 0;
}
