"""Signals during the engine's start-up: Ctrl-C (SIGINT) and a closed terminal (SIGHUP), sent to the whole
process group as a terminal does, stop the trainer with its one line and exit code, while the engine processes
it started do not act on them (the trainer shuts them down itself)."""

import os
import signal
import subprocess
import sys

import pytest

from helpers import REPO

START_UP = """
import subprocess, sys, time
from megarl.rollout.group import EngineGroup, start_engine
from megarl.run.command import run_main
from megarl.run.interrupt import install

def make():  # an engine whose start-up starts a process and then takes long
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)  # its pipes would keep communicate() waiting
    print(child.pid, flush=True)
    time.sleep(120)

def main():
    install()
    start_engine(EngineGroup(index=0, num_groups=1, size=1, rank_in_group=0, members=(0,), group=None), make, 600)
    print("started", flush=True)

run_main(main)
"""


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGHUP])
def test_a_terminal_signal_during_engine_start_up_stops_the_trainer_not_its_children(signum):
    proc = subprocess.Popen([sys.executable, "-c", START_UP], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=os.environ | {"PYTHONPATH": str(REPO)})
    child = int(proc.stdout.readline())
    try:
        os.killpg(proc.pid, signum)  # as the terminal does: the trainer and the engine's processes
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 128 + signum, err
        assert "started" not in out and f"megarl: interrupted by {signal.Signals(signum).name}" in err, err
        os.kill(child, 0)  # alive: the signal did not reach it
    finally:
        proc.kill()
        os.kill(child, signal.SIGKILL)


def test_a_signal_in_a_deferred_block_interrupts_when_it_ends_and_a_second_one_at_once():
    """interrupt.deferred: the first signal waits for the block (a metrics row reaching mlflow's store); a second
    one in the block interrupts at once (a store that hangs); a block without a signal ends as any other."""
    import time

    from megarl.run import interrupt

    def in_block(signals: int) -> list[str]:
        done = []
        with pytest.raises(interrupt.Interrupted) as raised:
            with interrupt.deferred():
                for _ in range(signals):
                    os.kill(os.getpid(), signal.SIGTERM)
                    time.sleep(0.05)  # the handler runs in this thread at the next bytecode
                    done.append("signalled")
                done.append("the block's end")
        assert raised.value.signum == signal.SIGTERM
        return done

    saved = signal.signal(signal.SIGTERM, interrupt._raise)
    try:
        assert in_block(1) == ["signalled", "the block's end"]
        assert in_block(2) == ["signalled"]
        with interrupt.deferred():
            pass
        assert not interrupt._pending
    finally:
        signal.signal(signal.SIGTERM, saved)


SECOND_SIGNAL_IN_THE_CLEAN_UP = """
import os, signal
from megarl.run import interrupt
from megarl.run.command import run_main

def main():
    interrupt.install()
    # srun's and torchrun's SIGTERM arrive together: the second lands while handle() sets the handlers aside
    original = signal.signal
    def signal_then_set(s, h):
        if h is signal.SIG_IGN and s == signal.SIGINT:
            os.kill(os.getpid(), signal.SIGTERM)
        return original(s, h)
    signal.signal = signal_then_set
    os.kill(os.getpid(), signal.SIGTERM)

run_main(main)
"""


def test_a_second_signal_while_the_first_is_handled_keeps_the_one_line_and_its_exit_code():
    """A SIGTERM arriving while handle() was still setting the handlers to ignore raised inside it: a traceback
    under the line, in a Slurm job's log (test_slurm_cluster's scancel)."""
    proc = subprocess.run([sys.executable, "-c", SECOND_SIGNAL_IN_THE_CLEAN_UP], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env=os.environ | {"PYTHONPATH": str(REPO)})
    assert proc.returncode == 143 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("megarl: interrupted by SIGTERM"), proc.stderr
