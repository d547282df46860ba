/*
 * coderunner gate: the first program in every jail.
 *
 * nsjail starts it with the jail fully built (namespaces, mounts, uid maps, cgroups); it
 * then blocks on stdin until the worker sends one frame saying what to run:
 *
 *   "CRG1"
 *   u32 argc,  argc x (u32 len, bytes)        program argv (argv[0] is an absolute path)
 *   u32 envc,  envc x (u32 len, bytes)        "NAME=value" added to the inherited environment
 *   u64 cpu_seconds, u64 fsize_bytes, u64 nofile   rlimits (soft = hard), 0 = leave as is
 *
 * (integers little-endian). It lowers the rlimits, forks, and the child execs the program;
 * stdin continues with the bytes after the frame (read with exact-size read(2)s so no
 * user stdin is consumed by accident). EOF or a malformed frame ends the gate quietly:
 * the job never started.
 *
 * The gate stays pid 1 of the jail's pid namespace, so the program is an ordinary
 * process: the kernel drops signals a namespace's init sends itself, which would turn
 * abort() into SIGSEGV and make kill(getpid(), SIGTERM) a no-op. As init, the gate reaps
 * orphans, and when the program ends it exits at once, which ends every process left in
 * the namespace. The program's wait status goes to the worker over the status pipe whose
 * descriptor number is argv[1]: "exit N" or "signal N". The program never holds that
 * descriptor (close-on-exec) and cannot reach it through /proc/1/fd (the gate is not
 * dumpable), so what the worker reads there is the truth about how the program ended.
 *
 * Built statically by the worker at start-up; it runs as the job's unprivileged uid.
 */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#define MAX_ITEMS 4096
#define MAX_ITEM_BYTES (1u << 20)

extern char **environ;

static int read_exact(void *buf, size_t n) {
    char *p = buf;
    while (n > 0) {
        ssize_t got = read(0, p, n);
        if (got == 0) return -1;
        if (got < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        p += got;
        n -= (size_t)got;
    }
    return 0;
}

static int read_u32(uint32_t *out) {
    unsigned char b[4];
    if (read_exact(b, 4)) return -1;
    *out = (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24;
    return 0;
}

static int read_u64(uint64_t *out) {
    unsigned char b[8];
    if (read_exact(b, 8)) return -1;
    *out = 0;
    for (int i = 7; i >= 0; i--) *out = (*out << 8) | b[i];
    return 0;
}

static char **read_strings(uint32_t *count) {
    if (read_u32(count) || *count > MAX_ITEMS) return NULL;
    char **items = calloc((size_t)*count + 1, sizeof(char *));
    if (!items) return NULL;
    for (uint32_t i = 0; i < *count; i++) {
        uint32_t len;
        if (read_u32(&len) || len > MAX_ITEM_BYTES) return NULL;
        items[i] = malloc((size_t)len + 1);
        if (!items[i] || read_exact(items[i], len)) return NULL;
        items[i][len] = '\0';
    }
    return items;
}

static void limit(int resource, uint64_t value) {
    if (value == 0) return;
    struct rlimit rl = {.rlim_cur = value, .rlim_max = value};
    struct rlimit now;
    if (getrlimit(resource, &now) == 0 && now.rlim_max != RLIM_INFINITY && value > now.rlim_max) {
        rl.rlim_cur = rl.rlim_max = now.rlim_max; /* never try to raise */
    }
    if (setrlimit(resource, &rl) != 0) _exit(124);
}

static void report(int status_fd, int status) {
    char line[32];
    int n = WIFSIGNALED(status) ? snprintf(line, sizeof line, "signal %d\n", WTERMSIG(status))
                                : snprintf(line, sizeof line, "exit %d\n", WEXITSTATUS(status));
    if (status_fd >= 0 && n > 0) {
        ssize_t ignored = write(status_fd, line, (size_t)n);
        (void)ignored;
    }
}

int main(int gate_argc, char **gate_argv) {
    int status_fd = gate_argc > 1 ? atoi(gate_argv[1]) : -1;
    if (status_fd >= 0) fcntl(status_fd, F_SETFD, FD_CLOEXEC);
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);

    char magic[4];
    if (read_exact(magic, 4) || memcmp(magic, "CRG1", 4) != 0) return 0;
    uint32_t argc, envc;
    char **argv = read_strings(&argc);
    if (!argv || argc == 0) return 0;
    char **env = read_strings(&envc);
    if (!env) return 0;
    uint64_t cpu_s, fsize, nofile;
    if (read_u64(&cpu_s) || read_u64(&fsize) || read_u64(&nofile)) return 0;

    for (uint32_t i = 0; i < envc; i++) {
        if (putenv(env[i]) != 0) _exit(124);
    }
    limit(RLIMIT_CPU, cpu_s);
    limit(RLIMIT_FSIZE, fsize);
    limit(RLIMIT_NOFILE, nofile);

    pid_t child = fork();
    if (child < 0) _exit(125);
    if (child == 0) {
        execve(argv[0], argv, environ);
        /* 127 like a shell: the program could not be executed at all. */
        _exit(127);
    }
    /* The gate needs nothing more from stdin, and must not keep the pipe open. */
    close(0);
    for (;;) {
        int status;
        pid_t pid = waitpid(-1, &status, 0);
        if (pid < 0) {
            if (errno == EINTR) continue;
            _exit(125);
        }
        if (pid == child) {
            report(status_fd, status);
            _exit(WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status));
        }
        /* An orphan the program left behind: reaped, nothing more. */
    }
}
