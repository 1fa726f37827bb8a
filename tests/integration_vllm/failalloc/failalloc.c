/*
 * Host memory running out, at the system-call layer, for the engine tests: loaded with
 * LD_PRELOAD into an engine's processes, this fallocate() fails with ENOMEM (as the kernel
 * does when shared memory cannot be backed) from the (N+1)th allocating call on in each
 * process whose environment has FAIL_FALLOCATE_AFTER=N. Every other call goes to libc.
 *
 * elastickv's host backend resolves fallocate through the process's global symbols, so a
 * worker mapping the pages its scheduler granted meets this failure exactly where it would
 * meet a real one.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdlib.h>
#include <sys/types.h>

typedef int (*fallocate_fn)(int, int, off_t, off_t);

static long calls;

int fallocate(int fd, int mode, off_t offset, off_t len) {
    static fallocate_fn real;
    if (!real) {
        real = (fallocate_fn)dlsym(RTLD_NEXT, "fallocate");
        if (!real) {
            errno = ENOSYS;
            return -1;
        }
    }
    const char *after = getenv("FAIL_FALLOCATE_AFTER");
    if (after && mode == 0 && __atomic_add_fetch(&calls, 1, __ATOMIC_SEQ_CST) > atol(after)) {
        errno = ENOMEM;
        return -1;
    }
    return real(fd, mode, offset, len);
}
