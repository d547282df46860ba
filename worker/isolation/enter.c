/*
 * coderunner enter: tie itself to the worker, join a sandbox's cgroups, then become nsjail.
 *
 *   enter PARENT_PID N PROCS_FILE... PROGRAM ARG...
 *
 * asks for SIGKILL when the worker thread that spawned it dies (PR_SET_PDEATHSIG, kept
 * across the exec of nsjail, which is neither set-id nor file-capable), writes its own pid
 * into each of the N cgroup.procs files, then execs PROGRAM, so nsjail and the jail it
 * clones are born inside the sandbox's cgroups (no window in which the jail runs outside
 * them). nsjail in turn ties the jail's first process to itself, so a worker killed with
 * SIGKILL takes its running programs with it at once, instead of leaving them to nsjail's
 * backstop or another worker's janitor. If the worker is already gone (PARENT_PID is no
 * longer the parent) or any write fails, it exits 125 before anything is executed.
 *
 * It runs on the host as root, spawned by the worker for every jail: it replaces a
 * `/bin/sh -c` doing the same, which cost a dynamic shell's start-up (about 0.7 ms of CPU
 * here) on every jail. Built by the worker at start-up without a C library (bare.h), next
 * to the gate. PROGRAM is run as execvp(3) would: a name without a slash is looked for
 * on PATH.
 */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>

#include "bare.h"

static int fail(const char *message) {
    bare_puts(2, "enter: ");
    bare_puts(2, message);
    bare_puts(2, "\n");
    return 125;
}

/* "what: error N" on stderr (no strerror without a C library; the number says it). */
static void report(const char *what, long error) {
    char number[24];
    number[bare_utoa((unsigned long)-error, number)] = '\0';
    bare_puts(2, what);
    bare_puts(2, ": error ");
    bare_puts(2, number);
    bare_puts(2, "\n");
}

static const char *lookup(char **envp, const char *name) {
    size_t n = bare_strlen(name);
    for (; *envp; envp++)
        if (memcmp(*envp, name, n) == 0 && (*envp)[n] == '=') return *envp + n + 1;
    return NULL;
}

/* execvp(3)'s search, without its fallback to /bin/sh for a file with no #! line. */
static long exec_program(char **program, char **envp) {
    const char *file = program[0];
    size_t length = bare_strlen(file);
    for (size_t i = 0; i < length; i++)
        if (file[i] == '/') return SYS3(SYS_execve, file, program, envp);
    const char *path = lookup(envp, "PATH");
    if (!path) path = "/bin:/usr/bin";
    long error = -ENOENT;
    char candidate[4096];
    for (;;) {
        const char *end = path;
        while (*end && *end != ':') end++;
        size_t dir = (size_t)(end - path);
        if ((dir ? dir : 1) + 2 + length > sizeof candidate) {
            if (error == -ENOENT) error = -ENAMETOOLONG;
        } else {
            size_t at = 0;
            if (dir == 0) candidate[at++] = '.'; /* an empty entry is the current folder */
            memcpy(candidate + at, path, dir);
            at += dir;
            candidate[at++] = '/';
            memcpy(candidate + at, file, length + 1);
            long got = SYS3(SYS_execve, candidate, program, envp);
            /* As execvp: EACCES is remembered while the search goes on; a folder that is
             * missing, not one, stale or unreachable is passed over; anything else ends it. */
            if (got == -EACCES) error = got;
            else if (got != -ENOENT && got != -ENOTDIR && got != -ESTALE && got != -ENODEV && got != -ETIMEDOUT)
                return got;
        }
        if (!*end) return error;
        path = end + 1;
    }
}

int main(int argc, char **argv, char **envp) {
    if (argc < 4) return fail("usage: enter PARENT_PID N PROCS_FILE... PROGRAM ARG...");
    long parent;
    if (bare_atol(argv[1], &parent) || parent <= 0) return fail("bad parent pid");
    /* Checked after the prctl: a parent that died before it would never signal. */
    if (SYS5(SYS_prctl, PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) != 0 || SYS0(SYS_getppid) != parent)
        return fail("the worker is gone");
    long n;
    if (bare_atol(argv[2], &n) || n < 0 || n > argc - 4) return fail("bad cgroup count");
    char pid[24];
    size_t len = bare_utoa((unsigned long)SYS0(SYS_getpid), pid);
    pid[len++] = '\n';
    for (long i = 0; i < n; i++) {
        const char *path = argv[3 + i];
        long fd = SYS4(SYS_openat, AT_FDCWD, path, O_WRONLY | O_CLOEXEC, 0);
        long wrote = fd < 0 ? fd : SYS3(SYS_write, fd, pid, len);
        if (wrote != (long)len) {
            report(path, wrote < 0 ? wrote : -EIO);
            return 125;
        }
        SYS1(SYS_close, fd);
    }
    char **program = argv + 3 + n;
    report(program[0], exec_program(program, envp));
    return 127;
}
