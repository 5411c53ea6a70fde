"""The sandbox's seccomp filter, as the classic BPF program bwrap loads with `--seccomp FD`.

It denies (EPERM) what a confined process needs only to break out or to reach the kernel's less-trodden parts:
new namespaces (unshare, setns, clone with a CLONE_NEW* flag), mounting, ptrace and process_vm_*, keyrings, bpf,
perf_event_open, userfaultfd, module and kexec loading, open_by_handle_at, swap, reboot, syslog, acct, quotas and
raw port I/O. clone3 answers ENOSYS, as in Docker's and Flatpak's filters: its flags sit behind a pointer a
filter cannot read, and glibc then falls back to clone, whose flags it can. A syscall of another ABI (i386 or
x32 on x86_64) kills the process, so the table cannot be sidestepped. Written by hand (it is small) so that
nothing beyond the standard library is needed.

Sockets are AF_UNIX only: socket() and socketpair() of any other family answer EAFNOSUPPORT, as from a kernel
without it. The network namespace leaves out neither AF_VSOCK (the VM's ports, shared with the host, the
hypervisor and other calls) nor the kernel's TCP and UDP buffers, which a memory cgroup v1 does not charge; a
tool needs neither. What would get past the family check or count against a quota of the host user's, not the
call's, answers ENOSYS, as from a kernel built without it: io_uring (its own socket operation), inotify and
fanotify (instances per user) and POSIX message queues (bytes per user).
"""

from __future__ import annotations

import errno
import platform
import struct

_DENIED = ("unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "ptrace", "process_vm_readv",
           "process_vm_writev", "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd",
           "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "name_to_handle_at",
           "open_by_handle_at", "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount", "fspick",
           "mount_setattr", "quotactl", "quotactl_fd", "swapon", "swapoff", "reboot", "acct", "syslog", "iopl",
           "ioperm")
_ABSENT = ("io_uring_setup", "io_uring_enter", "io_uring_register", "inotify_init", "inotify_init1",
           "fanotify_init", "mq_open", "mq_unlink", "mq_timedsend", "mq_timedreceive", "mq_notify", "mq_getsetattr")
_SOCKETS = ("socket", "socketpair")
_AF_UNIX = 1

# Syscall numbers per machine (x86_64: arch/x86/entry/syscalls/syscall_64.tbl; aarch64: asm-generic/unistd.h),
# and the AUDIT_ARCH_* value seccomp reports for that ABI.
_TABLES: dict[str, tuple[int, dict[str, int]]] = {
    "x86_64": (0xC000003E, {
        "clone": 56, "clone3": 435, "ptrace": 101, "syslog": 103, "pivot_root": 155, "chroot": 161, "acct": 163,
        "mount": 165, "umount2": 166, "swapon": 167, "swapoff": 168, "reboot": 169, "iopl": 172, "ioperm": 173,
        "init_module": 175, "delete_module": 176, "quotactl": 179, "kexec_load": 246, "add_key": 248,
        "request_key": 249, "keyctl": 250, "unshare": 272, "perf_event_open": 298, "name_to_handle_at": 303,
        "open_by_handle_at": 304, "setns": 308, "process_vm_readv": 310, "process_vm_writev": 311,
        "finit_module": 313, "kexec_file_load": 320, "bpf": 321, "userfaultfd": 323, "open_tree": 428,
        "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442,
        "quotactl_fd": 443, "socket": 41, "socketpair": 53, "mq_open": 240, "mq_unlink": 241, "mq_timedsend": 242,
        "mq_timedreceive": 243, "mq_notify": 244, "mq_getsetattr": 245, "inotify_init": 253, "inotify_init1": 294,
        "fanotify_init": 300, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427}),
    "aarch64": (0xC00000B7, {
        "clone": 220, "clone3": 435, "ptrace": 117, "syslog": 116, "pivot_root": 41, "chroot": 51, "acct": 89,
        "mount": 40, "umount2": 39, "swapon": 224, "swapoff": 225, "reboot": 142, "init_module": 105,
        "delete_module": 106, "quotactl": 60, "kexec_load": 104, "add_key": 217, "request_key": 218, "keyctl": 219,
        "unshare": 97, "perf_event_open": 241, "name_to_handle_at": 264, "open_by_handle_at": 265, "setns": 268,
        "process_vm_readv": 270, "process_vm_writev": 271, "finit_module": 273, "kexec_file_load": 294, "bpf": 280,
        "userfaultfd": 282, "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432,
        "fspick": 433, "mount_setattr": 442, "quotactl_fd": 443, "socket": 198, "socketpair": 199, "mq_open": 180,
        "mq_unlink": 181, "mq_timedsend": 182, "mq_timedreceive": 183, "mq_notify": 184, "mq_getsetattr": 185,
        "inotify_init1": 26, "fanotify_init": 262, "io_uring_setup": 425, "io_uring_enter": 426,
        "io_uring_register": 427}),
}
_X32_BIT = 0x40000000
_CLONE_NEW_FLAGS = 0x7E020080
"""CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET | NEWTIME."""

# struct seccomp_data: nr (u32), arch (u32), instruction pointer (u64), args[6] (u64, low half first)
_NR, _ARCH, _ARG0_LOW = 0, 4, 16
_LD_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
_ALLOW, _KILL_PROCESS, _ERRNO = 0x7FFF0000, 0x80000000, 0x00050000


def supported() -> bool:
    return platform.machine() in _TABLES


def program() -> bytes:
    """The filter as bwrap reads it: struct sock_filter {u16 code; u8 jt, jf; u32 k} entries, native order."""
    arch, numbers = _TABLES[platform.machine()]
    # Instructions as (code, jump-if-true label, jump-if-false label, k); labels resolve to relative jumps below.
    code: list[tuple[int, str | None, str | None, int]] = [
        (_LD_ABS, None, None, _ARCH), (_JEQ, None, "kill", arch), (_LD_ABS, None, None, _NR)]
    if platform.machine() == "x86_64":
        code.append((_JGE, "kill", None, _X32_BIT))
    code += [(_JEQ, "deny", None, numbers[name]) for name in _DENIED if name in numbers]
    code += [(_JEQ, "nosys", None, numbers[name]) for name in (*_ABSENT, "clone3") if name in numbers]
    code += [(_JEQ, "socket", None, numbers[name]) for name in _SOCKETS]
    code += [(_JEQ, "clone", None, numbers["clone"]), (_RET, None, None, _ALLOW)]
    # the argument checks first: BPF jumps only forward, and they jump to the returns after them
    labels = {"clone": len(code), "socket": len(code) + 3}
    code += [(_LD_ABS, None, None, _ARG0_LOW), (_JSET, "deny", None, _CLONE_NEW_FLAGS), (_RET, None, None, _ALLOW),
             (_LD_ABS, None, None, _ARG0_LOW), (_JEQ, "allow", None, _AF_UNIX),
             (_RET, None, None, _ERRNO | errno.EAFNOSUPPORT)]
    labels |= {"allow": len(code), "deny": len(code) + 1, "kill": len(code) + 2, "nosys": len(code) + 3}
    code += [(_RET, None, None, _ALLOW), (_RET, None, None, _ERRNO | errno.EPERM), (_RET, None, None, _KILL_PROCESS),
             (_RET, None, None, _ERRNO | errno.ENOSYS)]
    out = bytearray()
    for i, (op, true, false, k) in enumerate(code):
        jt = labels[true] - i - 1 if true else 0
        jf = labels[false] - i - 1 if false else 0
        out += struct.pack("=HBBI", op, jt, jf, k)
    return bytes(out)
