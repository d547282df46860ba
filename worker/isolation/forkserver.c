/*
 * coderunner nsjail fork server: nsjail's own code, loaded once, forked for every jail.
 *
 *   nsjail-forkserver PARENT_PID ROOM   (fd 0: a SOCK_SEQPACKET socket to the worker;
 *                                        ROOM: spaces, the room for the children's titles)
 *
 * Every jail used to cost an exec of nsjail: the kernel mapping a 5 MB binary, the dynamic
 * loader relocating it, glibc asking the CPU about its caches (some 80 CPUID instructions,
 * each a trip to the hypervisor on a virtual machine: about 0.6 ms of CPU here on its own)
 * and protobuf registering its descriptors (and building more of them, and a JSON type
 * resolver, when nsjail parses its config: forkserver_warm.cc does that part once, before
 * any fork). This program is linked from the same objects
 * as the nsjail binary (scripts/build-nsjail.sh renames nsjail's main() to nsjail_main()),
 * pays all of that once, then waits. For each spawn request the worker sends, it forks; the
 * child does what `enter` (worker/isolation/enter.c) does before its exec of nsjail, and
 * then calls nsjail_main() with the request's argv, in a process no other jail ever touched:
 * the server itself never parses a flag or builds a jail, so each child starts from
 * nsjail's pristine state (but for what forkserver_warm.cc keeps: a config file's parse and
 * its seccomp program, taken only for the same bytes, and glibc's lookup modules), and its
 * namespaces, mounts and jail are its own, as with an exec.
 *
 * Requests (one datagram each; integers are native u32/i32):
 *   'S' id nfds target[nfds] ncgroups argc, then ncgroups cgroup.procs paths and argc
 *       arguments, each NUL-terminated; nfds descriptors ride along (SCM_RIGHTS) and become
 *       fds target[0..] in the child, which keeps no other descriptor.
 *       Reply: 'S' id pid (or -errno when the fork failed).
 *   'R' pid: reap that child, which the worker has seen exit (its pidfd).
 *       Reply: 'R' pid found wait-status (found is 0 when it was not a child or still runs).
 * Children are reaped only when asked: until then a child's pid stays its own (a zombie),
 * so the worker may still name it, as it does its own children (worker/isolation/child.py).
 *
 * The child, in order: a session of its own; its descriptors; SIGKILL when this server
 * dies (checked after the prctl: a server that died before it would never signal); its pid
 * written into each cgroup.procs file, so the jail nsjail clones is born inside the job's
 * cgroups. A failure there says why on fd 2 and exits 125, as `enter` does. The server asks
 * for SIGKILL when the worker thread that spawned it dies, and exits when the worker closes
 * the socket; either way its children get their SIGKILL, and nsjail takes its jail along.
 * The socket is the only way in: a socketpair the worker made, inherited by nothing else.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

int nsjail_main(int argc, char **argv);
void nsjail_warm_config_parsers(void); /* forkserver_warm.cc */
void nsjail_cache_config(const char *path); /* forkserver_warm.cc */

#define SOCKET_FD 0
#define MAX_MESSAGE (1 << 20)
#define MAX_FDS 16
#define MAX_ARGS 8192
#define MAX_CGROUPS 16

struct request {
    uint32_t id;
    uint32_t nfds;
    uint32_t targets[MAX_FDS];
    uint32_t ncgroups;
    char *cgroups[MAX_CGROUPS];
    uint32_t argc;
    char *argv[MAX_ARGS + 1];
};

static unsigned char message[MAX_MESSAGE];
static pid_t server_pid;

static int take_u32(const unsigned char **at, const unsigned char *end, uint32_t *value) {
    if ((size_t)(end - *at) < sizeof *value) return -1;
    memcpy(value, *at, sizeof *value);
    *at += sizeof *value;
    return 0;
}

static int take_string(unsigned char **at, unsigned char *end, char **value) {
    unsigned char *nul = memchr(*at, '\0', (size_t)(end - *at));
    if (!nul) return -1;
    *value = (char *)*at;
    *at = nul + 1;
    return 0;
}

static int parse_spawn(unsigned char *body, size_t size, struct request *r) {
    const unsigned char *at = body;
    unsigned char *end = body + size;
    if (take_u32(&at, end, &r->id) || take_u32(&at, end, &r->nfds) || r->nfds > MAX_FDS) return -1;
    for (uint32_t i = 0; i < r->nfds; i++)
        if (take_u32(&at, end, &r->targets[i]) || r->targets[i] > 1u << 20) return -1;
    if (take_u32(&at, end, &r->ncgroups) || r->ncgroups > MAX_CGROUPS) return -1;
    if (take_u32(&at, end, &r->argc) || r->argc == 0 || r->argc > MAX_ARGS) return -1;
    unsigned char *strings = (unsigned char *)at;
    for (uint32_t i = 0; i < r->ncgroups; i++)
        if (take_string(&strings, end, &r->cgroups[i])) return -1;
    for (uint32_t i = 0; i < r->argc; i++)
        if (take_string(&strings, end, &r->argv[i])) return -1;
    r->argv[r->argc] = NULL;
    return strings == end ? 0 : -1;
}

static void say(const char *what, int error) {
    dprintf(2, "enter: %s: %s\n", what, strerror(error));
}

/* Descriptors: each received one to its target number, nothing else kept open. */
static int place_fds(const struct request *r, const int *received) {
    uint32_t floor = 3;
    for (uint32_t i = 0; i < r->nfds; i++)
        if (r->targets[i] + 1 > floor) floor = r->targets[i] + 1;
    int moved[MAX_FDS];
    /* Above every target first, so no dup2 below closes a descriptor still to be placed. */
    for (uint32_t i = 0; i < r->nfds; i++)
        if ((moved[i] = fcntl(received[i], F_DUPFD_CLOEXEC, (int)floor)) < 0) return -1;
    for (uint32_t i = 0; i < r->nfds; i++)
        if (dup2(moved[i], (int)r->targets[i]) < 0) return -1; /* (clears close-on-exec) */
    /* Close every other descriptor: the gaps between the targets, and all above them. */
    unsigned int from = 0;
    for (;;) {
        unsigned int next = ~0u; /* the lowest target at or above `from` */
        for (uint32_t i = 0; i < r->nfds; i++)
            if (r->targets[i] >= from && r->targets[i] < next) next = r->targets[i];
        if (next == ~0u) return close_range(from, ~0u, 0);
        if (next > from && close_range(from, next - 1, 0) != 0) return -1;
        from = next + 1;
    }
}

/* /proc/<pid>/cmdline (ps, and the tests' view of a jail) shows the nsjail argv this child
 * runs, as after an exec, not the server's. The worker starts the server with a long last
 * argument of spaces (FORKSERVER_TITLE_ROOM in forkserver.py), so its argument area has
 * room: the child writes nsjail's arguments there, NUL-separated, and NULs over the rest
 * (the kernel shows the whole area when it ends in a NUL). An argv too long for the room is
 * cut at the last whole argument that fits. (prctl(PR_SET_MM) would move the area instead,
 * but wants CAP_SYS_RESOURCE, which containers often drop.) */
static char *title_start, *title_end;

static void show_argv(const struct request *r) {
    size_t room = (size_t)(title_end - title_start), at = 0;
    for (uint32_t i = 0; i < r->argc; i++) {
        size_t length = strlen(r->argv[i]) + 1;
        if (at + length > room) break;
        memcpy(title_start + at, r->argv[i], length);
        at += length;
    }
    memset(title_start + at, 0, room - at);
}

static void child(struct request *r, const int *received) {
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    setsid();
    if (place_fds(r, received) != 0) _exit(125);
    if (prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) != 0 || getppid() != server_pid) {
        dprintf(2, "enter: the worker is gone\n");
        _exit(125);
    }
    show_argv(r);
    char pid[24];
    int length = snprintf(pid, sizeof pid, "%d\n", (int)getpid());
    for (uint32_t i = 0; i < r->ncgroups; i++) {
        int fd = open(r->cgroups[i], O_WRONLY | O_CLOEXEC);
        ssize_t wrote = fd < 0 ? -1 : write(fd, pid, (size_t)length);
        if (wrote != length) {
            say(r->cgroups[i], wrote < 0 ? errno : EIO);
            _exit(125);
        }
        close(fd);
    }
    exit(nsjail_main((int)r->argc, r->argv));
}

static void reply(const void *body, size_t size) {
    /* A worker that stopped reading is gone or going; its close ends the loop below. */
    while (send(SOCKET_FD, body, size, MSG_NOSIGNAL) < 0 && errno == EINTR) {
    }
}

/* The config file the request names is parsed here, and its seccomp policy compiled, once
 * for as long as its bytes stay the same: each child then takes them ready-made
 * (forkserver_warm.cc says how that stays exactly what its own parse would give). */
static void cache_config(const struct request *r) {
    for (uint32_t i = 1; i < r->argc; i++) {
        if (strcmp(r->argv[i], "--") == 0) return;
        if ((strcmp(r->argv[i], "--config") == 0 || strcmp(r->argv[i], "-C") == 0) && i + 1 < r->argc) {
            nsjail_cache_config(r->argv[i + 1]);
            return;
        }
        if (strncmp(r->argv[i], "--config=", 9) == 0) {
            nsjail_cache_config(r->argv[i] + 9);
            return;
        }
    }
}

static void spawn(unsigned char *body, size_t size, const int *received, int nreceived) {
    static struct request r;
    struct {
        unsigned char kind;
        uint32_t id;
        int32_t pid;
    } __attribute__((packed)) answer = {'S', 0, -EINVAL};
    r.id = 0;
    int parsed = parse_spawn(body, size, &r);
    answer.id = r.id; /* (read first: a malformed request's answer still names it) */
    if (parsed == 0) {
        if ((int)r.nfds != nreceived) {
            answer.pid = -EBADF;
        } else {
            cache_config(&r);
            pid_t pid = fork();
            if (pid == 0) child(&r, received);
            answer.pid = pid < 0 ? -errno : pid;
        }
    }
    reply(&answer, sizeof answer);
}

static void reap(unsigned char *body, size_t size) {
    const unsigned char *at = body;
    uint32_t pid = 0;
    struct {
        unsigned char kind;
        uint32_t pid;
        int32_t found;
        int32_t status;
    } __attribute__((packed)) answer = {'R', 0, 0, 0};
    if (take_u32(&at, body + size, &pid) == 0 && pid > 0 && pid <= INT32_MAX) {
        int status = 0;
        answer.pid = pid;
        if (waitpid((pid_t)pid, &status, WNOHANG) == (pid_t)pid) {
            answer.found = 1;
            answer.status = status;
        }
    }
    reply(&answer, sizeof answer);
}

int main(int argc, char **argv) {
    if (argc != 3) {
        dprintf(2, "usage: nsjail-forkserver PARENT_PID ROOM\n");
        return 125;
    }
    title_start = argv[0];
    title_end = argv[2] + strlen(argv[2]) + 1;
    long parent = strtol(argv[1], NULL, 10);
    if (prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) != 0 || getppid() != parent) {
        dprintf(2, "nsjail-forkserver: the worker is gone\n");
        return 125;
    }
    server_pid = getpid();
    nsjail_warm_config_parsers();
    signal(SIGCHLD, SIG_DFL); /* (children stay zombies until reaped on request) */
    for (;;) {
        union {
            struct cmsghdr header;
            char space[CMSG_SPACE(sizeof(int) * MAX_FDS)];
        } control;
        struct iovec iov = {message, sizeof message};
        struct msghdr msg = {0};
        msg.msg_iov = &iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.space;
        msg.msg_controllen = sizeof control.space;
        ssize_t got = recvmsg(SOCKET_FD, &msg, MSG_CMSG_CLOEXEC);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) return 0; /* the worker closed its end, or is gone */
        int received[MAX_FDS];
        int nreceived = 0;
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
            if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
            int count = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
            for (int i = 0; i < count; i++) {
                int fd;
                memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
                if (nreceived < MAX_FDS) received[nreceived++] = fd;
                else close(fd);
            }
        }
        /* A cut-off request is refused (its descriptors cannot all be there), not guessed at. */
        int whole = (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) == 0;
        if (got >= 1) {
            if (message[0] == 'S') spawn(message + 1, (size_t)got - 1, received, whole ? nreceived : -1);
            else if (message[0] == 'R') reap(message + 1, (size_t)got - 1);
        }
        for (int i = 0; i < nreceived; i++) close(received[i]);
    }
}
