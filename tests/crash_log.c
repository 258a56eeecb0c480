/* Preloaded into a writer process by tests/test_power_loss.py: logs every write to one file
 * (FASTDATA_CRASH_TARGET) and every flush of it, in order, so that the test can rebuild what a
 * disk could hold after a power loss at any point: everything written before the last flush
 * that completed, plus any part of what was written since.
 *
 * Log records: 'W' <offset u64> <length u64> <bytes>, or 'S' (a flush: fsync, fdatasync, or a
 * write through a descriptor opened with O_SYNC / O_DSYNC, which is durable when it returns). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

static int log_fd = -2;
static const char *target;

static ssize_t (*real_write)(int, const void *, size_t);

static void put(const void *data, size_t n) {
    const char *p = data;
    while (n > 0) {
        ssize_t k = real_write(log_fd, p, n);
        if (k <= 0) return;
        p += k;
        n -= (size_t)k;
    }
}

static int logging(int fd) {
    if (log_fd == -2) {
        real_write = dlsym(RTLD_NEXT, "write");
        target = getenv("FASTDATA_CRASH_TARGET");
        const char *path = getenv("FASTDATA_CRASH_LOG");
        log_fd = (target && path) ? open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644) : -1;
    }
    if (log_fd < 0 || fd == log_fd) return 0;
    char link[64], where[4096];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, where, sizeof where - 1);
    if (n <= 0) return 0;
    where[n] = 0;
    return strcmp(where, target) == 0;
}

static void log_sync(void) { put("S", 1); }

static void log_write(int fd, const struct iovec *iov, int count, uint64_t offset, ssize_t done) {
    if (done <= 0) return;
    uint64_t length = (uint64_t)done;
    put("W", 1);
    put(&offset, 8);
    put(&length, 8);
    for (int i = 0; i < count && length > 0; i++) {
        size_t k = iov[i].iov_len < length ? iov[i].iov_len : (size_t)length;
        put(iov[i].iov_base, k);
        length -= k;
    }
    int flags = fcntl(fd, F_GETFL);
    if (flags >= 0 && (flags & (O_SYNC | O_DSYNC))) log_sync();
}

typedef ssize_t (*pwrite_fn)(int, const void *, size_t, off_t);
typedef ssize_t (*pwritev_fn)(int, const struct iovec *, int, off_t);
typedef ssize_t (*writev_fn)(int, const struct iovec *, int);
typedef int (*sync_fn)(int);

/* the next definition of ``name`` (libc's), looked up once */
#define REAL(name, type)                                                  \
    static type real_##name;                                              \
    if (!real_##name) real_##name = (type)dlsym(RTLD_NEXT, #name)

ssize_t pwrite(int fd, const void *buf, size_t n, off_t offset) {
    REAL(pwrite, pwrite_fn);
    int on = logging(fd);
    ssize_t done = real_pwrite(fd, buf, n, offset);
    if (on) {
        struct iovec v = {(void *)buf, n};
        log_write(fd, &v, 1, (uint64_t)offset, done);
    }
    return done;
}

ssize_t pwrite64(int fd, const void *buf, size_t n, off_t offset) {
    REAL(pwrite64, pwrite_fn);
    int on = logging(fd);
    ssize_t done = real_pwrite64(fd, buf, n, offset);
    if (on) {
        struct iovec v = {(void *)buf, n};
        log_write(fd, &v, 1, (uint64_t)offset, done);
    }
    return done;
}

ssize_t pwritev(int fd, const struct iovec *iov, int count, off_t offset) {
    REAL(pwritev, pwritev_fn);
    int on = logging(fd);
    ssize_t done = real_pwritev(fd, iov, count, offset);
    if (on) log_write(fd, iov, count, (uint64_t)offset, done);
    return done;
}

ssize_t pwritev64(int fd, const struct iovec *iov, int count, off_t offset) {
    REAL(pwritev64, pwritev_fn);
    int on = logging(fd);
    ssize_t done = real_pwritev64(fd, iov, count, offset);
    if (on) log_write(fd, iov, count, (uint64_t)offset, done);
    return done;
}

ssize_t write(int fd, const void *buf, size_t n) {
    int on = logging(fd);
    off_t at = on ? lseek(fd, 0, SEEK_CUR) : 0;
    ssize_t done = real_write(fd, buf, n);
    if (on) {
        struct iovec v = {(void *)buf, n};
        log_write(fd, &v, 1, (uint64_t)at, done);
    }
    return done;
}

ssize_t writev(int fd, const struct iovec *iov, int count) {
    REAL(writev, writev_fn);
    int on = logging(fd);
    off_t at = on ? lseek(fd, 0, SEEK_CUR) : 0;
    ssize_t done = real_writev(fd, iov, count);
    if (on) log_write(fd, iov, count, (uint64_t)at, done);
    return done;
}

int fsync(int fd) {
    REAL(fsync, sync_fn);
    int on = logging(fd);
    int r = real_fsync(fd);
    if (on && r == 0) log_sync();
    return r;
}

int fdatasync(int fd) {
    REAL(fdatasync, sync_fn);
    int on = logging(fd);
    int r = real_fdatasync(fd);
    if (on && r == 0) log_sync();
    return r;
}
