/* Many stat() calls for one release of the interpreter lock (see stager/storage/statmany.py).
 *
 * Why C: os.stat releases the interpreter lock for its system call and takes it back after.
 * A thread that does only that, beside copy threads that keep the lock busy, waits for the
 * lock after every stat: on tmpfs the 32 size-probe threads of a stage-in took 1.0-1.5 s for
 * 10,000 stats that take ~40 ms alone, and the copies waited on them. Here a run of paths is
 * stat'ed with the lock released once.
 *
 * stat_many(paths, budget_s) -> (results, seconds)
 *   paths: a list of str (encoded as os.stat encodes them: the filesystem encoding with
 *   surrogateescape). It stats them in order and stops after the first once budget_s seconds
 *   have been spent, so a slow filesystem never serialises many round trips on one thread:
 *   results covers a prefix of paths, at least one when paths is not empty. Each result is
 *   (st_mode, st_size, st_ino, st_mtime_ns, st_ctime_ns, st_nlink) as os.stat gives them, or
 *   the errno of a failed stat as an int. seconds: the time spent in the calls.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

static double monotonic_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* seconds * 10**9 + nanoseconds in *out, or 0 where it does not fit in 64 bits. */
static int nanoseconds_int64(long long seconds, long nanos, int64_t *out) {
    const long long limit = 9000000000LL; /* |seconds| * 10**9 stays inside 64 bits */
    if (seconds <= -limit || seconds >= limit) return 0;
    *out = (int64_t)(seconds * 1000000000LL + nanos);
    return 1;
}

/* seconds * 10**9 + nanoseconds as a Python int, exact for any time (as os.stat computes it). */
static PyObject *nanoseconds(long long seconds, long nanos) {
    int64_t fits;
    if (nanoseconds_int64(seconds, nanos, &fits)) return PyLong_FromLongLong((long long)fits);
    PyObject *s = PyLong_FromLongLong(seconds), *scale = PyLong_FromLong(1000000000L);
    PyObject *n = PyLong_FromLong(nanos), *product = NULL, *sum = NULL;
    if (s && scale && n) product = PyNumber_Multiply(s, scale);
    if (product) sum = PyNumber_Add(product, n);
    Py_XDECREF(s);
    Py_XDECREF(scale);
    Py_XDECREF(n);
    Py_XDECREF(product);
    return sum;
}

static PyObject *row_of(const struct stat *st) {
    PyObject *mtime = nanoseconds((long long)st->st_mtim.tv_sec, st->st_mtim.tv_nsec);
    PyObject *ctime = mtime ? nanoseconds((long long)st->st_ctim.tv_sec, st->st_ctim.tv_nsec)
                            : NULL;
    PyObject *row = NULL;
    if (ctime)
        row = Py_BuildValue("(lLKOOK)", (long)st->st_mode, (long long)st->st_size,
                            (unsigned long long)st->st_ino, mtime, ctime,
                            (unsigned long long)st->st_nlink);
    Py_XDECREF(mtime);
    Py_XDECREF(ctime);
    return row;
}

static PyObject *stat_many(PyObject *self, PyObject *args) {
    PyObject *given, *paths = NULL, *results = NULL, *answer = NULL;
    double budget;
    (void)self;
    if (!PyArg_ParseTuple(args, "O!d", &PyList_Type, &given, &budget)) return NULL;
    /* A copy: encoding an item may run Python (a PathLike's __fspath__), which could change
     * the caller's list under the loop. The copy holds its items for as long as we read them. */
    paths = PyList_GetSlice(given, 0, PyList_GET_SIZE(given));
    if (!paths) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(paths), done = 0, encoded = 0;
    size_t slots = n > 0 ? (size_t)n : 1;
    PyObject **names = PyMem_Calloc(slots, sizeof(PyObject *));
    struct stat *stats = PyMem_Calloc(slots, sizeof(struct stat));
    int *errors = PyMem_Calloc(slots, sizeof(int));
    if (!names || !stats || !errors) {
        PyErr_NoMemory();
        goto done;
    }
    for (; encoded < n; encoded++) {
        if (!PyUnicode_FSConverter(PyList_GET_ITEM(paths, encoded), &names[encoded])) goto done;
    }
    double spent = 0.0;
    Py_BEGIN_ALLOW_THREADS;
    double start = monotonic_s();
    while (done < n) {
        errors[done] = stat(PyBytes_AS_STRING(names[done]), &stats[done]) == 0 ? 0 : errno;
        done++;
        if (monotonic_s() - start >= budget) break;
    }
    spent = monotonic_s() - start;
    Py_END_ALLOW_THREADS;
    results = PyList_New(done);
    if (!results) goto done;
    for (Py_ssize_t i = 0; i < done; i++) {
        PyObject *item = errors[i] ? PyLong_FromLong(errors[i]) : row_of(&stats[i]);
        if (!item) goto done;
        PyList_SET_ITEM(results, i, item);
    }
    answer = Py_BuildValue("(Od)", results, spent);
done:
    if (names)
        for (Py_ssize_t i = 0; i < encoded; i++) Py_XDECREF(names[i]);
    PyMem_Free(names);
    PyMem_Free(stats);
    PyMem_Free(errors);
    Py_XDECREF(results);
    Py_DECREF(paths);
    return answer;
}

/* One path's key row: (size, changed_ns) in out[0], out[1]; 0 where the stat fails or a time
 * does not fit in 64 bits. */
static int key_row(const char *path, int64_t *out) {
    struct stat st;
    int64_t mtime, ctime;
    if (stat(path, &st) != 0 ||
        !nanoseconds_int64((long long)st.st_mtim.tv_sec, st.st_mtim.tv_nsec, &mtime) ||
        !nanoseconds_int64((long long)st.st_ctim.tv_sec, st.st_ctim.tv_nsec, &ctime))
        return 0;
    int cache_link = st.st_nlink > 1 && !(st.st_mode & 0222);
    out[0] = (int64_t)st.st_size;
    out[1] = cache_link || mtime > ctime ? mtime : ctime;
    return 1;
}

/* key_stats(paths) -> bytes | None
 *
 * The loader index key's (size, changed_ns) of each path (stager/shards/indexkey.py), as
 * native int64 pairs laid end to end: changed_ns is the later of mtime and ctime, or the
 * mtime alone for a --cache link (more than one link and no write permission), as
 * indexkey.changed_ns says. None where a stat fails or a time does not fit in 64 bits: the
 * caller then stats the Python way, which raises what os.stat raises. The lock is released
 * for all the stats, and no Python object is made per path but its encoded name: stage-in's
 * finish keys every shard it staged on a thread of its own, and the rows' Python (a tuple of
 * six per path, then a pair) held the lock the finish's main thread needed. */
static PyObject *key_stats(PyObject *self, PyObject *arg) {
    (void)self;
    if (!PyList_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "key_stats takes a list of paths");
        return NULL;
    }
    PyObject *paths = PyList_GetSlice(arg, 0, PyList_GET_SIZE(arg)); /* (as stat_many) */
    if (!paths) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(paths), encoded = 0;
    size_t slots = n > 0 ? (size_t)n : 1;
    PyObject **names = PyMem_Calloc(slots, sizeof(PyObject *));
    PyObject *packed = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(2 * slots * sizeof(int64_t)));
    PyObject *answer = NULL;
    int ok = 1;
    if (!names || !packed) {
        if (!packed) PyErr_Clear();
        PyErr_NoMemory();
        goto done;
    }
    for (; encoded < n; encoded++)
        if (!PyUnicode_FSConverter(PyList_GET_ITEM(paths, encoded), &names[encoded])) goto done;
    int64_t *out = (int64_t *)PyBytes_AS_STRING(packed);
    Py_BEGIN_ALLOW_THREADS;
    for (Py_ssize_t i = 0; i < n && ok; i++) ok = key_row(PyBytes_AS_STRING(names[i]), out + 2 * i);
    Py_END_ALLOW_THREADS;
    if (!ok) {
        answer = Py_NewRef(Py_None);
        goto done;
    }
    if (n == 0 && _PyBytes_Resize(&packed, 0) < 0) goto done; /* (one slot was made) */
    answer = packed;
    packed = NULL;
done:
    if (names)
        for (Py_ssize_t i = 0; i < encoded; i++) Py_XDECREF(names[i]);
    PyMem_Free(names);
    Py_XDECREF(packed);
    Py_DECREF(paths);
    return answer;
}

/* key_stats_joined(prefix, joined, count) -> bytes | None
 *
 * key_stats of prefix + each of the count names in joined (bytes, the names separated by one
 * NUL, none after the last): a loader's start keys every shard of a staged copy whose paths it
 * holds packed so (loaders/packedstrings.py), and a str and an encoded name per path cost a
 * million-shard start ~0.2 s and ~150 MB for nothing. None as for key_stats, and where joined
 * does not hold count names. */
static PyObject *key_stats_joined(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer prefix, joined;
    Py_ssize_t count;
    if (!PyArg_ParseTuple(args, "y*y*n", &prefix, &joined, &count)) return NULL;
    PyObject *answer = NULL;
    PyObject *packed = NULL;
    char *path = NULL;
    size_t longest = 0, at = 0;
    const char *names = joined.buf;
    size_t total = (size_t)joined.len;
    Py_ssize_t found = total ? 1 : 0;
    for (size_t i = 0, start = 0; i <= total; i++) {
        if (i == total || names[i] == '\0') {
            if (i - start > longest) longest = i - start;
            start = i + 1;
            if (i < total) found++;
        }
    }
    if (count < 0 || found != count) {
        answer = Py_NewRef(Py_None);
        goto done;
    }
    packed = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(2 * (count ? count : 1) * sizeof(int64_t)));
    path = PyMem_Malloc((size_t)prefix.len + longest + 1);
    if (!packed || !path) {
        PyErr_NoMemory();
        goto done;
    }
    memcpy(path, prefix.buf, (size_t)prefix.len);
    int64_t *out = (int64_t *)PyBytes_AS_STRING(packed);
    int ok = 1;
    Py_BEGIN_ALLOW_THREADS;
    for (Py_ssize_t i = 0; i < count && ok; i++) {
        const char *end = memchr(names + at, '\0', total - at); /* the last ends at total */
        size_t length = end ? (size_t)(end - (names + at)) : total - at;
        memcpy(path + prefix.len, names + at, length);
        path[prefix.len + length] = '\0';
        ok = key_row(path, out + 2 * i);
        at += length + 1;
    }
    Py_END_ALLOW_THREADS;
    if (!ok) {
        answer = Py_NewRef(Py_None);
        goto done;
    }
    if (count == 0 && _PyBytes_Resize(&packed, 0) < 0) goto done;
    answer = packed;
    packed = NULL;
done:
    PyMem_Free(path);
    Py_XDECREF(packed);
    PyBuffer_Release(&prefix);
    PyBuffer_Release(&joined);
    return answer;
}

static PyMethodDef statmany_methods[] = {
    {"stat_many", stat_many, METH_VARARGS,
     "stat_many(paths, budget_s) -> (results, seconds): see stager/storage/statmany.py."},
    {"key_stats", key_stats, METH_O,
     "key_stats(paths) -> bytes | None: (size, changed_ns) int64 pairs, see above."},
    {"key_stats_joined", key_stats_joined, METH_VARARGS,
     "key_stats_joined(prefix, joined, count) -> bytes | None: key_stats of NUL-joined names."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef statmany_module = {
    PyModuleDef_HEAD_INIT, "_statmany", "Many stat() calls for one release of the lock.", -1,
    statmany_methods};

/* ROW_FIELDS: the length of a result row, so that Python can tell a build of an older row
 * (an editable install not rebuilt) and not use it. */
PyMODINIT_FUNC PyInit__statmany(void) {
    PyObject *module = PyModule_Create(&statmany_module);
    if (module && PyModule_AddIntConstant(module, "ROW_FIELDS", 6) < 0) Py_CLEAR(module);
    return module;
}
