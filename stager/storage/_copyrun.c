/* A run of small local shards copied in one call, with the interpreter lock released once for
 * the whole run: each source opened, read whole into the buffer, checked unchanged, hashed
 * (xxh3_64), shown to its tar walker and written to its partial, which is closed; then checked
 * against what the caller expects (size, hash, the walk's sample count) and, where the caller
 * says so, renamed to its final name.
 *
 * Why: copied one by one, a shard of 20 KB costs ~85 us of Python around its one compiled call
 * (the call itself ~25 us), and one interpreter runs that Python one thread at a time, so from a
 * memory-speed source stage-in ran at a quarter of `cp -r` whatever the cores. Here a run pays
 * the Python once (stager/storage/copyrun.py, then the copier books it), and the checks and
 * renames that Python made per shard, under the lock, are made here without it.
 *
 * Only what the run's caller can check in bulk is done here. A shard that fails in any way (an
 * open, a read, a write, a change during the copy, a file larger than the buffer) ends the run:
 * its partial is removed and `failed` says so; the caller copies it the one-by-one way, whose
 * errors say what is wrong, and starts a new run after it. A shard that copied but is not what
 * the caller expects is removed and the run goes on; one whose walk does not vouch for its tar
 * is left to the caller's slower checks, unrenamed. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define XXH_INLINE_ALL
#define XXH_STATIC_LINKING_ONLY
#include "vendor/xxhash.h"

#include "_bytepump.h"

#define SRC_FLAGS (O_RDONLY | O_NONBLOCK | O_CLOEXEC)
#define DST_FLAGS (O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC)

/* What became of a job that copied (one that did not ends the run: `failed`). */
enum {
    PUBLISHED = 0, /* checked and renamed to its final name */
    CHECKED = 1,   /* checked, left as its partial (the caller publishes it) */
    UNCHECKED = 2, /* its walk did not vouch for the tar: left as its partial, for the caller's
                    * slower checks (stager/shards/tarparse.py reads the copy back) */
    REFUSED = 3,   /* not what the caller expects, or not renamed: nothing of it is left */
};

#define DIGEST_LEN 24 /* "xxh3_64:" and 16 hex digits */

typedef struct {
    PyObject *src, *dst, *final; /* file system encoded paths (bytes) */
    PyObject *walker;            /* a reference held for the run, or NULL */
    Py_ssize_t expected_size, expected_samples; /* (samples: -1 where none is expected) */
    char expected_digest[DIGEST_LEN + 1];       /* "" where no hash is expected */
    int state;
    size_t size;
    XXH64_hash_t digest_value;
    char digest[DIGEST_LEN + 1]; /* as the copy's result spells it (check_job) */
    struct stat opened;
    double first_byte_s; /* from before the open to the first read's return */
    double seconds;      /* from before the open to after the partial's close */
} Job;

/* Same file, same bytes: what stager/storage/copy.py's _check_unchanged compares. */
static int unchanged(const struct stat *a, const struct stat *b, size_t copied) {
    return a->st_ino == b->st_ino && a->st_mtim.tv_sec == b->st_mtim.tv_sec &&
           a->st_mtim.tv_nsec == b->st_mtim.tv_nsec && a->st_ctim.tv_sec == b->st_ctim.tv_sec &&
           a->st_ctim.tv_nsec == b->st_ctim.tv_nsec && (size_t)b->st_size == copied;
}

/* Read `src` into `buf` until `size` bytes (its size at the open) have come or it ends; the
 * length read, or -1 with errno (EFBIG: it does not fit, or -1 in *signalled where a signal
 * handler raised). *first_read: when the first read returned.
 *
 * No read is made past `size` to see the end: the fstat after it (copy_job) compares the
 * size and times with the open's, so a file that grew or changed meanwhile is still never
 * published, and a 20 KB shard takes one read instead of two (its second returned nothing). */
static ssize_t read_whole(int src, char *buf, size_t capacity, size_t size, int *signalled,
                          double *first_read, PyThreadState **saved) {
    size_t got = 0;
    for (;;) {
        if (got == capacity) { /* full: one more byte would not fit (a file that grew) */
            errno = EFBIG;
            return -1;
        }
        if (got && got >= size) return (ssize_t)got;
        ssize_t n = read(src, buf + got, capacity - got);
        if (n < 0) {
            if (errno != EINTR) return -1;
            if (pump_handle_signals(saved) < 0) {
                *signalled = 1;
                return -1;
            }
            continue;
        }
        if (*first_read == 0.0) *first_read = pump_now_s();
        if (n == 0) return (ssize_t)got;
        got += (size_t)n;
    }
}

/* Copy one job, without the lock: 0, or nonzero with nothing left open and no partial (-1: a
 * signal handler raised). */
static int copy_job(Job *job, char *buf, size_t capacity, size_t piece, int do_fsync,
                    PyThreadState **saved) {
    double started = pump_now_s();
    const char *src_name = PyBytes_AS_STRING(job->src), *dst_name = PyBytes_AS_STRING(job->dst);
    int src = open(src_name, SRC_FLAGS);
    if (src < 0) return 1;
    struct stat end;
    if (fstat(src, &job->opened) < 0 || !S_ISREG(job->opened.st_mode) ||
        (size_t)job->opened.st_size >= capacity) {
        close(src);
        return 1;
    }
    int dst = open(dst_name, DST_FLAGS, 0666); /* as open(): the umask decides */
    if (dst < 0) {
        close(src);
        return 1;
    }
    int signalled = 0, failed = 0;
    double first_read = 0.0;
    ssize_t got = read_whole(src, buf, capacity, (size_t)job->opened.st_size, &signalled,
                             &first_read, saved);
    /* The source at its end, compared with the open's: a file rewritten during the copy is
     * never published. */
    if (got < 0 || fstat(src, &end) < 0 || !unchanged(&job->opened, &end, (size_t)got))
        failed = 1;
    close(src);
    if (!failed) {
        job->size = (size_t)got;
        job->digest_value = XXH3_64bits(buf, job->size);
        if (job->walker) pump_walk_api->feed(job->walker, (const unsigned char *)buf, job->size);
        int written = pump_write_all(dst, buf, job->size, piece, saved);
        signalled = written < 0;
        failed = written != 0 || (do_fsync && fsync(dst) < 0);
    }
    if (close(dst) < 0) failed = 1; /* (NFS scratch reports a failed write at the close) */
    if (failed || signalled) {
        unlink(dst_name);
        return signalled ? -1 : 1;
    }
    job->first_byte_s = first_read - started;
    job->seconds = pump_now_s() - started;
    return 0;
}

/* The checks stager/storage/copyrun.py made per shard, made on a copied job without the lock:
 * the size and hash expected, and where it was walked, a walk that vouches for the tar with
 * the sample count expected; then, where `publish`, its rename. Sets job->state. */
static void check_job(Job *job, int publish) {
    snprintf(job->digest, sizeof job->digest, "xxh3_64:%016llx",
             (unsigned long long)job->digest_value);
    int wrong = (Py_ssize_t)job->size != job->expected_size ||
                (job->expected_digest[0] && strcmp(job->digest, job->expected_digest) != 0);
    size_t samples = 0;
    if (!wrong && job->walker && !pump_walk_api->vouched(job->walker, &samples)) {
        job->state = UNCHECKED;
        return;
    }
    if (!wrong && job->walker && job->expected_samples >= 0)
        wrong = samples != (size_t)job->expected_samples;
    if (!wrong && publish) {
        wrong = rename(PyBytes_AS_STRING(job->dst), PyBytes_AS_STRING(job->final)) != 0;
        if (!wrong) {
            job->state = PUBLISHED;
            return;
        }
    }
    if (wrong) {
        unlink(PyBytes_AS_STRING(job->dst));
        job->state = REFUSED;
        return;
    }
    job->state = CHECKED;
}

/* A job's expected hash, kept as C text to compare without the lock: None, or a str (one that
 * is not a digest the run can make never matches: the job is refused and copied one by one). */
static int take_digest(PyObject *expected, Job *job) {
    job->expected_digest[0] = '\0';
    if (expected == Py_None) return 0;
    Py_ssize_t len;
    const char *text = PyUnicode_Check(expected) ? PyUnicode_AsUTF8AndSize(expected, &len) : NULL;
    if (!text) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "expected_hash must be a str");
        return -1;
    }
    if (len == DIGEST_LEN) memcpy(job->expected_digest, text, DIGEST_LEN + 1);
    else strcpy(job->expected_digest, "-"); /* (no digest equals it) */
    return 0;
}

/* Parse the jobs, raise their audit events ("open" as os.open does, and "os.rename" as
 * os.replace does where they are published) and claim their walkers; the number of jobs, or -1
 * with an exception and nothing claimed. The events are raised here, with the lock, for every
 * job of the run: a job the run does not reach (after the budget or a failure) raises them
 * again when it is copied. A hook that refuses one fails the whole call; the caller then copies
 * each job one by one, where the hook refuses that job alone. */
static Py_ssize_t take_jobs(PyObject *seq, Job *jobs, Py_ssize_t n, int publish) {
    Py_ssize_t i;
    for (i = 0; i < n; i++) {
        PyObject *walker = Py_None, *expected = Py_None;
        Job *job = &jobs[i];
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(seq, i),
                              "O&O&O&nOnO;a job is (src, partial, final, expected_size, "
                              "expected_hash, expected_samples, walker)",
                              PyUnicode_FSConverter, &job->src, PyUnicode_FSConverter, &job->dst,
                              PyUnicode_FSConverter, &job->final, &job->expected_size, &expected,
                              &job->expected_samples, &walker))
            goto failed;
        if (take_digest(expected, job) < 0) goto failed;
        if (walker != Py_None &&
            (!pump_walk_api || !PyObject_TypeCheck(walker, pump_walk_api->walker_type))) {
            PyErr_SetString(PyExc_TypeError, "walker must be a stager.shards._tarwalk.TarWalker");
            goto failed;
        }
        if (PySys_Audit("open", "OOi", job->src, Py_None, SRC_FLAGS) < 0 ||
            PySys_Audit("open", "OOi", job->dst, Py_None, DST_FLAGS) < 0 ||
            (publish && PySys_Audit("os.rename", "OOii", job->dst, job->final, -1, -1) < 0))
            goto failed;
        if (walker != Py_None) {
            if (pump_walk_api->claim(walker) < 0) goto failed; /* busy: another run has it */
            job->walker = Py_NewRef(walker); /* claimed: released after the run */
        }
    }
    return n;
failed:
    for (Py_ssize_t k = 0; k < i; k++)
        if (jobs[k].walker) {
            PyObject *type, *value, *traceback;
            PyErr_Fetch(&type, &value, &traceback); /* the error that stopped us wins */
            if (pump_walk_api->release(jobs[k].walker) < 0) PyErr_Clear();
            PyErr_Restore(type, value, traceback);
            Py_CLEAR(jobs[k].walker);
        }
    return -1;
}

/* `s` seconds and `ns` nanoseconds as one count of nanoseconds, in decimal, as Python prints
 * the int (past the year 2262 it passes 64 bits, so it is written from the two parts). */
static void nanoseconds_text(char *out, size_t capacity, long long s, long ns) {
    const char *sign = s < 0 ? "-" : "";
    /* the magnitude as whole seconds and the nanoseconds past them: a negative time with
     * nanoseconds is (-s - 1) seconds and (1e9 - ns) nanoseconds short of zero */
    unsigned long long whole = s >= 0 ? (unsigned long long)s
                                      : (unsigned long long)(-(s + 1)) + (ns ? 0u : 1u);
    long part = s >= 0 || !ns ? ns : 1000000000L - ns;
    if (whole) snprintf(out, capacity, "%s%llu%09ld", sign, whole, part);
    else snprintf(out, capacity, "%s%ld", sign, part);
}

/* A job's result: (state, size, "xxh3_64:<hex>", version, first_byte_s, seconds), the hash as
 * stager/storage/copy.py's results spell it and the version as identity.version_of writes it
 * from the open's stat (made here: the two strings cost ~0.8 us a shard in Python, under the
 * lock). */
static PyObject *result_of(const Job *job) {
    char mtime[32], ctime[32], version[128];
    nanoseconds_text(mtime, sizeof mtime, (long long)job->opened.st_mtim.tv_sec,
                     (long)job->opened.st_mtim.tv_nsec);
    nanoseconds_text(ctime, sizeof ctime, (long long)job->opened.st_ctim.tv_sec,
                     (long)job->opened.st_ctim.tv_nsec);
    snprintf(version, sizeof version, "%llu:%s:%s", (unsigned long long)job->opened.st_ino,
             mtime, ctime);
    return Py_BuildValue("(inssdd)", job->state, (Py_ssize_t)job->size, job->digest, version,
                         job->first_byte_s, job->seconds);
}

static PyObject *results_of(Job *jobs, Py_ssize_t done) {
    PyObject *results = PyList_New(done);
    for (Py_ssize_t i = 0; results && i < done; i++) {
        PyObject *one = result_of(&jobs[i]);
        if (!one) Py_CLEAR(results);
        else PyList_SET_ITEM(results, i, one);
    }
    return results;
}

/* Remove the partials of the first `done` jobs that still have one (not published or
 * refused): an exception ends the call with nothing of the run left unrenamed. */
static void remove_partials(Job *jobs, Py_ssize_t done) {
    for (Py_ssize_t k = 0; k < done; k++)
        if (jobs[k].state == CHECKED || jobs[k].state == UNCHECKED)
            unlink(PyBytes_AS_STRING(jobs[k].dst));
}

/* copy_run(jobs, buffer, piece, fsync, budget_s, publish) -> (results, failed)
 *
 * `jobs`: a sequence of (src_path, partial_path, final_path, expected_size, expected_hash or
 * None, expected_samples or -1, walker or None). Copies them in order, each whole through
 * `buffer` (a file as large as the buffer is refused), writes in pieces of at most `piece`
 * bytes, fsyncs each partial where `fsync`, and stops starting new ones once `budget_s`
 * seconds have passed. Each copy is then checked (check_job) and, where `publish`, renamed.
 * `results`: one (state, size, "xxh3_64:<hex>", version at the open, first_byte_s, seconds)
 * per job copied, in order (result_of; the times from before its open, to its first read's
 * return and to its end). `failed`: the job after the last result failed (its partial
 * removed); else the budget ended the run, or every job was copied. An exception (a signal
 * handler raised) removes every partial; what was published stays (each is whole and checked). */
PyObject *pump_copy_run(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *jobs_arg;
    Py_buffer view;
    Py_ssize_t piece;
    int do_fsync, publish;
    double budget_s;
    if (!PyArg_ParseTuple(args, "Ow*npdp", &jobs_arg, &view, &piece, &do_fsync, &budget_s,
                          &publish))
        return NULL;
    /* A tuple of the jobs as they are now: a list changed by a path's __fspath__ meanwhile
     * cannot make us read past its end. */
    PyObject *result = NULL, *seq = PySequence_Tuple(jobs_arg);
    Job *jobs = NULL;
    Py_ssize_t n = seq ? PyTuple_GET_SIZE(seq) : 0;
    if (!seq) goto done;
    if (piece <= 0 || view.len <= 0) {
        PyErr_SetString(PyExc_ValueError, "piece and the buffer must be positive");
        goto done;
    }
    if (!(jobs = calloc((size_t)(n ? n : 1), sizeof(Job)))) {
        PyErr_NoMemory();
        goto done;
    }
    if (take_jobs(seq, jobs, n, publish) < 0) goto done;
    Py_ssize_t done_jobs = 0;
    int failure = 0;
    PyThreadState *saved = PyEval_SaveThread();
    double started = pump_now_s();
    while (done_jobs < n) {
        if (done_jobs && pump_now_s() - started >= budget_s) break;
        failure = copy_job(&jobs[done_jobs], (char *)view.buf, (size_t)view.len, (size_t)piece,
                           do_fsync, &saved);
        if (failure) break;
        check_job(&jobs[done_jobs], publish);
        done_jobs++;
    }
    PyEval_RestoreThread(saved);
    PyObject *type = NULL, *value = NULL, *traceback = NULL;
    if (failure < 0) PyErr_Fetch(&type, &value, &traceback); /* kept over the releases below */
    for (Py_ssize_t i = 0; i < n; i++) {
        /* A walk that ran out of memory did not vouch (its copy is unrenamed): refused. */
        if (jobs[i].walker && pump_walk_api->release(jobs[i].walker) < 0) {
            PyErr_Clear();
            if (i < done_jobs && jobs[i].state == UNCHECKED) {
                unlink(PyBytes_AS_STRING(jobs[i].dst));
                jobs[i].state = REFUSED;
            }
        }
    }
    if (failure < 0) { /* a signal handler's exception */
        remove_partials(jobs, done_jobs);
        PyErr_Restore(type, value, traceback);
        goto done;
    }
    PyObject *results = results_of(jobs, done_jobs);
    if (results) result = Py_BuildValue("(NO)", results, failure ? Py_True : Py_False);
    if (!result) remove_partials(jobs, done_jobs);
done:
    if (jobs)
        for (Py_ssize_t i = 0; i < n; i++) {
            Py_XDECREF(jobs[i].src);
            Py_XDECREF(jobs[i].dst);
            Py_XDECREF(jobs[i].final);
            Py_XDECREF(jobs[i].walker);
        }
    free(jobs);
    Py_XDECREF(seq);
    PyBuffer_Release(&view);
    return result;
}

/* rename_run(pairs) -> [errno or 0 per pair]
 *
 * Rename each (partial, final) of a run, in order, with the interpreter lock released once
 * (os.replace per shard was a hand-over each, a third of a run's Python). Raises the
 * "os.rename" audit events os.replace raises. */
PyObject *pump_rename_run(PyObject *Py_UNUSED(module), PyObject *pairs_arg) {
    PyObject *seq = PySequence_Tuple(pairs_arg); /* (as copy_run: fixed while parsed) */
    if (!seq) return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(seq);
    PyObject **names = calloc((size_t)(2 * n + 1), sizeof(PyObject *));
    int *errors = calloc((size_t)(n + 1), sizeof(int));
    PyObject *result = NULL;
    Py_ssize_t i;
    if (!names || !errors) {
        PyErr_NoMemory();
        goto done;
    }
    for (i = 0; i < n; i++) {
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(seq, i), "O&O&;a pair is (partial, final)",
                              PyUnicode_FSConverter, &names[2 * i], PyUnicode_FSConverter,
                              &names[2 * i + 1]))
            goto done;
        if (PySys_Audit("os.rename", "OOii", names[2 * i], names[2 * i + 1], -1, -1) < 0)
            goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    for (i = 0; i < n; i++)
        errors[i] = rename(PyBytes_AS_STRING(names[2 * i]), PyBytes_AS_STRING(names[2 * i + 1]))
                        ? errno
                        : 0;
    Py_END_ALLOW_THREADS
    result = PyList_New(n);
    for (i = 0; result && i < n; i++) {
        PyObject *code = PyLong_FromLong(errors[i]);
        if (!code) Py_CLEAR(result);
        else PyList_SET_ITEM(result, i, code);
    }
done:
    if (names)
        for (i = 0; i < 2 * n; i++) Py_XDECREF(names[i]);
    free(names);
    free(errors);
    Py_DECREF(seq);
    return result;
}
