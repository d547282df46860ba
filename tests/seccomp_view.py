"""The seccomp filters a live process runs under, read from the kernel and evaluated.

`installed_filters(pid)` attaches to the process as a tracer (PTRACE_SEIZE and
PTRACE_INTERRUPT, root only), copies out each classic-BPF filter with
PTRACE_SECCOMP_GET_FILTER and detaches. `verdict(filters, nr)` runs every filter on one
call the way the kernel does, and keeps the action that takes precedence, so a test can
ask what the jail's whole filter stack does with any call number, including numbers
this kernel has no call for (where a behavioural probe only ever sees ENOSYS).
"""

from __future__ import annotations

import ctypes
import os
import struct

__all__ = [
    "AUDIT_ARCH_I386",
    "AUDIT_ARCH_X86_64",
    "ERRNO",
    "KILL_PROCESS",
    "installed_filters",
    "verdict",
]

AUDIT_ARCH_X86_64 = 0xC000003E
AUDIT_ARCH_I386 = 0x40000003
KILL_PROCESS = 0x80000000
KILL_THREAD = 0x00000000
ERRNO = 0x00050000
ALLOW = 0x7FFF0000
_ACTION_MASK = 0xFFFF0000

_PTRACE_SEIZE = 0x4206
_PTRACE_INTERRUPT = 0x4207
_PTRACE_DETACH = 17
_PTRACE_SECCOMP_GET_FILTER = 0x420C
_MAX_FILTERS = 32

Instruction = tuple[int, int, int, int]  # code, jt, jf, k

_libc = ctypes.CDLL(None, use_errno=True)
_libc.ptrace.restype = ctypes.c_long
_libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]


def _ptrace(request: int, pid: int, addr: int = 0, data: int | ctypes.Array[ctypes.c_char] | None = None) -> int:
    pointer = ctypes.cast(data, ctypes.c_void_p) if isinstance(data, ctypes.Array) else data
    result = int(_libc.ptrace(request, pid, ctypes.c_void_p(addr), pointer))
    if result == -1:
        err = ctypes.get_errno()
        raise OSError(err, f"ptrace({request:#x}, {pid}, {addr}): {os.strerror(err)}")
    return result


def installed_filters(pid: int) -> list[list[Instruction]]:
    """Every filter of `pid`, the first installed first (index 0 of the kernel's listing).

    The caller must not be `pid`'s tracer already and must not run this on two threads
    at once for one pid; the process is stopped only while the filters are copied.
    """
    _ptrace(_PTRACE_SEIZE, pid)
    try:
        _ptrace(_PTRACE_INTERRUPT, pid)
        os.waitpid(pid, os.WUNTRACED | 0x40000000)  # __WALL: a tracee that is not our child
        filters: list[list[Instruction]] = []
        for index in range(_MAX_FILTERS):
            try:
                count = _ptrace(_PTRACE_SECCOMP_GET_FILTER, pid, index)
            except OSError as exc:
                if exc.errno == 2:  # ENOENT: no filter at this index
                    break
                raise
            buffer = ctypes.create_string_buffer(count * 8)
            _ptrace(_PTRACE_SECCOMP_GET_FILTER, pid, index, buffer)
            filters.append([struct.unpack_from("<HBBI", buffer.raw, 8 * i) for i in range(count)])
        return filters
    finally:
        try:
            _ptrace(_PTRACE_DETACH, pid)
        except OSError as exc:
            if exc.errno != 3:  # ESRCH: it ended meanwhile; the error that matters is above
                raise


def _run(program: list[Instruction], data: bytes) -> int:
    """One classic-BPF seccomp filter on one `struct seccomp_data`; returns its action."""
    a = x = 0
    memory = [0] * 16
    pc = 0
    while True:
        code, jt, jf, k = program[pc]
        cls = code & 0x07
        pc += 1
        if cls == 0x00:  # BPF_LD
            mode = code & 0xE0
            if mode == 0x20:  # ABS
                (a,) = struct.unpack_from("<I", data, k)
            elif mode == 0x00:  # IMM
                a = k
            elif mode == 0x60:  # MEM
                a = memory[k]
            else:
                raise ValueError(f"BPF_LD mode {mode:#x} at {pc - 1}")
        elif cls == 0x01:  # BPF_LDX
            mode = code & 0xE0
            if mode == 0x60:  # MEM
                x = memory[k]
            elif mode == 0x00:  # IMM
                x = k
            else:
                raise ValueError(f"BPF_LDX mode {mode:#x} at {pc - 1}")
        elif cls == 0x02:  # BPF_ST
            memory[k] = a
        elif cls == 0x03:  # BPF_STX
            memory[k] = x
        elif cls == 0x04:  # BPF_ALU
            operand = x if code & 0x08 else k
            op = code & 0xF0
            a = {0x50: a & operand, 0x40: a | operand, 0xA0: a ^ operand}[op] & 0xFFFFFFFF
        elif cls == 0x05:  # BPF_JMP
            op = code & 0xF0
            if op == 0x00:  # JA
                pc += k
                continue
            operand = x if code & 0x08 else k
            taken = {0x10: a == operand, 0x20: a > operand, 0x30: a >= operand, 0x40: bool(a & operand)}[op]
            pc += jt if taken else jf
        elif cls == 0x06:  # BPF_RET
            return a if code & 0x18 == 0x10 else k
        elif cls == 0x07:  # BPF_MISC
            if code & 0xF8 == 0x00:  # TAX
                x = a
            else:  # TXA
                a = x
        else:
            raise ValueError(f"BPF class {cls:#x} at {pc - 1}")


def _precedence(action: int) -> int:
    # The kernel keeps the lowest action when read as a signed 32-bit number
    # (KILL_PROCESS < KILL_THREAD < TRAP < ERRNO < ... < ALLOW).
    masked = action & _ACTION_MASK
    return masked - (1 << 32) if masked & 0x80000000 else masked


def verdict(filters: list[list[Instruction]], nr: int, arch: int = AUDIT_ARCH_X86_64, args: tuple[int, ...] = ()) -> int:
    """What the whole stack of `filters` (as `installed_filters` lists them) returns for call
    `nr` (full value: action | data)."""
    padded = (*args, 0, 0, 0, 0, 0, 0)[:6]
    data = struct.pack("<iIQ6Q", nr if nr < 1 << 31 else nr - (1 << 32), arch, 0, *padded)
    # The kernel runs the newest filter first and keeps an earlier result on a tie, so among
    # equal actions the newest filter's data (its errno) wins: min() keeps the first minimum.
    return min((_run(f, data) for f in reversed(filters)), key=_precedence)
