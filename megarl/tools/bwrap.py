"""The bubblewrap command line of a sandboxed call, and the uid maps the host writes for it when it is root.

The call sees a root of its own: the host's /usr (programs and libraries) and the interpreter's prefixes
read-only, a few files of /etc the dynamic linker and time zone need, a private /proc and a minimal /dev (null,
zero, full, random, urandom, tty, pts), and three size-capped tmpfs: its working directory, /tmp and /dev/shm.
Nothing else of the host: no /tmp, /run, /home, /sys, sockets or device nodes. It runs in new user, IPC, UTS,
PID, mount, network and cgroup namespaces under the seccomp filter of seccomp.py, as uid 65534 (nobody).
sandbox_init.py is the PID namespace's init (--as-pid-1), under the call's limits like every process of it.

As root, bwrap could only map the call's uid to host root. The host therefore writes the user namespace's maps
itself (--userns-block-fd), mapping nobody to nobody and root to root for bwrap's own set-up, and
sandbox_init.py drops to nobody before the code runs, so every process of the code is the host's unprivileged
uid 65534. Not root, bwrap maps nobody to the trainer's own uid; a root trainer with `host_uid` set runs bwrap
as that uid, the same way, so the namespaces and what the kernel counts per user in them are that uid's, not
root's (bwrap then reads every bind's source as that uid).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
from pathlib import Path

WORKDIR = "/home/sandbox"
"""The call's working directory and HOME, inside the sandbox."""
INIT = "/megarl/init.py"
"""Where sandbox_init.py is, inside the sandbox."""
UID = 65534
"""The uid and gid the code runs as (nobody), inside and, when root runs bwrap, on the host too."""
_ETC = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime", "/etc/alternatives")
_TOP_DIRS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": WORKDIR, "TMPDIR": "/tmp", "LANG": "C.UTF-8",
        "USER": "nobody", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def executable() -> str | None:
    return shutil.which("bwrap")


@functools.cache
def runtime_dirs(python: str) -> tuple[str, ...]:
    """The directories the interpreter needs outside /usr (its prefix, a virtual environment's base)."""
    out = subprocess.run([python, "-I", "-c", "import json, sys; print(json.dumps([sys.prefix, sys.base_prefix, "
                          "sys.exec_prefix, sys.base_exec_prefix]))"], capture_output=True, text=True, timeout=60,
                         check=True).stdout
    dirs = {os.path.realpath(p) for p in json.loads(out)} | {os.path.dirname(os.path.realpath(python))}
    dirs |= {os.path.dirname(python)}  # a virtual environment's bin/, whose python links to the real one
    return tuple(sorted(d for d in dirs if not (d == "/usr" or d.startswith("/usr/")) and os.path.isdir(d)))


def command(python: str, disk_bytes: int, init_spec: dict, *, as_root: bool, fds: dict[str, int]) -> list[str]:
    """bwrap's argv; `fds` holds the descriptors it reads: code, seccomp, info and block (the uid-map block when
    `as_root`)."""
    argv = [str(executable()), "--unshare-all", "--unshare-user", "--unshare-cgroup", "--die-with-parent",
            "--new-session", "--as-pid-1", "--hostname", "sandbox", "--info-fd", str(fds["info"]),
            "--seccomp", str(fds["seccomp"])]
    if as_root:
        argv += ["--userns-block-fd", str(fds["block"])]
    else:
        argv += ["--block-fd", str(fds["block"]), "--uid", str(UID), "--gid", str(UID)]
    argv += ["--ro-bind", "/usr", "/usr"]
    for top in _TOP_DIRS:  # merged /usr makes these links into /usr; elsewhere they are directories
        if os.path.islink(top):
            argv += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            argv += ["--ro-bind", top, top]
    argv += ["--proc", "/proc", "--dev", "/dev"]
    for mode, point in (("1777", "/tmp"), ("1777", "/dev/shm"), ("0777", WORKDIR)):
        argv += ["--perms", mode, "--size", str(disk_bytes), "--tmpfs", point]
    # After the tmpfs: an interpreter under /tmp (a virtual environment made by mktemp) is bound over the call's
    # own /tmp, not hidden by it.
    binds = [*_ETC, *runtime_dirs(python)]
    # bwrap makes a bind's missing parents mode 0700, owned by the namespace's root: nobody could not reach them
    for parent in sorted({str(p) for path in (*binds, INIT) for p in Path(path).parents if str(p) != "/"}):
        argv += ["--perms", "0755", "--dir", parent]
    for path in binds:
        argv += ["--ro-bind-try", path, path]
    argv += ["--ro-bind", str(Path(__file__).with_name("sandbox_init.py")), INIT]
    argv += ["--perms", "0644", "--file", str(fds["code"]), f"{WORKDIR}/{init_spec['script']}", "--chdir", WORKDIR,
             "--clearenv"]
    for key, value in _ENV.items():
        argv += ["--setenv", key, value]
    return argv + ["--remount-ro", "/", python, "-I", "-u", INIT, json.dumps(init_spec)]


def write_maps(child_pid: int) -> None:
    """The call's user namespace maps nobody to nobody (the code) and root to root (bwrap's set-up, until
    sandbox_init.py drops it); only root may write a map naming other uids than its own."""
    for name in ("uid_map", "gid_map"):
        with open(f"/proc/{child_pid}/{name}", "w") as f:
            f.write(f"0 0 1\n{UID} {UID} 1\n")
