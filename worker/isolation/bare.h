/*
 * bare.h: the little the gate and enter need from a C library, made of raw system calls.
 *
 * Both run once per jail. Linked against glibc, even statically, each spent about 0.4 ms
 * of CPU before main() on a virtual machine, most of it glibc asking the CPU about its
 * caches and features (dozens of CPUID instructions, each a trip to the hypervisor), which
 * neither needs: they copy a few strings and make a dozen system calls. Built with
 * -nostdlib they start in microseconds. The libc headers are still used, for constants and
 * types only; nothing of the library is linked.
 *
 * Every call returns what the kernel returns: a negative errno on failure.
 */
#ifndef CODERUNNER_BARE_H
#define CODERUNNER_BARE_H

#include <stddef.h>
#include <stdint.h>
#include <sys/mman.h>
#include <sys/syscall.h>

#if !defined(__x86_64__)
#error "bare.h makes x86-64 system calls"
#endif

static inline long bare_call(long n, long a, long b, long c, long d, long e, long f) {
    register long r10 __asm__("r10") = d;
    register long r8 __asm__("r8") = e;
    register long r9 __asm__("r9") = f;
    long ret;
    __asm__ volatile("syscall"
                     : "=a"(ret)
                     : "a"(n), "D"(a), "S"(b), "d"(c), "r"(r10), "r"(r8), "r"(r9)
                     : "rcx", "r11", "memory");
    return ret;
}

#define SYS0(n) bare_call((n), 0, 0, 0, 0, 0, 0)
#define SYS1(n, a) bare_call((n), (long)(a), 0, 0, 0, 0, 0)
#define SYS2(n, a, b) bare_call((n), (long)(a), (long)(b), 0, 0, 0, 0)
#define SYS3(n, a, b, c) bare_call((n), (long)(a), (long)(b), (long)(c), 0, 0, 0)
#define SYS4(n, a, b, c, d) bare_call((n), (long)(a), (long)(b), (long)(c), (long)(d), 0, 0)
#define SYS5(n, a, b, c, d, e) bare_call((n), (long)(a), (long)(b), (long)(c), (long)(d), (long)(e), 0)

static inline __attribute__((noreturn)) void bare_exit(int code) {
    for (;;) SYS1(SYS_exit_group, code);
}

/* The compiler may turn struct copies and zeroing into calls to these, so they exist under
 * the names it expects. (Defined here, not static: each helper is one source file.) */
void *memcpy(void *dst, const void *src, size_t n) {
    unsigned char *d = dst;
    const unsigned char *s = src;
    while (n--) *d++ = *s++;
    return dst;
}

void *memmove(void *dst, const void *src, size_t n) {
    unsigned char *d = dst;
    const unsigned char *s = src;
    if (d < s)
        while (n--) *d++ = *s++;
    else
        while (n--) d[n] = s[n];
    return dst;
}

void *memset(void *dst, int c, size_t n) {
    unsigned char *d = dst;
    while (n--) *d++ = (unsigned char)c;
    return dst;
}

int memcmp(const void *a, const void *b, size_t n) {
    const unsigned char *x = a, *y = b;
    for (; n; n--, x++, y++)
        if (*x != *y) return *x - *y;
    return 0;
}

static size_t bare_strlen(const char *s) {
    size_t n = 0;
    while (s[n]) n++;
    return n;
}

/* Writes `value` in decimal into `out` (room for 21 bytes); returns the length. */
static size_t bare_utoa(unsigned long value, char *out) {
    char digits[24];
    size_t n = 0;
    do {
        digits[n++] = (char)('0' + value % 10);
        value /= 10;
    } while (value);
    for (size_t i = 0; i < n; i++) out[i] = digits[n - 1 - i];
    return n;
}

/* A whole decimal string, optionally signed, into `*out`; -1 if it is anything else. */
static int bare_atol(const char *s, long *out) {
    int negative = *s == '-';
    if (*s == '-' || *s == '+') s++;
    if (!*s) return -1;
    unsigned long value = 0;
    for (; *s; s++) {
        if (*s < '0' || *s > '9') return -1;
        if (value > (unsigned long)INT64_MAX / 10) return -1;
        value = value * 10 + (unsigned long)(*s - '0');
    }
    if (value > (unsigned long)INT64_MAX) return -1;
    *out = negative ? -(long)value : (long)value;
    return 0;
}

__attribute__((unused)) static void bare_puts(int fd, const char *s) {
    size_t n = bare_strlen(s);
    while (n) {
        long wrote = SYS3(SYS_write, fd, s, n);
        if (wrote <= 0) return;
        s += wrote;
        n -= (size_t)wrote;
    }
}

/* Memory that is never given back (both programs exec or exit soon): anonymous pages,
 * taken a megabyte at a time, or whole for a larger request. NULL when the kernel refuses. */
__attribute__((unused)) static void *bare_alloc(size_t n) {
    static char *next;
    static size_t left;
    n = (n + 15) & ~(size_t)15;
    if (n > left) {
        size_t size = n > (1u << 20) ? n : (1u << 20);
        long got = bare_call(SYS_mmap, 0, (long)size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (got < 0 && got > -4096) return NULL;
        if (n == size) return (void *)got;
        next = (char *)got;
        left = size;
    }
    void *out = next;
    next += n;
    left -= n;
    return out;
}

int main(int argc, char **argv, char **envp);

/* The kernel starts the program with argc, argv and envp on the stack; main's return is
 * the exit code. The stack is realigned for the call as the ABI wants. */
__asm__(".pushsection .text\n"
        ".global _start\n"
        "_start:\n"
        "  xor %ebp, %ebp\n"
        "  mov %rsp, %rdi\n"
        "  and $-16, %rsp\n"
        "  call bare_start\n"
        "  hlt\n"
        ".popsection\n");

__attribute__((used, noreturn)) void bare_start(long *stack) {
    int argc = (int)stack[0];
    char **argv = (char **)(stack + 1);
    bare_exit(main(argc, argv, argv + argc + 1));
}

#endif
