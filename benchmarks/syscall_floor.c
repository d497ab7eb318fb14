/* The system calls of a verified, atomic copy of small files, and nothing else: what no copier
 * that makes them can beat (benchmarks/bench_python_floor.py --syscalls builds and runs it).
 *
 * Usage: syscall_floor SRC DST THREADS MODE < relative paths, one a line
 * The directories under DST must exist. Prints the seconds the copies took.
 * MODE:
 *   partial  stage-in's calls per shard: stat the source (the size probe); open, fstat, read
 *            it whole and to its end, fstat again (unchanged?) and close it; create
 *            <name>.partial, write, close; rename it; stat the result (the loader index's key)
 *   tmpfile  the same with an unnamed O_TMPFILE linked in place of the .partial and rename
 *   plain    as cp does: the source stat'ed, opened and read; no .partial, rename or last stat
 * No hash, no tar walk, no bookkeeping: the kernel's share of a stage-in of many small shards.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

enum { PARTIAL, TMPFILE, PLAIN };

static char **paths;
static size_t n_paths;
static int n_threads, mode;
static const char *src_root, *dst_root;
static int failed;

static void fail(const char *what, const char *path) {
    fprintf(stderr, "syscall_floor: %s %s: %s\n", what, path, strerror(errno));
    __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
}

/* Read all of `in` into *buf (grown past the file's size from fstat: a shard of any size is
 * read whole, as a run reads one), until a read finds the end, as stage-in's does; the
 * length, or -1. */
static ssize_t read_whole(int in, const struct stat *st, char **buf, size_t *cap) {
    size_t want = (size_t)st->st_size + 1;
    if (want > *cap) {
        char *grown = realloc(*buf, want);
        if (!grown) return -1;
        *buf = grown;
        *cap = want;
    }
    size_t got = 0;
    for (;;) {
        ssize_t n = read(in, *buf + got, *cap - got);
        if (n < 0) return -1;
        if (n == 0) break;
        got += (size_t)n;
        if (got == *cap) { /* grew while read: not what this benchmark measures */
            errno = EFBIG;
            return -1;
        }
    }
    return (ssize_t)got;
}

static void copy_one(const char *rel, char **buf, size_t *cap) {
    char src[4096], dst[4096], partial[4200], fd_path[64];
    struct stat st;
    snprintf(src, sizeof src, "%s/%s", src_root, rel);
    snprintf(dst, sizeof dst, "%s/%s", dst_root, rel);
    if (stat(src, &st) < 0) return fail("stat", src);
    int in = open(src, O_RDONLY | O_CLOEXEC);
    if (in < 0) return fail("open", src);
    ssize_t got = fstat(in, &st) < 0 ? -1 : read_whole(in, &st, buf, cap);
    if (got < 0 || fstat(in, &st) < 0) {
        fail("read", src);
        close(in);
        return;
    }
    close(in);
    int out;
    if (mode == TMPFILE) {
        char dir[4096];
        snprintf(dir, sizeof dir, "%s", dst);
        *strrchr(dir, '/') = 0;
        out = open(dir, O_TMPFILE | O_WRONLY | O_CLOEXEC, 0644);
    } else if (mode == PARTIAL) {
        snprintf(partial, sizeof partial, "%s.partial", dst);
        out = open(partial, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    } else {
        out = open(dst, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    }
    if (out < 0) return fail("create", dst);
    for (ssize_t done = 0; done < got;) {
        ssize_t n = write(out, *buf + done, (size_t)(got - done));
        if (n <= 0) {
            fail("write", dst);
            close(out);
            return;
        }
        done += n;
    }
    if (mode == TMPFILE) {
        snprintf(fd_path, sizeof fd_path, "/proc/self/fd/%d", out);
        if (linkat(AT_FDCWD, fd_path, AT_FDCWD, dst, AT_SYMLINK_FOLLOW) < 0) {
            fail("link", dst);
            close(out);
            return;
        }
    }
    if (close(out) < 0) return fail("close", dst);
    if (mode == PARTIAL && rename(partial, dst) < 0) return fail("rename", partial);
    if (mode != PLAIN && stat(dst, &st) < 0) return fail("stat", dst);
}

static void *work(void *arg) {
    size_t cap = 1 << 20;
    char *buf = malloc(cap);
    if (!buf) {
        errno = ENOMEM;
        fail("allocate", "a buffer");
        return NULL;
    }
    for (size_t i = (size_t)(long)arg; i < n_paths; i += (size_t)n_threads)
        copy_one(paths[i], &buf, &cap);
    free(buf);
    return NULL;
}

int main(int argc, char **argv) {
    const char *usage = "usage: syscall_floor SRC DST THREADS(1-256) partial|tmpfile|plain < paths\n";
    if (argc != 5) return fputs(usage, stderr), 2;
    src_root = argv[1];
    dst_root = argv[2];
    char *end;
    long threads = strtol(argv[3], &end, 10);
    if (*end || threads < 1 || threads > 256) return fputs(usage, stderr), 2;
    n_threads = (int)threads;
    if (!strcmp(argv[4], "partial")) mode = PARTIAL;
    else if (!strcmp(argv[4], "tmpfile")) mode = TMPFILE;
    else if (!strcmp(argv[4], "plain")) mode = PLAIN;
    else return fputs(usage, stderr), 2;
    size_t cap = 1024;
    paths = malloc(cap * sizeof *paths);
    char line[4096];
    while (paths && fgets(line, sizeof line, stdin)) {
        line[strcspn(line, "\n")] = 0;
        if (n_paths == cap) {
            char **grown = realloc(paths, (cap *= 2) * sizeof *paths);
            if (!grown) break;
            paths = grown;
        }
        if (!(paths[n_paths++] = strdup(line))) break;
    }
    if (!paths || !feof(stdin)) return fputs("syscall_floor: out of memory\n", stderr), 1;
    struct timespec t0, t1;
    pthread_t threads_[256];
    int started = 0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long t = 0; t < n_threads; t++, started++)
        if (pthread_create(&threads_[t], NULL, work, (void *)t)) {
            fputs("syscall_floor: cannot start a thread\n", stderr);
            failed = 1;
            break;
        }
    for (int t = 0; t < started; t++) pthread_join(threads_[t], NULL);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    printf("%.6f\n", (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9);
    return failed;
}
