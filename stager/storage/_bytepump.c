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
#include <fcntl.h>
#include <sys/stat.h>
#include <stdint.h>
#include <stdio.h>
#include <time.h>
#include <unistd.h>

#define XXH_INLINE_ALL
#define XXH_STATIC_LINKING_ONLY
#include "vendor/xxhash.h"

#include "_bytepump.h"

TarWalkAPI *pump_walk_api;

typedef struct {
    PyObject_HEAD
    XXH3_state_t *state;
    PyObject *walker; /* a TarWalker fed every byte, or NULL */
    int busy;
} Pump;

double pump_now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* An interrupted system call: take the lock back and run Python's signal handlers (Ctrl-C,
 * the stager's SIGTERM handler) as os.read would; -1 where one raised. */
int pump_handle_signals(PyThreadState **saved) {
    PyEval_RestoreThread(*saved);
    int failed = PyErr_CheckSignals();
    *saved = PyEval_SaveThread();
    return failed;
}

/* Write all `len` bytes, in pieces of at most `piece` (see _WRITE_BYTES in bytepath.py);
 * 0, or the errno of the failed write (-1: a signal handler raised). */
int pump_write_all(int fd, const char *data, size_t len, size_t piece, PyThreadState **saved) {
    while (len) {
        ssize_t n = write(fd, data, len < piece ? len : piece);
        if (n < 0) {
            if (errno != EINTR) return errno;
            if (pump_handle_signals(saved) < 0) return -1;
            continue;
        }
        if (n == 0) return EIO; /* a regular file never takes nothing; do not spin */
        data += n;
        len -= (size_t)n;
    }
    return 0;
}

/* What a move reports: the bytes moved, whether the file ended, the lag since the last read
 * that returned bytes, and the source's fstat at its end. */
typedef struct {
    size_t moved;
    int ended, failure; /* failure: an errno, or -1 where a signal handler raised */
    double lag_s, first_lag_s; /* since the last read that returned bytes; since the first */
    struct stat end;
} Moved;

/* Ask the kernel to start reading the next block (a buffer's worth; past the end of the file,
 * clipped by the kernel) before this one is hashed, walked and written. Why: a 4 MiB read from
 * a cold disk returns once its bytes are in, and the kernel's own read-ahead (128 KiB by
 * default) then kept the disk busy for a small part of the time the block took to process;
 * one stream of 64 MB shards from a dropped page cache took 1.25 s without this and 1.12 s
 * with it (docs/benchmarks.md). On cached pages it is a lookup per page, once per block. A
 * hint: a failure changes nothing. */
static void read_ahead(int src, size_t capacity) {
    off_t at = lseek(src, 0, SEEK_CUR);
    if (at >= 0) (void)posix_fadvise(src, at, (off_t)capacity, POSIX_FADV_WILLNEED);
}

/* The loop of move(), without the interpreter lock (released by the caller into *saved). */
static void move_released(Pump *p, int src, int dst, char *buf, size_t capacity, size_t first,
                          size_t limit, size_t piece, Moved *out, PyThreadState **saved) {
    double last_read = 0.0, first_read = 0.0;
    out->moved = 0;
    out->ended = out->failure = 0;
    while (out->moved < limit) {
        size_t want = limit - out->moved;
        if (want > capacity) want = capacity;
        if (first_read == 0.0 && want > first) want = first; /* alone: the first-byte time */
        ssize_t n = read(src, buf, want);
        if (n < 0) {
            if (errno != EINTR) {
                out->failure = errno;
                return;
            }
            if (pump_handle_signals(saved) < 0) {
                out->failure = -1;
                return;
            }
            continue;
        }
        if (n == 0) {
            out->ended = 1;
            break;
        }
        last_read = pump_now_s();
        if (first_read == 0.0) first_read = last_read;
        if ((size_t)n == want) read_ahead(src, capacity); /* (a full read: the file may go on) */
        XXH3_64bits_update(p->state, buf, (size_t)n);
        if (p->walker) pump_walk_api->feed(p->walker, (const unsigned char *)buf, (size_t)n);
        out->moved += (size_t)n;
        out->failure = pump_write_all(dst, buf, (size_t)n, piece, saved);
        if (out->failure) return;
    }
    /* At the end, the source as it is now: the caller compares it with the open's fstat, so
     * a file rewritten during the copy is never published (stager/storage/copy.py). */
    if (out->ended && fstat(src, &out->end) < 0) out->failure = errno;
    double returned = pump_now_s();
    out->lag_s = out->moved ? returned - last_read : 0.0;
    out->first_lag_s = out->moved ? returned - first_read : 0.0;
}

/* Claim the pump (and its walker) and the buffer for a move; 0, or -1 with an exception. */
static int claim(Pump *p, Py_buffer *view, Py_ssize_t limit, Py_ssize_t piece) {
    if (limit <= 0 || piece <= 0 || view->len <= 0) {
        PyErr_SetString(PyExc_ValueError, "limit, piece and the buffer must be positive");
        return -1;
    }
    if (p->busy) {
        PyErr_SetString(PyExc_RuntimeError, "BytePump used from two threads at once");
        return -1;
    }
    if (p->walker && pump_walk_api->claim(p->walker) < 0) return -1;
    p->busy = 1;
    return 0;
}

/* What identifies the file's bytes (stager/storage/identity.py): (inode, mtime_s, mtime_ns,
 * ctime_s, ctime_ns), seconds and nanoseconds apart: as one product in 64 bits they overflow
 * past the year 2262, which ext4 allows. */
static PyObject *identity_of(const struct stat *st) {
    return Py_BuildValue("(KLlLl)", (unsigned long long)st->st_ino, (long long)st->st_mtim.tv_sec,
                         (long)st->st_mtim.tv_nsec, (long long)st->st_ctim.tv_sec,
                         (long)st->st_ctim.tv_nsec);
}

/* Give the pump and walker back; the result of the move, or NULL with its exception. */
static PyObject *moved_result(Pump *p, const Moved *m) {
    p->busy = 0;
    if (m->failure < 0) { /* a signal handler raised: its exception wins over the walk's */
        PyObject *type, *value, *traceback;
        PyErr_Fetch(&type, &value, &traceback);
        if (p->walker && pump_walk_api->release(p->walker) < 0) PyErr_Clear();
        PyErr_Restore(type, value, traceback);
        return NULL;
    }
    int walk_failed = p->walker ? pump_walk_api->release(p->walker) : 0;
    if (m->failure > 0) {
        PyErr_Clear(); /* the I/O error says more than a walk that ran out of memory */
        errno = m->failure;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    if (walk_failed < 0) return NULL;
    if (!m->ended)
        return Py_BuildValue("(nOdO)", (Py_ssize_t)m->moved, Py_False, m->lag_s, Py_None);
    return Py_BuildValue("(nOd(NL))", (Py_ssize_t)m->moved, Py_True, m->lag_s,
                         identity_of(&m->end), (long long)m->end.st_size);
}

/* move(src_fd, dst_fd, buffer, limit, piece) -> (moved, ended, lag_s, end)
 *
 * Read `src_fd` into `buffer` until `limit` bytes have passed or it ends; hash each read, feed
 * it to the walker and write it to `dst_fd` in pieces of at most `piece` bytes. `ended`: a read
 * returned nothing. `lag_s`: seconds from the return of the last read that returned bytes to the
 * return of this call (the caller's last-byte time is its own clock minus this). `end`: where
 * the file ended, the source's (identity_of, size) then; else None. An I/O error raises
 * OSError with its errno; the copy is then discarded by the caller. */
static PyObject *Pump_move(Pump *p, PyObject *args) {
    int src, dst;
    Py_buffer view;
    Py_ssize_t limit, piece;
    if (!PyArg_ParseTuple(args, "iiw*nn", &src, &dst, &view, &limit, &piece)) return NULL;
    if (claim(p, &view, limit, piece) < 0) {
        PyBuffer_Release(&view);
        return NULL;
    }
    Moved m;
    PyThreadState *saved = PyEval_SaveThread();
    move_released(p, src, dst, (char *)view.buf, (size_t)view.len, (size_t)limit, (size_t)limit,
                  (size_t)piece, &m, &saved);
    PyEval_RestoreThread(saved);
    PyBuffer_Release(&view);
    return moved_result(p, &m);
}

/* begin(src_path, partial_path, buffer, first, limit, piece)
 *     -> None | False | (src_fd, dst_fd, opened, first_lag_s, moved)
 *
 * Open the source (read-only, non-blocking: a FIFO must not hang the open) and check it is a
 * regular file, create or truncate the partial, and move() up to `limit` bytes, the first read
 * of at most `first` bytes alone (`first_lag_s`: seconds since it returned, for the first-byte
 * time). `opened`: the source's identity_of at the open; `moved`: what move() returns. A
 * source read to its end is closed here, and its descriptor returned as -1 (each close from
 * Python is one more hand-over). That is all of a small shard's copy before its checks, in one
 * release of the interpreter lock where the Python steps took eight (each open, fstat, read
 * and write a hand-over, and with a few copy threads on a few cores the hand-overs were most
 * of the cost). False where the source is not a regular file (a FIFO, a device, a
 * directory: opened once, never read); None, with nothing left open, where an open failed:
 * the caller then opens the slow way, which says what is wrong (or makes the partial's missing
 * directory). */
static PyObject *Pump_begin(Pump *p, PyObject *args) {
    PyObject *src_path = NULL, *dst_path = NULL;
    Py_buffer view;
    Py_ssize_t first, limit, piece;
    if (!PyArg_ParseTuple(args, "O&O&w*nnn", PyUnicode_FSConverter, &src_path,
                          PyUnicode_FSConverter, &dst_path, &view, &first, &limit, &piece)) {
        Py_XDECREF(src_path);
        Py_XDECREF(dst_path);
        return NULL;
    }
    PyObject *result = NULL;
    if (first <= 0) {
        PyErr_SetString(PyExc_ValueError, "first must be positive");
        goto done;
    }
    /* The "open" audit events os.open raises: a site's audit hooks see the pump's opens as
     * they saw the Python path's (and a hook may refuse them). */
    if (PySys_Audit("open", "OOi", src_path, Py_None, O_RDONLY | O_NONBLOCK | O_CLOEXEC) < 0 ||
        PySys_Audit("open", "OOi", dst_path, Py_None, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC) < 0)
        goto done;
    if (claim(p, &view, limit, piece) < 0) goto done;
    const char *src_name = PyBytes_AS_STRING(src_path), *dst_name = PyBytes_AS_STRING(dst_path);
    int src = -1, dst = -1, opened = 0;
    struct stat st;
    Moved m;
    int irregular = 0;
    PyThreadState *saved = PyEval_SaveThread();
    src = open(src_name, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (src >= 0 && fstat(src, &st) == 0) {
        if (S_ISREG(st.st_mode))
            dst = open(dst_name, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
        else
            irregular = 1;
    }
    if (dst >= 0) {
        opened = 1;
        move_released(p, src, dst, (char *)view.buf, (size_t)view.len, (size_t)first,
                      (size_t)limit, (size_t)piece, &m, &saved);
        if (m.ended && !m.failure) { /* read to its end and fstat'ed: not needed any more */
            close(src);
            src = -1;
        }
    } else if (src >= 0) {
        close(src);
    }
    PyEval_RestoreThread(saved);
    if (!opened) {
        p->busy = 0;
        if (p->walker && pump_walk_api->release(p->walker) < 0) goto done;
        result = Py_NewRef(irregular ? Py_False : Py_None);
        goto done;
    }
    PyObject *moved = moved_result(p, &m);
    if (!moved) { /* the caller never saw the descriptors: close them (it deletes the partial) */
        if (src >= 0) close(src);
        close(dst);
        goto done;
    }
    result = Py_BuildValue("(iiNdO)", src, dst, identity_of(&st), m.first_lag_s, moved);
    Py_DECREF(moved);
    if (!result) {
        if (src >= 0) close(src);
        close(dst);
    }
done:
    PyBuffer_Release(&view);
    Py_XDECREF(src_path);
    Py_XDECREF(dst_path);
    return result;
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
        if (!pump_walk_api || !PyObject_TypeCheck(walker, pump_walk_api->walker_type)) {
            PyErr_SetString(PyExc_TypeError, "walker must be a stager.shards._tarwalk.TarWalker");
            return -1;
        }
    }
    XXH3_64bits_reset(p->state);
    Py_XSETREF(p->walker, walker == Py_None ? NULL : Py_NewRef(walker));
    return 0;
}

/* The hash state is made here, not in __init__: a pump made by __new__ alone is usable. */
static PyObject *Pump_new(PyTypeObject *type, PyObject *Py_UNUSED(args),
                          PyObject *Py_UNUSED(kwds)) {
    Pump *p = (Pump *)type->tp_alloc(type, 0);
    if (!p) return NULL;
    if (!(p->state = XXH3_createState())) {
        Py_DECREF(p);
        return PyErr_NoMemory();
    }
    XXH3_64bits_reset(p->state);
    return (PyObject *)p;
}

static void Pump_dealloc(Pump *p) {
    XXH3_freeState(p->state);
    Py_XDECREF(p->walker);
    Py_TYPE(p)->tp_free((PyObject *)p);
}

static PyMethodDef Pump_methods[] = {
    {"move", (PyCFunction)Pump_move, METH_VARARGS,
     "move(src_fd, dst_fd, buffer, limit, piece) -> (moved, ended, lag_s, end): copy up to "
     "limit bytes, hashed and walked on the way."},
    {"begin", (PyCFunction)Pump_begin, METH_VARARGS,
     "begin(src_path, partial_path, buffer, first, limit, piece) -> None | (src_fd, dst_fd, "
     "opened, first_lag_s, (moved, ended, lag_s, end)): open both files and make the first "
     "move."},
    {"hexdigest", (PyCFunction)Pump_hexdigest, METH_NOARGS,
     "hexdigest() -> str: the xxh3_64 of every byte moved, as xxhash writes it."},
    {NULL, NULL, 0, NULL}};

static PyTypeObject PumpType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "stager.storage._bytepump.BytePump",
    .tp_basicsize = sizeof(Pump),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "BytePump(walker=None): copies a file a block per call, hashing (xxh3_64) and "
              "walking its bytes on the way, without the interpreter lock.",
    .tp_new = Pump_new,
    .tp_init = (initproc)Pump_init,
    .tp_dealloc = (destructor)Pump_dealloc,
    .tp_methods = Pump_methods,
};

static PyMethodDef module_methods[] = {
    {"copy_run", pump_copy_run, METH_VARARGS,
     "copy_run(jobs, buffer, piece, fsync, budget_s, publish) -> (results, failed): copy a run of "
     "small files whole, each to its partial, hashed, walked, checked and (where publish) "
     "renamed, in one release of the lock."},
    {"rename_run", pump_rename_run, METH_O,
     "rename_run(pairs) -> [errno or 0]: rename each (partial, final) in one release of the "
     "lock."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef bytepump_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_bytepump",
    .m_doc = "The compiled byte pump (see stager/storage/bytepath.py and copyrun.py).",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__bytepump(void) {
    if (PyType_Ready(&PumpType) < 0) return NULL;
    /* The walk is optional: without it the pump still copies and hashes. */
    PyObject *walk_module = PyImport_ImportModule("stager.shards._tarwalk");
    pump_walk_api = walk_module ? (TarWalkAPI *)PyCapsule_Import(TARWALK_CAPSULE, 0) : NULL;
    Py_XDECREF(walk_module);
    if (!pump_walk_api) PyErr_Clear();
    PyObject *m = PyModule_Create(&bytepump_module);
    if (!m) return NULL;
    Py_INCREF(&PumpType);
    if (PyModule_AddObject(m, "BytePump", (PyObject *)&PumpType) < 0) {
        Py_DECREF(&PumpType);
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "WALKS", pump_walk_api != NULL) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
