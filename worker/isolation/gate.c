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
 * orphans, and when the program ends it kills and reaps every process left in the
 * namespace, then reports, and exits once the worker lets it go (see linger). The program's
 * wait status goes to the worker over the status socket whose descriptor number is argv[1]:
 * "exit N" or "signal N", after the line
 * "ready" the gate writes as it starts. The program never holds that descriptor
 * (close-on-exec) and cannot reach it through /proc/1/fd (the gate is not dumpable), so
 * what the worker reads there is the truth about how the program ended, and when it reads
 * it, no process of the job is left.
 *
 * Before anything else the gate adds a second seccomp filter of its own, which the program
 * inherits (see seal_syscalls): nsjail's kafel policy is a deny-list keyed on x86-64 call
 * numbers, and two kinds of number never match it. x32 calls (bit 30 set) reach the same
 * kernel code under other numbers, so they are killed; calls newer than the last one the
 * profile was reviewed against get ENOSYS, as on a kernel that lacks them, until someone
 * reviews them and raises REVIEWED_SYSCALL_MAX (kept equal to the number in base.cfg).
 *
 * Built by the worker at start-up without a C library (bare.h); it runs as the job's
 * unprivileged uid.
 */
#include <errno.h>
#include <fcntl.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/wait.h>

#include "bare.h"

#define MAX_ITEMS 4096
#define MAX_ITEM_BYTES (1u << 20)
/* The highest call number sandbox-profiles/base.cfg was reviewed against (Linux 6.18). */
#define REVIEWED_SYSCALL_MAX 469

/* base.cfg's policy names x86-64 calls; the gate's filter is written for the same ABI. */
#if defined(__x86_64__)
#define NATIVE_AUDIT_ARCH AUDIT_ARCH_X86_64
#else
#error "the sandbox profile and the gate's seccomp filter are written for x86-64"
#endif
#define X32_SYSCALL_BIT 0x40000000u

static int read_exact(void *buf, size_t n) {
    char *p = buf;
    while (n > 0) {
        long got = SYS3(SYS_read, 0, p, n);
        if (got == 0) return -1;
        if (got < 0) {
            if (got == -EINTR) continue;
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
    char **items = bare_alloc(((size_t)*count + 1) * sizeof(char *));
    if (!items) return NULL;
    for (uint32_t i = 0; i < *count; i++) {
        uint32_t len;
        if (read_u32(&len) || len > MAX_ITEM_BYTES) return NULL;
        items[i] = bare_alloc((size_t)len + 1);
        if (!items[i] || read_exact(items[i], len)) return NULL;
        items[i][len] = '\0';
    }
    items[*count] = NULL;
    return items;
}

/* Signals a jail may have queued at once (the host's default is in the tens of thousands). */
#define JAIL_SIGPENDING 256

static void limit(int resource, uint64_t value) {
    if (value == 0) return;
    struct rlimit rl = {.rlim_cur = value, .rlim_max = value};
    struct rlimit now;
    if (SYS2(SYS_getrlimit, resource, &now) == 0 && now.rlim_max != RLIM_INFINITY && value > now.rlim_max) {
        rl.rlim_cur = rl.rlim_max = now.rlim_max; /* never try to raise */
    }
    if (SYS2(SYS_setrlimit, resource, &rl) != 0) bare_exit(124);
}

/* Returns 0, or -1 when the kernel refused the filter (the gate then ends: no program
 * runs with less than the whole policy). */
static int seal_syscalls(void) {
    struct sock_filter code[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, NATIVE_AUDIT_ARCH, 1, 0),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_KILL_PROCESS),
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JGT | BPF_K, REVIEWED_SYSCALL_MAX, 1, 0),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
        /* Past the reviewed numbers: x32's range [bit 30, bit 31) dies, the rest (newer
         * calls, and negative numbers, which the kernel answers ENOSYS anyway) get ENOSYS. */
        BPF_JUMP(BPF_JMP | BPF_JGE | BPF_K, X32_SYSCALL_BIT, 0, 2),
        BPF_JUMP(BPF_JMP | BPF_JGE | BPF_K, 0x80000000u, 1, 0),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_KILL_PROCESS),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | ENOSYS),
    };
    struct sock_fprog prog = {.len = sizeof code / sizeof code[0], .filter = code};
    /* nsjail already set no_new_privs; setting it again is harmless and makes the
     * filter installable even for a gate started some other way. */
    if (SYS5(SYS_prctl, PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) return -1;
    return SYS5(SYS_prctl, PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog, 0, 0) == 0 ? 0 : -1;
}

/* The program has ended: so does everything it left running, before the report. As the
 * namespace's init the gate can signal every other process in it, and every one of them
 * is its descendant, so once it has no child left (orphans come to it), nothing of the job
 * runs. Without this the kernel would do the same when the gate exits, but only later, in
 * the gate's own exit, after it has torn down the jail's mount namespace: the report then
 * tells the worker that the output is complete and the figures final, and it need not wait
 * for nsjail to tear the jail down. A child forked while the signal went out is caught by
 * the next round. */
static void end_the_rest(void) {
    /* Only as a namespace's init: kill(-1) from anywhere else reaches every process this
     * uid may signal outside the jail (all of them, for root), and orphans go elsewhere. A
     * gate started outside a pid namespace (by hand, or under a profile without one) ends
     * only what it started, and leaves the rest to whoever owns it. */
    if (SYS0(SYS_getpid) != 1) return;
    for (;;) {
        SYS2(SYS_kill, -1, SIGKILL);
        if (SYS4(SYS_wait4, -1, NULL, 0, NULL) == -ECHILD) return;
    }
}

/* After its report the gate stays, idle in a read, until the worker shuts its end of the
 * status socket (Jail.let_go) or dies. The jail's teardown (its mount namespace goes with
 * the gate's exit, then nsjail's own) then comes as the worker writes the job's result,
 * once it has read the job's figures, instead of taking the CPU those wait for. Nothing of the
 * job runs any more (end_the_rest). A status pipe (a gate started some other way) cannot
 * be read from this end: no wait. */
static void linger(int status_fd) {
    char byte;
    if (status_fd < 0) return;
    while (SYS3(SYS_read, status_fd, &byte, 1) == -EINTR) {
    }
}

static void report(int status_fd, int status) {
    char line[32];
    const char *what = WIFSIGNALED(status) ? "signal " : "exit ";
    size_t n = bare_strlen(what);
    memcpy(line, what, n);
    n += bare_utoa((unsigned)(WIFSIGNALED(status) ? WTERMSIG(status) : WEXITSTATUS(status)), line + n);
    line[n++] = '\n';
    if (status_fd >= 0) SYS3(SYS_write, status_fd, line, n);
}

/* The environment the program gets: the gate's own, with each "NAME=value" of `added`
 * replacing the entry of that name or appended (and a bare "NAME" removing it), as
 * putenv(3) would have made it. NULL if memory ran out. */
static char **environment(char **inherited, char **added, uint32_t addc) {
    size_t have = 0;
    while (inherited[have]) have++;
    char **env = bare_alloc((have + addc + 1) * sizeof(char *));
    if (!env) return NULL;
    memcpy(env, inherited, have * sizeof(char *));
    for (uint32_t i = 0; i < addc; i++) {
        char *entry = added[i];
        size_t name = 0;
        while (entry[name] && entry[name] != '=') name++;
        if (name == 0 && entry[0] == '\0') continue; /* unsetenv("") fails: nothing goes */
        if (entry[name] == '\0') { /* unsetenv: every entry of that name goes */
            size_t kept = 0;
            for (size_t j = 0; j < have; j++)
                if (!(memcmp(env[j], entry, name) == 0 && env[j][name] == '=')) env[kept++] = env[j];
            have = kept;
            continue;
        }
        size_t j = 0;
        while (j < have && !(memcmp(env[j], entry, name + 1) == 0)) j++;
        env[j] = entry; /* the first of that name, or a new one at the end */
        if (j == have) have++;
    }
    env[have] = NULL;
    return env;
}

int main(int gate_argc, char **gate_argv, char **gate_envp) {
    long status_fd = -1;
    if (gate_argc < 2 || bare_atol(gate_argv[1], &status_fd) || status_fd > INT32_MAX) status_fd = -1;
    if (status_fd >= 0) SYS3(SYS_fcntl, status_fd, F_SETFD, FD_CLOEXEC);
    SYS5(SYS_prctl, PR_SET_DUMPABLE, 0, 0, 0, 0);
    /* The jail is built and this process is in it, cgroups included: said first, so the
     * worker can move nsjail out of the job's cgroups (nsjail runs quiet, so its log no
     * longer says when it executes the gate). */
    if (status_fd >= 0) {
        static const char ready[] = "ready\n";
        SYS3(SYS_write, status_fd, ready, sizeof ready - 1);
    }
    if (seal_syscalls() != 0) {
        /* Said on the status socket, so a job that took this jail is an internal error, not
         * a program that "exited 126". */
        static const char fault[] = "fault seccomp\n";
        if (status_fd >= 0) SYS3(SYS_write, status_fd, fault, sizeof fault - 1);
        bare_exit(126);
    }

    /* Queued signals and POSIX message queues are counted per user at every user-namespace
     * level up to the host's, where every jail's namespace belongs to root: left at root's
     * limits, one job could take the whole host budget (and timer_create, sigqueue and RT
     * signals would fail for root and for every other job). Each jail gets a small budget of
     * its own instead; no program needs a message queue. */
    struct rlimit sigpending = {.rlim_cur = JAIL_SIGPENDING, .rlim_max = JAIL_SIGPENDING};
    struct rlimit msgqueue = {.rlim_cur = 0, .rlim_max = 0};
    /* No core dump of any kind. A limit of 0 stops core files, but the kernel ignores it for
     * a core_pattern that pipes to a helper (systemd-coredump, apport): every crash would
     * start a root process outside the jail's cgroups, fed with the job's memory. Exactly 1
     * is the one value that stops those too, and is below any core file's size. */
    struct rlimit core = {.rlim_cur = 1, .rlim_max = 1};
    if (SYS2(SYS_setrlimit, RLIMIT_SIGPENDING, &sigpending) != 0 || SYS2(SYS_setrlimit, RLIMIT_MSGQUEUE, &msgqueue) != 0 ||
        SYS2(SYS_setrlimit, RLIMIT_CORE, &core) != 0)
        bare_exit(124);

    char magic[4];
    if (read_exact(magic, 4) || memcmp(magic, "CRG1", 4) != 0) return 0;
    uint32_t argc, envc;
    char **argv = read_strings(&argc);
    if (!argv || argc == 0) return 0;
    char **env = read_strings(&envc);
    if (!env) return 0;
    uint64_t cpu_s, fsize, nofile;
    if (read_u64(&cpu_s) || read_u64(&fsize) || read_u64(&nofile)) return 0;

    char **program_env = environment(gate_envp, env, envc);
    if (!program_env) bare_exit(124);
    limit(RLIMIT_CPU, cpu_s);
    limit(RLIMIT_FSIZE, fsize);
    limit(RLIMIT_NOFILE, nofile);

    long child = SYS5(SYS_clone, SIGCHLD, 0, NULL, NULL, 0); /* fork(2), as glibc makes it */
    if (child < 0) bare_exit(125);
    if (child == 0) {
        SYS3(SYS_execve, argv[0], argv, program_env);
        /* 127 like a shell: the program could not be executed at all. */
        bare_exit(127);
    }
    /* The gate needs nothing more from stdin, and must not keep the pipe open. */
    SYS1(SYS_close, 0);
    for (;;) {
        int status;
        long pid = SYS4(SYS_wait4, -1, &status, 0, NULL);
        if (pid < 0) {
            if (pid == -EINTR) continue;
            bare_exit(125);
        }
        if (pid == child) {
            end_the_rest();
            report((int)status_fd, status);
            linger((int)status_fd);
            bare_exit(WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status));
        }
        /* An orphan the program left behind: reaped, nothing more. */
    }
}
