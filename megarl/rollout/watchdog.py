"""Engine processes never outlive their trainer: a watchdog per engine kills them once the trainer is gone, however
it went (kill -9 included), and whatever is left of them after a shutdown.

The engine's processes are not all the trainer's children (vLLM's EngineCore starts the workers, SGLang's schedulers
may start more), so ``PR_SET_PDEATHSIG``, which covers direct children only (and follows the thread that forked,
not the process), cannot do it; once the trainer is dead, its orphans are children of init and no longer tell
whose they were. The watchdog is a small process of its own session and outside the trainer's process tree
(torchrun's and the terminal's signals to the trainer's group miss it, and so do engines' own tree killers, such as
SGLang's shutdown). From before the engine starts it records every process the trainer starts while the engine
starts and every descendant of those, with its start time (a pid may be reused), and waits on a pidfd of the
trainer. The engine's environment carries a mark of its own, which finds the processes it execs (and their forks)
even once orphaned before a scan saw them. When the trainer exits, or asks it after a shutdown, it sends SIGTERM
to every recorded process still alive, then SIGKILL to those left after a grace period. multiprocessing's resource
tracker is left alone: it is the trainer's, and exits by itself (removing leaked shared memory) once the processes
that used it are gone.

Run as ``python -m megarl.rollout.watchdog TRAINER_PID TOKEN LOG_FILE`` (LOG_FILE "": stderr); it reads
``started`` (the engine runs: the trainer's later children are not the engine's) and ``stop`` (clean up now, then
exit) on stdin. Standard library only.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

ENV = "MEGARL_ENGINE_OF"
"""Set in the engine's environment (``Watchdog.env``): every process it execs carries it, and so do their forks."""
GRACE_S = 2.0
"""Between SIGTERM and SIGKILL."""
SCAN_STARTING_S, SCAN_RUNNING_S = 0.2, 2.0
"""How often the process table is read: while the engine starts its processes, and afterwards (for processes its
processes start later, before they can be orphaned)."""


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of ``pid``, None once it is gone (a zombie is: it holds no memory,
    and its parent, or init, reaps it)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_bytes().decode(errors="replace")
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # the command name may hold spaces and parentheses
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[1]), int(fields[19])


def _processes() -> dict[int, tuple[int, int]]:
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := _stat(int(entry))) is not None:
            table[int(entry)] = stat
    return table


def _shared_helper(pid: int) -> bool:
    """multiprocessing's resource tracker (see the module's docstring)."""
    try:
        return b"multiprocessing.resource_tracker" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True


def _marked(entry: bytes) -> list[int]:
    """Processes whose environment holds ``entry`` (this user's: others' cannot be read, nor killed)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if entry in Path(f"/proc/{name}/environ").read_bytes().split(b"\0"):
                    found.append(int(name))
            except OSError:
                pass
    return found


class _Watch:
    def __init__(self, trainer: int, token: str, log: str) -> None:
        self.trainer, self.log = trainer, log
        self.entry = f"{ENV}={token}".encode()
        me = _stat(os.getpid())
        assert me is not None
        self.since = me[1]  # processes older than this one are not the engine's
        self.known: dict[int, int] = {}
        self.starting = True

    def scan(self) -> None:
        """Record the engine's new processes: the trainer's (while it starts) and any of a recorded one."""
        table = _processes()
        parents = {self.trainer} if self.starting else set()
        parents |= {pid for pid, start in self.known.items() if table.get(pid, (0, -1))[1] == start}
        grew = True
        while grew:
            grew = False
            for pid, (ppid, start) in table.items():
                if ppid in parents and pid not in parents and start >= self.since and pid != os.getpid():
                    self.known.setdefault(pid, start)
                    parents.add(pid)
                    grew = True

    def adopt_marked(self) -> None:
        """The engine's processes that the scans missed (orphaned before one saw them) but its environment marks."""
        for pid in _marked(self.entry):
            if (stat := _stat(pid)) is not None and stat[1] >= self.since:
                self.known.setdefault(pid, stat[1])

    def alive(self) -> list[int]:
        return [pid for pid, start in self.known.items()
                if (stat := _stat(pid)) is not None and stat[1] == start and not _shared_helper(pid)]

    def kill(self, why: str) -> None:
        self.scan()
        self.adopt_marked()
        victims = self.alive()
        if not victims:
            return
        line = f"megarl watchdog: {why}; ending its engine's processes {victims}\n"
        if self.log:
            with open(self.log, "a") as f:
                f.write(line)
        else:
            sys.stderr.write(line)
            sys.stderr.flush()
        for sig, wait in ((signal.SIGTERM, GRACE_S), (signal.SIGKILL, 5.0)):
            for pid in victims:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                self.scan()  # what they start while dying, too
                self.adopt_marked()
                victims = self.alive()
                if not victims:
                    return
                time.sleep(0.05)


def main() -> None:
    trainer, token, log = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    if os.fork():
        os._exit(0)  # the trainer reaps this one; the watchdog goes on outside the trainer's process tree
    watch = _Watch(trainer, token, log)
    trainer_stat = _stat(trainer)
    try:
        trainer_gone: int | None = os.pidfd_open(trainer)  # readable once it has exited
    except (AttributeError, OSError):  # Linux before 5.3: its start time is checked at every scan instead
        trainer_gone = None
    print(f"ready {os.getpid()}", flush=True)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    commands: int | None = 0
    pending = b""
    while True:
        watch.scan()
        waits = [fd for fd in (trainer_gone, commands) if fd is not None]
        period = SCAN_STARTING_S if watch.starting or trainer_gone is None else SCAN_RUNNING_S
        ready, _, _ = select.select(waits, [], [], period)
        alive = _stat(trainer)
        if trainer_gone in ready or alive is None or trainer_stat is None or alive[1] != trainer_stat[1]:
            watch.kill(f"the trainer (pid {trainer}) is gone")
            return
        if commands is not None and commands in ready:
            data = os.read(commands, 4096)
            if not data:
                commands = None  # the trainer closed its end; its exit still counts
            *lines, pending = (pending + data).split(b"\n")
            for line in lines:
                if line == b"started":
                    watch.scan()
                    watch.starting = False
                elif line == b"stop":
                    watch.kill("the engine was shut down")
                    return


class Watchdog:
    """The trainer's side: start one before the engine's processes, which start with ``env`` in their environment,
    ``started()`` once the engine runs, ``stop()`` after its shutdown (or a failed start)."""

    def __init__(self, log_file: Path | None = None) -> None:
        """``log_file``: the engine's log, where the watchdog says what it killed (None: stderr)."""
        root = str(Path(__file__).resolve().parents[2])
        paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        token = f"{os.getpid()}.{time.time_ns()}"
        self.env = {ENV: token}
        """For the engine's environment (``engine_process_env``)."""
        proc = subprocess.Popen([sys.executable, "-m", "megarl.rollout.watchdog", str(os.getpid()), token,
                                 str(log_file or "")],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True,
                                env=os.environ | {"PYTHONPATH": os.pathsep.join([root, *paths])})
        assert proc.stdin is not None and proc.stdout is not None
        line = proc.stdout.readline().decode()
        proc.wait()
        proc.stdout.close()
        if not line.startswith("ready "):
            raise RuntimeError(f"the engine's watchdog did not start (exit code {proc.returncode})")
        self.pid = int(line.split()[1])
        self._commands: IO[bytes] | None = proc.stdin

    def _send(self, command: bytes) -> None:
        if self._commands is None:
            return
        try:
            self._commands.write(command + b"\n")
            self._commands.flush()
        except OSError:  # it is gone (killed by hand): nothing to tell
            self._commands = None

    def started(self) -> None:
        self._send(b"started")

    def stop(self, wait_s: float = 0.0) -> None:
        """Have the watchdog end the engine's processes; ``wait_s``: wait up to that long until it has (it exits
        once they are gone: SIGTERM, then SIGKILL after GRACE_S)."""
        self._send(b"stop")
        if self._commands is not None:
            self._commands.close()
            self._commands = None
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and _stat(self.pid) is not None:
            time.sleep(0.05)


if __name__ == "__main__":
    main()
