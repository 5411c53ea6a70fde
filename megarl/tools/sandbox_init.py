"""The first Python of a sandboxed call: run by `python -I` (so it imports nothing from megarl), it sets the
call's per-process limits, gives up root where it has it, and runs the model's script in its own process.

Under bwrap run by root, it starts as root of the call's user namespace (the host wrote that namespace's uid map,
see bwrap.py): it empties the capability bounding set and becomes the unprivileged uid, which clears every
capability, before any of the model's code runs. Exit code 86 says the code ran out of memory.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import sys
import traceback

_MEMORY_EXIT = 86
_PR_CAPBSET_DROP = 24


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


def _drop_root(uid: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in range(64):
        if libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            break  # past the last capability this kernel knows
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)  # from root to a non-zero uid: permitted and effective capabilities are cleared


def main() -> None:
    spec = json.loads(sys.argv[1])
    _set_rlimits(spec)
    if spec["uid"] is not None and os.getuid() == 0:
        _drop_root(spec["uid"])
    if spec["uid"] is not None and (os.getuid() == 0 or os.geteuid() == 0):
        sys.exit("megarl sandbox: still root after dropping privileges; refusing to run the code")
    path = os.path.join(os.getcwd(), spec["script"])
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


if __name__ == "__main__":
    main()
