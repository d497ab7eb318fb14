/*
 * latencyfs: a read-only FUSE passthrough that sleeps a fixed delay per lookup/getattr,
 * readdir, open and read -- the C build of benchmarks/latencyfs.py (same behaviour, same
 * status file), used when a C compiler and libfuse3's headers are present.
 *
 * Why a C build: the shim stands in for an NFS server, whose CPU is on another machine. The
 * Python daemon spends ~0.7 ms of CPU per small file on this 2-core machine, taken from the
 * copier under test; this one spends a few microseconds, so what is measured is the copier.
 *
 * Usage: latencyfs SOURCE DELAY_US STATUS_FILE MOUNTPOINT [fuse options...]
 * (benchmarks/latencyfs.py builds and starts it; STATUS_FILE may be "-" for none.)
 */
#define FUSE_USE_VERSION 35
#define _GNU_SOURCE

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <fuse.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>

#ifndef FUSE_CAP_PARALLEL_DIROPS
#define FUSE_CAP_PARALLEL_DIROPS (1 << 18)
#endif

static int root_fd = -1;
static long delay_us = 0;
static const char *status_path = NULL;

static void pause_op(void) {
    if (delay_us > 0) {
        struct timespec ts = {delay_us / 1000000, (delay_us % 1000000) * 1000};
        while (nanosleep(&ts, &ts) == -1 && errno == EINTR) {
        }
    }
}

/* Paths relative to the source root ("/" -> "."), so every call is an *at() on root_fd. */
static const char *rel(const char *path) {
    while (*path == '/') path++;
    return *path ? path : ".";
}

static void *lfs_init(struct fuse_conn_info *conn, struct fuse_config *cfg) {
    (void)cfg;
    int granted = 0;
    if (conn->capable & FUSE_CAP_PARALLEL_DIROPS) {
        conn->want |= FUSE_CAP_PARALLEL_DIROPS;
        granted = (conn->want & FUSE_CAP_PARALLEL_DIROPS) != 0;
    }
    conn->max_background = 64;
    conn->congestion_threshold = 48;
    if (status_path) {
        FILE *f = fopen(status_path, "w");
        if (f) {
            fprintf(f, "parallel_dirops=%d\n", granted);
            fclose(f);
        }
    }
    return NULL;
}

static int lfs_getattr(const char *path, struct stat *st, struct fuse_file_info *fi) {
    (void)fi;
    pause_op();
    return fstatat(root_fd, rel(path), st, AT_SYMLINK_NOFOLLOW) == -1 ? -errno : 0;
}

static int lfs_readdir(const char *path, void *buf, fuse_fill_dir_t fill, off_t offset,
                       struct fuse_file_info *fi, enum fuse_readdir_flags flags) {
    (void)offset, (void)fi, (void)flags;
    pause_op();
    int fd = openat(root_fd, rel(path), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd == -1) return -errno;
    DIR *dir = fdopendir(fd);
    if (!dir) {
        int err = errno;
        close(fd);
        return -err;
    }
    struct dirent *entry;
    while ((entry = readdir(dir)) != NULL) {
        if (fill(buf, entry->d_name, NULL, 0, 0)) break;
    }
    closedir(dir);
    return 0;
}

static int lfs_open(const char *path, struct fuse_file_info *fi) {
    pause_op();
    if ((fi->flags & O_ACCMODE) != O_RDONLY) return -EROFS;
    int fd = openat(root_fd, rel(path), O_RDONLY | O_CLOEXEC);
    if (fd == -1) return -errno;
    fi->fh = (uint64_t)fd;
    return 0;
}

static int lfs_read(const char *path, char *buf, size_t size, off_t offset,
                    struct fuse_file_info *fi) {
    (void)path;
    pause_op();
    ssize_t n = pread((int)fi->fh, buf, size, offset);
    return n == -1 ? -errno : (int)n;
}

static int lfs_release(const char *path, struct fuse_file_info *fi) {
    (void)path;
    close((int)fi->fh);
    return 0;
}

static int lfs_statfs(const char *path, struct statvfs *st) {
    (void)path;
    return fstatvfs(root_fd, st) == -1 ? -errno : 0;
}

static const struct fuse_operations ops = {
    .init = lfs_init,
    .getattr = lfs_getattr,
    .readdir = lfs_readdir,
    .open = lfs_open,
    .read = lfs_read,
    .release = lfs_release,
    .statfs = lfs_statfs,
};

int main(int argc, char *argv[]) {
    if (argc < 5) {
        fprintf(stderr, "usage: %s SOURCE DELAY_US STATUS_FILE MOUNTPOINT [fuse options]\n",
                argv[0]);
        return 2;
    }
    root_fd = open(argv[1], O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (root_fd == -1) {
        fprintf(stderr, "latencyfs: cannot open source %s: %s\n", argv[1], strerror(errno));
        return 2;
    }
    delay_us = strtol(argv[2], NULL, 10);
    status_path = strcmp(argv[3], "-") ? argv[3] : NULL;
    /* fuse_main sees: argv[0] MOUNTPOINT [options] */
    argv[3] = argv[0];
    return fuse_main(argc - 3, argv + 3, &ops, NULL);
}
