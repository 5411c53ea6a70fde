"""One run per run directory: a second run into a directory in use stops with exit code 2, naming the holder's
pid, host and start time, before it writes anything there; the lock dies with its holder, kill -9 included."""

import os
import signal
import socket
import subprocess
import sys

import pytest

from helpers import REPO
from megarl.run.command import run_main
from megarl.run.lock import LOCK_FILE, acquire

HOLD = """
import sys, time
from pathlib import Path
from megarl.run.lock import acquire
acquire(Path(sys.argv[1]))
if len(sys.argv) > 2:  # a forked child (an engine process) lives on after its parent
    import multiprocessing
    multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,)).start()
print("locked", flush=True)
sys.stdin.read()  # holds the lock until the test closes this pipe or kills it: no deadline a slow start can outlive
"""


def hold(directory, *extra):
    """A process that holds the lock of ``directory`` until killed (and, with ``extra``, has a forked child)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(directory), *extra], cwd=REPO, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=os.environ | {"PYTHONPATH": str(REPO)})
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_second_run_is_refused_naming_the_holder_and_kill_9_frees_the_directory(tmp_path, capsys):
    proc = hold(tmp_path)
    try:
        with pytest.raises(SystemExit) as exit_info:
            run_main(lambda: acquire(tmp_path))
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith(f"megarl error: checkpoint.dir = {str(tmp_path)!r} is in use by another megarl run: "
                              f"pid {proc.pid} on host {socket.gethostname()}, started 20"), err
        assert " UTC" in err and "Fix:" in err and "Traceback" not in err
    finally:
        proc.kill()
        proc.wait()
    acquire(tmp_path)  # the kernel released the dead holder's lock: no stale lock to clean up by hand
    assert (tmp_path / LOCK_FILE).read_text().startswith(f"pid {os.getpid()} on host ")


def test_a_forked_child_does_not_keep_its_dead_parents_lock(tmp_path):
    proc = hold(tmp_path, "fork")
    try:
        children = [int(p) for p in subprocess.check_output(["pgrep", "-P", str(proc.pid)], text=True).split()]
        assert children
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        acquire(tmp_path)  # while the child still runs
        assert all(os.path.exists(f"/proc/{c}") for c in children)
    finally:
        for c in children:
            os.kill(c, signal.SIGKILL)


@pytest.mark.slow
def test_every_rank_of_a_refused_run_exits_with_code_2_and_writes_nothing(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    holder = hold(run)
    try:
        proc = subprocess.run([sys.executable, "-m", "megarl.launch", "megarl/train.py", "--config",
                               "recipes/tiny_cpu_grpo.yaml", "--set", f"checkpoint.dir={run}"],
                              cwd=REPO, capture_output=True, text=True, timeout=300,
                              env=os.environ | {"PYTHONPATH": str(REPO), "MEGARL_NPROC": "2", "OMP_NUM_THREADS": "1"})
        assert holder.poll() is None  # the lock was held for the whole run
    finally:
        holder.kill()
        holder.wait()
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"megarl error: checkpoint.dir = {str(run)!r} is in use by another megarl run: "
                           f"pid {holder.pid} on host"), proc.stderr[-3000:]
    assert proc.stderr.count("in use by another megarl run") == 2  # rank 0's, and the launcher's, last
    assert sorted(p.name for p in run.iterdir()) == [LOCK_FILE]  # no mlflow store, metrics or engine log
    # refused at start-up: nothing that follows the lock ran (the prompt count is the first line after it)
    assert " prompts" not in proc.stdout and "starting vllm engine" not in proc.stdout + proc.stderr, proc.stdout
