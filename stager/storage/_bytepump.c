/* The byte pump: one call reads a block of a local shard, hashes it (xxh3_64), shows it to
 * the compiled tar walk and writes it, all in one release of the interpreter lock.
 *
 * Why C: the buffered copy in Python (stager/storage/bytepath.py) makes four calls per read
 * (readv, the hash, the walk, write), and each gives the interpreter lock up and must win it
 * back. A shard of 200 KB took ~12 such hand-overs; with a few copy threads on a few cores the
 * threads spent their time waiting for the lock and the scheduler, not copying (perf: a quarter
 * of the samples in the scheduler with four streams on two cores), so more streams made stage-in
 * slower, never faster, on a memory-speed source. Here a call moves up to a block (4 MiB) with
 * the lock released once, and threads copy on every core.
 *
 * The hash is the xxHash library's own XXH3 (vendor/xxhash.h, BSD 2-clause, the release the
 * xxhash package on PyPI builds from), so digests equal xxhash.xxh3_64's; the tests compare them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <time.h>
#include <unistd.h>

#define XXH_INLINE_ALL
#define XXH_STATIC_LINKING_ONLY
#include "vendor/xxhash.h"

#include "../shards/_tarwalk_api.h"

static TarWalkAPI *walk_api; /* NULL where the tar walk was not built */

typedef struct {
    PyObject_HEAD
    XXH3_state_t *state;
    PyObject *walker; /* a TarWalker fed every byte, or NULL */
    int busy;
} Pump;

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* An interrupted system call: take the lock back and run Python's signal handlers (Ctrl-C,
 * the stager's SIGTERM handler) as os.read would; -1 where one raised. */
static int handle_signals(PyThreadState **saved) {
    PyEval_RestoreThread(*saved);
    int failed = PyErr_CheckSignals();
    *saved = PyEval_SaveThread();
    return failed;
}

/* Write all `len` bytes, in pieces of at most `piece` (see _WRITE_BYTES in bytepath.py);
 * 0, or the errno of the failed write (-1: a signal handler raised). */
static int write_all(int fd, const char *data, size_t len, size_t piece, PyThreadState **saved) {
    while (len) {
        ssize_t n = write(fd, data, len < piece ? len : piece);
        if (n < 0) {
            if (errno != EINTR) return errno;
            if (handle_signals(saved) < 0) return -1;
            continue;
        }
        if (n == 0) return EIO; /* a regular file never takes nothing; do not spin */
        data += n;
        len -= (size_t)n;
    }
    return 0;
}

/* move(src_fd, dst_fd, buffer, limit, piece) -> (moved, ended, lag_s)
 *
 * Read `src_fd` into `buffer` until `limit` bytes have passed or it ends; hash each read, feed
 * it to the walker and write it to `dst_fd` in pieces of at most `piece` bytes. `ended`: a read
 * returned nothing. `lag_s`: seconds from the return of the last read that returned bytes to the
 * return of this call (the caller's last-byte time is its own clock minus this). An I/O error
 * raises OSError with its errno; the bytes moved before it are hashed and written, and the copy
 * is then discarded by the caller. */
static PyObject *Pump_move(Pump *p, PyObject *args) {
    int src, dst;
    Py_buffer view;
    Py_ssize_t limit, piece;
    if (!PyArg_ParseTuple(args, "iiw*nn", &src, &dst, &view, &limit, &piece)) return NULL;
    if (limit <= 0 || piece <= 0 || view.len <= 0) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "limit, piece and the buffer must be positive");
        return NULL;
    }
    if (p->busy) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_RuntimeError, "BytePump.move called from two threads at once");
        return NULL;
    }
    if (p->walker && walk_api->claim(p->walker) < 0) {
        PyBuffer_Release(&view);
        return NULL;
    }
    p->busy = 1;
    char *buf = (char *)view.buf;
    size_t capacity = (size_t)view.len, moved = 0, want_total = (size_t)limit;
    int ended = 0, failure = 0; /* failure: an errno, or -1 where a signal handler raised */
    double last_read = 0.0;
    PyThreadState *saved = PyEval_SaveThread();
    while (moved < want_total) {
        size_t want = want_total - moved;
        if (want > capacity) want = capacity;
        ssize_t n = read(src, buf, want);
        if (n < 0) {
            if (errno != EINTR) {
                failure = errno;
                break;
            }
            if (handle_signals(&saved) < 0) {
                failure = -1;
                break;
            }
            continue;
        }
        if (n == 0) {
            ended = 1;
            break;
        }
        last_read = now_s();
        XXH3_64bits_update(p->state, buf, (size_t)n);
        if (p->walker) walk_api->feed(p->walker, (const unsigned char *)buf, (size_t)n);
        moved += (size_t)n;
        failure = write_all(dst, buf, (size_t)n, (size_t)piece, &saved);
        if (failure) break;
    }
    double returned = now_s();
    PyEval_RestoreThread(saved);
    p->busy = 0;
    PyBuffer_Release(&view);
    int walk_failed = p->walker ? walk_api->release(p->walker) : 0;
    if (failure > 0) {
        PyErr_Clear(); /* the I/O error says more than a walk that ran out of memory */
        errno = failure;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    if (failure < 0 || walk_failed < 0) return NULL;
    return Py_BuildValue("(nOd)", (Py_ssize_t)moved, ended ? Py_True : Py_False,
                         moved ? returned - last_read : 0.0);
}

/* The digest as xxhash.xxh3_64().hexdigest() writes it: 16 hex digits, big-endian. */
static PyObject *Pump_hexdigest(Pump *p, PyObject *Py_UNUSED(ignored)) {
    if (p->busy) {
        PyErr_SetString(PyExc_RuntimeError, "BytePump.hexdigest called during a move");
        return NULL;
    }
    char hex[17];
    snprintf(hex, sizeof hex, "%016llx", (unsigned long long)XXH3_64bits_digest(p->state));
    return PyUnicode_FromStringAndSize(hex, 16);
}

static int Pump_init(Pump *p, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"walker", NULL};
    PyObject *walker = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|O", kwlist, &walker)) return -1;
    if (p->busy) {
        PyErr_SetString(PyExc_RuntimeError, "BytePump re-initialised during a move");
        return -1;
    }
    if (walker != Py_None) {
        if (!walk_api || !PyObject_TypeCheck(walker, walk_api->walker_type)) {
            PyErr_SetString(PyExc_TypeError, "walker must be a stager.shards._tarwalk.TarWalker");
            return -1;
        }
    }
    if (!p->state && !(p->state = XXH3_createState())) {
        PyErr_NoMemory();
        return -1;
    }
    XXH3_64bits_reset(p->state);
    Py_XSETREF(p->walker, walker == Py_None ? NULL : Py_NewRef(walker));
    return 0;
}

static void Pump_dealloc(Pump *p) {
    XXH3_freeState(p->state);
    Py_XDECREF(p->walker);
    Py_TYPE(p)->tp_free((PyObject *)p);
}

static PyMethodDef Pump_methods[] = {
    {"move", (PyCFunction)Pump_move, METH_VARARGS,
     "move(src_fd, dst_fd, buffer, limit, piece) -> (moved, ended, lag_s): copy up to limit "
     "bytes, hashed and walked on the way."},
    {"hexdigest", (PyCFunction)Pump_hexdigest, METH_NOARGS,
     "hexdigest() -> str: the xxh3_64 of every byte moved, as xxhash writes it."},
    {NULL, NULL, 0, NULL}};

static PyTypeObject PumpType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "stager.storage._bytepump.BytePump",
    .tp_basicsize = sizeof(Pump),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "BytePump(walker=None): copies a file a block per call, hashing (xxh3_64) and "
              "walking its bytes on the way, without the interpreter lock.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Pump_init,
    .tp_dealloc = (destructor)Pump_dealloc,
    .tp_methods = Pump_methods,
};

static struct PyModuleDef bytepump_module = {
    PyModuleDef_HEAD_INIT, "_bytepump",
    "The compiled byte pump (see stager/storage/bytepath.py).", -1, NULL};

PyMODINIT_FUNC PyInit__bytepump(void) {
    if (PyType_Ready(&PumpType) < 0) return NULL;
    /* The walk is optional: without it the pump still copies and hashes. */
    PyObject *walk_module = PyImport_ImportModule("stager.shards._tarwalk");
    walk_api = walk_module ? (TarWalkAPI *)PyCapsule_Import(TARWALK_CAPSULE, 0) : NULL;
    Py_XDECREF(walk_module);
    if (!walk_api) PyErr_Clear();
    PyObject *m = PyModule_Create(&bytepump_module);
    if (!m) return NULL;
    Py_INCREF(&PumpType);
    if (PyModule_AddObject(m, "BytePump", (PyObject *)&PumpType) < 0) {
        Py_DECREF(&PumpType);
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "WALKS", walk_api != NULL) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
