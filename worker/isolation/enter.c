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
 * here) on every jail. Built statically by the worker at start-up, next to the gate.
 */
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <unistd.h>

int main(int argc, char **argv) {
    if (argc < 4) {
        fputs("usage: enter PARENT_PID N PROCS_FILE... PROGRAM ARG...\n", stderr);
        return 125;
    }
    char *end;
    long parent = strtol(argv[1], &end, 10);
    if (*argv[1] == '\0' || *end != '\0' || parent <= 0) {
        fputs("enter: bad parent pid\n", stderr);
        return 125;
    }
    /* Checked after the prctl: a parent that died before it would never signal. */
    if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() != (pid_t)parent) {
        fputs("enter: the worker is gone\n", stderr);
        return 125;
    }
    long n = strtol(argv[2], &end, 10);
    if (*argv[2] == '\0' || *end != '\0' || n < 0 || n > argc - 4) {
        fputs("enter: bad cgroup count\n", stderr);
        return 125;
    }
    char pid[24];
    int len = snprintf(pid, sizeof pid, "%d\n", (int)getpid());
    for (long i = 0; i < n; i++) {
        const char *path = argv[3 + i];
        int fd = open(path, O_WRONLY | O_CLOEXEC);
        if (fd < 0 || write(fd, pid, (size_t)len) != len) {
            perror(path);
            return 125;
        }
        close(fd);
    }
    char **program = argv + 3 + n;
    execvp(program[0], program);
    perror(program[0]);
    return 127;
}
