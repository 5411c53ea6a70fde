"""The child side of the sandbox: run as a script by `python -I` (so it imports nothing from megarl), it
confines itself and then runs the model's code.

Three processes: this launcher sets rlimits, joins the call's pids cgroup, unshares the network, PID and mount
namespaces and makes every mount but the working directory read-only; its child (PID 1 of the new PID
namespace) mounts a private /proc, drops every capability and waits for the worker, which installs the audit
hook and runs the code. When PID 1 exits the kernel kills whatever the code left in the namespace. PID 1
writes two JSON lines to the status pipe: which layers took effect, and why the worker ended.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import resource
import signal
import socket
import sys
import traceback

_CLONE_NEWNS = 0x00020000
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWPID = 0x20000000
_CLONE_NEWNET = 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_NOATIME, _MS_NODIRATIME, _MS_BIND, _MS_REC = 32, 1024, 2048, 4096, 16384
_MS_PRIVATE, _MS_RELATIME = 1 << 18, 1 << 21
_MOUNT_FLAGS = {"nosuid": _MS_NOSUID, "nodev": _MS_NODEV, "noexec": _MS_NOEXEC, "noatime": _MS_NOATIME,
                "nodiratime": _MS_NODIRATIME, "relatime": _MS_RELATIME}
_PR_CAPBSET_DROP, _PR_SET_NO_NEW_PRIVS = 24, 38
_MEMORY_EXIT = 86
"""The worker's exit code after a MemoryError, so PID 1 can tell a memory limit from an ordinary failure."""
NETWORK_OFF = "network is disabled in this sandbox"
_NET_EVENTS = {"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo",
               "socket.gethostbyname", "socket.gethostbyaddr"}
_PATH_EVENTS = {"os.remove", "os.rename", "os.mkdir", "os.rmdir", "os.chmod", "os.chown", "os.symlink", "os.link",
                "os.truncate", "os.utime", "os.setxattr", "os.removexattr", "shutil.rmtree"}

_libc = ctypes.CDLL(None, use_errno=True)


def _call(name: str, *args: object) -> None:
    if getattr(_libc, name)(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}: {os.strerror(err)}")


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _set_rlimits(spec: dict) -> None:
    # The hard CPU limit one second above the soft one: SIGXCPU first (reported as the CPU limit), then SIGKILL
    # for code that ignores it.
    resource.setrlimit(resource.RLIMIT_CPU, (spec["cpu_s"], spec["cpu_s"] + 1))
    resource.setrlimit(resource.RLIMIT_AS, (spec["memory_bytes"], spec["memory_bytes"]))
    resource.setrlimit(resource.RLIMIT_FSIZE, (spec["file_bytes"], spec["file_bytes"]))
    resource.setrlimit(resource.RLIMIT_NOFILE, (spec["open_files"], spec["open_files"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if os.geteuid() != 0:  # root is exempt from RLIMIT_NPROC, and it counts all of this user's processes
        resource.setrlimit(resource.RLIMIT_NPROC, (spec["max_processes"], spec["max_processes"]))


def _unshare(layers: dict) -> None:
    """Enter new network, PID and mount namespaces where the kernel lets us; record which."""
    root = os.geteuid() == 0
    uid, gid = os.geteuid(), os.getegid()
    flags = _CLONE_NEWNET | _CLONE_NEWPID | _CLONE_NEWNS | (0 if root else _CLONE_NEWUSER)
    try:
        _call("unshare", flags)
    except OSError as err:
        layers["namespaces"] = f"none ({err.strerror})"
        return
    if not root:  # keep our own uid inside the user namespace, so files keep their owners
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"{uid} {uid} 1")
        _write("/proc/self/gid_map", f"{gid} {gid} 1")
    layers["namespaces"] = "network, pid, mount" + ("" if root else ", user")


def _read_only_mounts(workdir: str, file_bytes: int, layers: dict) -> None:
    """Every mount read-only except a bind mount of the working directory and a private /dev/shm, in our own
    mount namespace."""
    try:
        _call("mount", None, b"/", None, _MS_REC | _MS_PRIVATE, None)  # nothing below propagates to the host
        _call("mount", workdir.encode(), workdir.encode(), None, _MS_BIND, None)
        os.chdir(workdir)  # our cwd still points below the mount just made, into what becomes read-only
        failed = []
        with open("/proc/self/mountinfo") as f:
            mounts = [line.split() for line in f]
        for fields in mounts:
            point = fields[4].encode().decode("unicode_escape")
            if point == workdir:
                continue
            flags = _MS_REMOUNT | _MS_BIND | _MS_RDONLY
            for option in fields[5].split(","):
                flags |= _MOUNT_FLAGS.get(option, 0)
            try:
                _call("mount", None, point.encode(), None, flags, None)
            except OSError:
                if point == "/":
                    raise
                failed.append(point)
        _private_shm(file_bytes)
    except OSError as err:
        layers["files"] = f"audit hook only ({err.strerror})"
        return
    layers["files"] = "read-only mounts" + (f" (not {failed})" if failed else "")


def _private_shm(size: int) -> None:
    """A small empty /dev/shm of the call's own: multiprocessing's locks need one, the host's is read-only now."""
    if os.path.isdir("/dev/shm"):
        data = f"size={max(size, 1 << 20)},mode=1777".encode()
        _call("mount", b"tmpfs", b"/dev/shm", b"tmpfs", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, data)


def _drop_capabilities() -> None:
    # no_new_privs and an empty bounding set keep an exec'd setuid or root program from getting them back
    _call("prctl", _PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    for cap in range(64):
        if _libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            break
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)
    data = (ctypes.c_uint32 * 6)()
    _call("capset", header, data)


def _inside(path: object, workdir: str) -> bool:
    if isinstance(path, int):
        return True  # an open descriptor: whatever opened it was checked
    try:
        real = os.path.realpath(os.fsdecode(path))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return True
    return real == workdir or real.startswith(workdir + os.sep) or real == os.devnull


def _audit_hook(workdir: str):
    def hook(event: str, args: tuple) -> None:
        if event in _NET_EVENTS:
            sock = args[0] if args and isinstance(args[0], socket.socket) else None
            if sock is None or sock.family != socket.AF_UNIX:
                raise PermissionError(NETWORK_OFF)
        elif event == "open":
            path, mode, flags = args
            writes = any(c in (mode or "") for c in "wax+") or (flags or 0) & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
            if writes and not _inside(path, workdir):
                raise PermissionError(f"writing outside the sandbox's directory is refused: {path!r}")
        elif event in _PATH_EVENTS:
            for arg in args:
                if isinstance(arg, str | bytes | os.PathLike) and not _inside(arg, workdir):
                    raise PermissionError(f"{event} outside the sandbox's directory is refused: {arg!r}")

    return hook


def _worker(spec: dict) -> None:
    sys.addaudithook(_audit_hook(spec["workdir"]))
    path = os.path.join(spec["workdir"], spec["script"])
    try:
        with open(path) as f:
            code = compile(f.read(), path, "exec")
        exec(code, {"__name__": "__main__", "__file__": path})
        status = 0
    except SystemExit as stop:
        status = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
    except MemoryError:
        print("MemoryError", file=sys.stderr)
        status = _MEMORY_EXIT
    except BaseException as err:
        assert err.__traceback__ is not None
        traceback.print_exception(type(err), err, err.__traceback__.tb_next)  # from the code's frame on
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _end(wait_status: int, rusage: resource.struct_rusage, spec: dict) -> tuple[str, int]:
    """Why the worker ended, and the exit code that says so to the launcher."""
    if os.WIFEXITED(wait_status):
        code = os.WEXITSTATUS(wait_status)
        return ("memory" if code == _MEMORY_EXIT else f"exit {code}"), code
    sig = os.WTERMSIG(wait_status)
    cpu = rusage.ru_utime + rusage.ru_stime
    if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu >= spec["cpu_s"]):
        return "cpu", 128 + sig
    return f"signal {signal.Signals(sig).name}", 128 + sig


def _init(spec: dict, layers: dict, status_fd: int) -> None:
    if layers["namespaces"].startswith("network"):
        # a /proc of this namespace only: the code sees neither the host's processes nor its sysctls; without it
        # the host's /proc, read-only, is still there
        with contextlib.suppress(OSError):
            _call("mount", b"proc", b"/proc", b"proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC | _MS_RDONLY, None)
    if not spec["namespaces"]:
        layers["capabilities"] = "kept (turned off)"
    else:
        try:
            _drop_capabilities()
            layers["capabilities"] = "dropped"
        except OSError as err:
            layers["capabilities"] = f"kept ({err.strerror})"
    # the layers now, the end later: a call killed at its timeout still reports what confined it
    os.write(status_fd, json.dumps(layers).encode() + b"\n")
    worker = os.fork()
    if worker == 0:
        os.close(status_fd)
        _worker(spec)
    while True:  # as PID 1 we also reap the code's orphans
        pid, wait_status, rusage = os.wait4(-1, 0)
        if pid == worker:
            break
    end, code = _end(wait_status, rusage, spec)
    os.write(status_fd, json.dumps({"end": end}).encode() + b"\n")
    os._exit(code)


def main() -> None:
    spec = json.loads(sys.argv[1])
    status_fd = spec["status_fd"]
    layers: dict = {}
    layers["processes"] = "RLIMIT_NPROC" if os.geteuid() != 0 else "none (root, no cgroup)"
    if spec["cgroup"]:  # before any fork, so every process of the call counts
        with contextlib.suppress(OSError):
            _write(os.path.join(spec["cgroup"], "cgroup.procs"), str(os.getpid()))
            layers["processes"] = "cgroup pids.max"
    _set_rlimits(spec)
    if spec["namespaces"]:
        _unshare(layers)
    else:
        layers["namespaces"] = "none (turned off)"
    if layers["namespaces"].startswith("network"):
        _read_only_mounts(spec["workdir"], spec["file_bytes"], layers)
        layers["network"] = "namespace + audit hook"
    else:
        layers["files"] = "audit hook only"
        layers["network"] = "audit hook only"
    child = os.fork()
    if child == 0:
        _init(spec, layers, status_fd)
    os.close(status_fd)
    _, wait_status = os.waitpid(child, 0)
    os._exit(os.WEXITSTATUS(wait_status) if os.WIFEXITED(wait_status) else 128 + os.WTERMSIG(wait_status))


if __name__ == "__main__":
    main()
