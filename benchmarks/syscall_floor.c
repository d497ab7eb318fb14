/* The system calls of a verified, atomic copy of small files, and nothing else: what no copier
 * that makes them can beat (benchmarks/bench_python_floor.py --syscalls builds and runs it).
 *
 * Usage: syscall_floor SRC DST THREADS MODE < relative paths, one a line
 * The directories under DST must exist. Prints the seconds the copies took.
 * MODE:
 *   partial  stage-in's calls per shard: stat the source (the size probe); open, fstat, read
 *            it whole, read its end, fstat again (unchanged?) and close it; create
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

static void copy_one(const char *rel, char *buf, size_t cap) {
    char src[4096], dst[4096], partial[4200], fd_path[64];
    struct stat st;
    snprintf(src, sizeof src, "%s/%s", src_root, rel);
    snprintf(dst, sizeof dst, "%s/%s", dst_root, rel);
    if (stat(src, &st) < 0) return fail("stat", src);
    int in = open(src, O_RDONLY | O_CLOEXEC);
    if (in < 0 || fstat(in, &st) < 0) return fail("open", src);
    ssize_t got = read(in, buf, cap);
    if (got < 0 || read(in, buf, 1) < 0 || fstat(in, &st) < 0) return fail("read", src);
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
    if (write(out, buf, (size_t)got) != got) return fail("write", dst);
    if (mode == TMPFILE) {
        snprintf(fd_path, sizeof fd_path, "/proc/self/fd/%d", out);
        if (linkat(AT_FDCWD, fd_path, AT_FDCWD, dst, AT_SYMLINK_FOLLOW) < 0)
            return fail("link", dst);
    }
    close(out);
    if (mode == PARTIAL && rename(partial, dst) < 0) return fail("rename", partial);
    if (mode != PLAIN && stat(dst, &st) < 0) return fail("stat", dst);
}

static void *work(void *arg) {
    size_t cap = 1 << 20;
    char *buf = malloc(cap);
    if (!buf) return NULL;
    for (size_t i = (size_t)(long)arg; i < n_paths; i += (size_t)n_threads)
        copy_one(paths[i], buf, cap);
    free(buf);
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: syscall_floor SRC DST THREADS partial|tmpfile|plain < paths\n");
        return 2;
    }
    src_root = argv[1];
    dst_root = argv[2];
    n_threads = atoi(argv[3]);
    mode = !strcmp(argv[4], "tmpfile") ? TMPFILE : !strcmp(argv[4], "plain") ? PLAIN : PARTIAL;
    if (n_threads < 1 || n_threads > 256) return 2;
    size_t cap = 1024;
    paths = malloc(cap * sizeof *paths);
    char line[4096];
    while (paths && fgets(line, sizeof line, stdin)) {
        line[strcspn(line, "\n")] = 0;
        if (n_paths == cap) paths = realloc(paths, (cap *= 2) * sizeof *paths);
        if (paths) paths[n_paths++] = strdup(line);
    }
    if (!paths) return 1;
    struct timespec t0, t1;
    pthread_t threads[256];
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long t = 0; t < n_threads; t++) pthread_create(&threads[t], NULL, work, (void *)t);
    for (int t = 0; t < n_threads; t++) pthread_join(threads[t], NULL);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    printf("%.6f\n", (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9);
    return failed;
}
