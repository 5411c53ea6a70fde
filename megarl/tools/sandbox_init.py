"""The first Python of a sandboxed call: run by `python -I` (so it imports nothing from megarl), it sets the
call's per-process limits, on itself first, gives up root where it has it, and runs the model's script in a child
process.

Under bwrap it is the PID namespace's init, every other process of the call its descendant: so all of them,
itself included, are under the limits. Under bwrap run by root, it starts as root of the call's user namespace
(the host wrote that namespace's uid map, see bwrap.py): it empties the capability bounding set and becomes the
unprivileged uid, which clears every capability, before any of the model's code runs. It then runs as the code's
own uid, so it makes itself non-dumpable: without CAP_SYS_PTRACE, which no process of the call has, nothing can
open its /proc/1/mem or descriptors (bwrap's own init, which ran as the code's uid outside the rlimits, could be
rewritten through /proc/1/mem).
When the script's process ends, it writes how to the report descriptor, which no other process of the call holds,
and exits, and the kernel kills what is left of the call. The host reads the end of the call from that report
and its own counters, never from an exit code the code could choose.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import select
import signal
import sys
import traceback

_PR_SET_PDEATHSIG = 1
_PR_SET_DUMPABLE = 4
_PR_CAPBSET_DROP = 24
_SIGNALS_QUEUED = 64


def _set_rlimits(spec: dict) -> None:
    # The hard CPU limit one second above the soft one: SIGXCPU first (reported as the CPU limit), then SIGKILL
    # for code that ignores it. Hard limits equal soft ones elsewhere, so the code cannot raise them.
    resource.setrlimit(resource.RLIMIT_CPU, (spec["cpu_s"], spec["cpu_s"] + 1))
    resource.setrlimit(resource.RLIMIT_AS, (spec["memory_bytes"], spec["memory_bytes"]))
    resource.setrlimit(resource.RLIMIT_FSIZE, (spec["file_bytes"], spec["file_bytes"]))
    resource.setrlimit(resource.RLIMIT_NOFILE, (spec["open_files"], spec["open_files"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    # Counted per uid and user namespace (Linux >= 5.14), so under bwrap per call; a second cap beside pids.max.
    resource.setrlimit(resource.RLIMIT_NPROC, (spec["max_processes"], spec["max_processes"]))
    # Queued signals and locked shared memory are counted per user up the user namespaces, to the trainer's uid
    # (root's, for a root trainer): the call's own caps bound what it can take of the trainer's.
    resource.setrlimit(resource.RLIMIT_SIGPENDING, (_SIGNALS_QUEUED, _SIGNALS_QUEUED))
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (0, 0))


def _drop_root(uid: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in range(64):
        if libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            break  # past the last capability this kernel knows
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)  # from root to a non-zero uid: permitted and effective capabilities are cleared


def _cpu_seconds(pid: int) -> float:
    """User and system CPU time of the process `pid` alone, not its children's (a zombie's too)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime and stime, fields 14 and 15


def _run_script(script: str) -> int:
    path = os.path.join(os.getcwd(), script)
    sys.path[0] = os.getcwd()  # as for `python main.py`: the code imports the modules it wrote beside it
    sys.argv = [path]
    try:
        with open(path) as f:
            code = compile(f.read(), path, "exec")
        exec(code, {"__name__": "__main__", "__file__": path, "__builtins__": __builtins__})
        status = 0
    except SystemExit as stop:
        status = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
        if not isinstance(stop.code, int | None):
            print(stop.code, file=sys.stderr)
    except BaseException as err:
        assert err.__traceback__ is not None
        traceback.print_exception(type(err), err, err.__traceback__.tb_next)  # from the code's frame on
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return status


def main() -> None:
    spec = json.loads(sys.argv[1])
    _set_rlimits(spec)
    if spec["uid"] is not None and os.getuid() == 0:
        _drop_root(spec["uid"])
    if spec["uid"] is not None and (os.getuid() == 0 or os.geteuid() == 0):
        sys.exit("megarl sandbox: still root after dropping privileges; refusing to run the code")
    if ctypes.CDLL(None).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        sys.exit("megarl sandbox: could not make the call's init non-dumpable; refusing to run the code")
    report = spec["report_fd"]
    # bwrap's --die-with-parent armed the parent-death signal, which a change of uid clears: armed again, the call
    # dies with bwrap, and bwrap with the trainer. A trainer already gone closed the report's read end.
    if ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        sys.exit("megarl sandbox: could not tie the call to the trainer's life; refusing to run the code")
    watch = select.poll()
    watch.register(report, 0)
    if watch.poll(0):
        sys.exit("megarl sandbox: the trainer is gone")
    # As PID 1 this process gets only the signals it handles, and Python handles SIGINT: the code's
    # os.kill(1, SIGINT) would end it before it reports. Ignored from before the fork, so no signal finds a window.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    script = os.fork()
    if script == 0:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # the code's own Ctrl-C, as under `python main.py`
        os.close(report)
        # an ordinary process again: unsafe-none finds escaped processes by their environment, which a non-dumpable
        # one hides from a trainer that is not root
        ctypes.CDLL(None).prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)
        os._exit(_run_script(spec["script"]))
    while True:  # as PID 1, reap every orphan of the call until the script's process ends
        ended = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT)
        assert ended is not None  # None only with WNOHANG
        if ended.si_pid == script:
            break
        os.waitpid(ended.si_pid, 0)
    cpu_s = _cpu_seconds(script)  # while it is a zombie still
    os.waitpid(script, 0)
    outcome: dict[str, float]
    if ended.si_code == os.CLD_EXITED:
        outcome = {"exit": ended.si_status}
    else:
        outcome = {"signal": ended.si_status, "cpu_s": cpu_s}
    os.write(report, json.dumps(outcome).encode())
    os._exit(0)


if __name__ == "__main__":
    main()
