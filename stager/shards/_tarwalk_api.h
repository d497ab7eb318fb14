/* What the compiled tar walk (stager/shards/_tarwalk.c) offers other extensions, through the
 * capsule TARWALK_CAPSULE: the byte pump (stager/storage/_bytepump.c) feeds a walker the bytes
 * it copies, in the same release of the interpreter lock as the read, the hash and the write,
 * instead of one release per call from Python. */
#ifndef STAGER_TARWALK_API_H
#define STAGER_TARWALK_API_H
#include <Python.h>
#include <stddef.h>

#define TARWALK_CAPSULE "stager.shards._tarwalk._C_API"

typedef struct {
    /* the TarWalker type, to check an object before using it as one */
    PyTypeObject *walker_type;
    /* With the lock held: mark the walker busy for a run of feeds; 0, or -1 with an exception
     * set where it is already busy (two threads at once). */
    int (*claim)(PyObject *walker);
    /* Without the lock, between claim and release: the tar's next `len` bytes. */
    void (*feed)(PyObject *walker, const unsigned char *data, size_t len);
    /* With the lock held: end the run; 0, or -1 with MemoryError set where a feed ran out. */
    int (*release)(PyObject *walker);
    /* Without the lock, between claim and release, after the last feed: 1 where the walk
     * vouches for the tar (finish() would return its index) with its sample count in
     * *samples, else 0. A copy checks a manifest's count with it before its rename. */
    int (*vouched)(PyObject *walker, size_t *samples);
} TarWalkAPI;

#endif
