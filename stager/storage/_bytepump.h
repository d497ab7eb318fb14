/* What the two files of the byte pump extension share: _bytepump.c (a shard a block per call)
 * and _copyrun.c (a run of small shards in one call). */
#ifndef STAGER_BYTEPUMP_H
#define STAGER_BYTEPUMP_H
#include <Python.h>

#include "../shards/_tarwalk_api.h"

/* NULL where the tar walk was not built (set by the module's init). */
extern TarWalkAPI *pump_walk_api;

/* Seconds on the monotonic clock. */
double pump_now_s(void);

/* An interrupted system call: take the lock back and run Python's signal handlers, as os.read
 * would; -1 where one raised. */
int pump_handle_signals(PyThreadState **saved);

/* Write all `len` bytes in pieces of at most `piece`; 0, an errno, or -1 (a handler raised). */
int pump_write_all(int fd, const char *data, size_t len, size_t piece, PyThreadState **saved);

/* copy_run(jobs, buffer, piece, fsync, budget_s, publish) -> (results, failed): _copyrun.c. */
PyObject *pump_copy_run(PyObject *module, PyObject *args);

/* rename_run(pairs) -> [errno or 0]: see _copyrun.c. */
PyObject *pump_rename_run(PyObject *module, PyObject *pairs);

#endif
