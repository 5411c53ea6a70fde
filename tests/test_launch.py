"""`python -m megarl.launch` and the Slurm scripts: torchrun arguments from SLURM variables."""

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import REPO
from megarl.errors import UserError
from megarl.launch import check_rendezvous_host, engine_gpus, expand_nodelist, standalone_command, torchrun_command

ENV = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[007-009],dgx1", "SLURM_NNODES": "4",
       "SLURM_GPUS_ON_NODE": "8"}


def test_nodelist_expansion():
    assert expand_nodelist("gpu[007-009],dgx1") == ["gpu007", "gpu008", "gpu009", "dgx1"]
    assert expand_nodelist("a[1,3-4]") == ["a1", "a3", "a4"]
    assert expand_nodelist("single") == ["single"]
    # text after a bracket, and two brackets: read as three hosts and as ["a1", "a2", "-b1", "-b2"]
    assert expand_nodelist("gpu[01-02]-ib") == ["gpu01-ib", "gpu02-ib"]
    assert expand_nodelist("r[1-2]n[8-9],x") == ["r1n8", "r1n9", "r2n8", "r2n9", "x"]


def test_torchrun_arguments_from_slurm():
    cmd = torchrun_command(["megarl/train.py", "--config", "r.yaml"], ENV)
    assert cmd == ["torchrun", "--nnodes=4", "--nproc-per-node=8", "--rdzv-backend=c10d",
                   "--rdzv-endpoint=gpu007:29500", "--rdzv-id=4242", "--max-restarts=0",
                   "megarl/train.py", "--config", "r.yaml"]
    cmd = torchrun_command(["x.py"], ENV | {"SLURM_GPUS_ON_NODE": "", "SLURM_GPUS_PER_NODE": "h100:4",
                                            "MEGARL_RDZV_PORT": "1234"})
    assert "--nproc-per-node=4" in cmd and "--rdzv-endpoint=gpu007:1234" in cmd
    # one task per node is how the launchers run, not a GPU count: a node's 8 GPUs trained on 1
    with pytest.raises(UserError, match="cannot tell how many GPUs each node has"):
        torchrun_command(["x.py"], ENV | {"SLURM_GPUS_ON_NODE": "", "SLURM_NTASKS_PER_NODE": "1"})


def test_gpus_kept_for_the_engines_are_not_given_trainer_ranks():
    """async_rl.engine_gpus: torchrun starts one trainer rank per GPU of the rest, on a Slurm node or here."""
    assert "--nproc-per-node=6" in torchrun_command(["x.py"], ENV, reserved=2)
    assert standalone_command(["x.py"], {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, reserved=1)[2] == "--nproc-per-node=3"
    assert standalone_command(["x.py"], {"MEGARL_NPROC": "2"}, reserved=2)[2] == "--nproc-per-node=2"  # as asked
    with pytest.raises(UserError, match=r"async_rl.engine_gpus = 8 leaves no GPU for the trainer: each node"):
        torchrun_command(["x.py"], ENV, reserved=8)
    for name, value, call in (("MEGARL_NPROC", "abc", lambda e: standalone_command(["x.py"], e)),
                              ("MEGARL_NPROC", "0", lambda e: standalone_command(["x.py"], e)),
                              ("MEGARL_GPUS_PER_NODE", "x", lambda e: torchrun_command(["x.py"], e)),
                              ("SLURM_NNODES", "two", lambda e: torchrun_command(["x.py"], e))):
        with pytest.raises(UserError, match=rf"{name} = '{value}' must be a whole number >= 1"):
            call(dict(ENV) | {name: value})  # a ValueError traceback, or MEGARL_NPROC=0 dividing by zero later
    recipe = str(REPO / "recipes/tiny_cpu_grpo.yaml")
    assert engine_gpus(["megarl/train.py", "--config", recipe, "--set", "async_rl.mode=separate", "--set",
                        "async_rl.engine_gpus=2", "--set", "algorithm.rollout_correction=token_tis"]) == 2
    assert engine_gpus(["megarl/train.py", "--config", recipe]) == 0 and engine_gpus(["bench.py"]) == 0


@pytest.mark.parametrize("env,needle", [
    ({}, "must run inside a Slurm job"),
    (ENV | {"SLURM_NNODES": "2"}, "expands to 4 hosts"),
    ({k: v for k, v in ENV.items() if k != "SLURM_GPUS_ON_NODE"}, "gpus-per-node"),
])
def test_bad_slurm_environment(env, needle):
    with pytest.raises(UserError, match=needle):
        torchrun_command(["x.py"], env)


TWO = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NNODES": "2", "SLURM_GPUS_ON_NODE": "1"}


@pytest.mark.parametrize("node_id,hostname,error", [
    ("0", "n1", None),
    ("1", "n2", None),
    ("0", "n1.cluster", None),  # another name of the first node's address: torchrun takes it for the endpoint too
    ("0", "n2", "is the job's first node (SLURM_NODEID=0), where torchrun's rendezvous store must run"),
    ("0", "login", "this node's hostname 'login' does not resolve"),
    ("1", "login", "this node's hostname 'login' does not resolve"),
])
def test_the_first_node_must_take_the_rendezvous_endpoint_for_itself(monkeypatch, node_id, hostname, error):
    """What torchrun's c10d rendezvous needs of the nodes' names (the two-node Slurm cluster showed it: a first node
    whose hostname is not its Slurm name starts no store, and every node waits for one), checked before torchrun."""
    names = {"n1": "10.0.0.1", "n1.cluster": "10.0.0.1", "n2": "10.0.0.2"}

    def getaddrinfo(host, port, *args, **kwargs):
        if host not in names:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, host, (names[host], 0))]

    monkeypatch.setattr(socket, "gethostname", lambda: hostname)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    env = TWO | {"SLURM_NODEID": node_id, "SLURMD_NODENAME": f"n{int(node_id) + 1}"}
    cmd = torchrun_command(["x.py"], env)
    if error is None:
        check_rendezvous_host(cmd, env)
    else:
        with pytest.raises(UserError, match=re.escape(error)):
            check_rendezvous_host(cmd, env)
    names.pop("n1")
    with pytest.raises(UserError, match="the rendezvous endpoint 'n1' .the job's first node. does not resolve"):
        check_rendezvous_host(cmd, env)
    check_rendezvous_host(torchrun_command(["x.py"], ENV | {"SLURM_JOB_NODELIST": "x1", "SLURM_NNODES": "1"}), env)


def test_cli_prints_command_and_exits_2_outside_slurm():
    env = {"PYTHONPATH": str(REPO), **ENV}
    proc = subprocess.run([sys.executable, "-m", "megarl.launch", "--print", "megarl/train.py"], env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 0 and "--rdzv-endpoint=gpu007:29500" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "megarl.launch", "megarl/train.py"],
                          env={"PYTHONPATH": str(REPO)}, capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr


@pytest.mark.parametrize("script", ["train.sbatch", "train_pyxis.sbatch", "train_apptainer.sbatch",
                                    "reshard_bench.sbatch"])
def test_sbatch_scripts_parse(script):
    path = REPO / "scripts" / "slurm" / script
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    text = path.read_text()
    assert "#SBATCH --gpus-per-node=8" in text and "megarl.launch" in text
    if script.startswith("train"):  # checkpoint and requeue before the time limit or a preemption
        assert "#SBATCH --signal=B:USR1@" in text and "#SBATCH --requeue" in text and "train_until_signal srun" in text
    # Slurm opens the output file before the script runs: a directory missing in a fresh clone fails the job at once
    # with no log (JobLaunchFailure)
    output = re.search(r"^#SBATCH --output=(.+)$", text, re.M)
    assert output is not None
    folder = str(Path(output.group(1)).parent)
    tracked = subprocess.run(["git", "ls-files", folder], cwd=REPO, capture_output=True, text=True).stdout
    assert folder == "." or tracked.strip(), f"{folder}/ is not in the repository"


# Stands in for the job step: waits for the stop file its checkpoint.stop_file argument names, as the trainer would,
# and (``ACK``) deletes it once "saved"; prints its arguments.
FAKE_STEP = """
import pathlib, sys, time
print("args", " ".join(sys.argv[1:]))
stop = pathlib.Path(next(a for a in sys.argv if a.startswith("checkpoint.stop_file=")).split("=", 1)[1])
for _ in range(600):
    if stop.exists():
        if ACK:
            stop.unlink()
        print("saved and stopped" if ACK else "finished")
        sys.exit(0)
    time.sleep(0.05)
sys.exit(3)
"""


def usr1_during_a_step(tmp_path: Path, env: dict[str, str], ack: bool = True) -> tuple[int, str, str]:
    """A batch script's train_until_signal over a fake step, USR1 sent while the step runs: (exit code, stdout,
    stderr). The stop file is tmp_path/stop; ``env`` adds to the environment, without Slurm's own variables;
    ``ack``: the step saves for the stop file (else it ends its last step without reading it)."""
    script = tmp_path / "job.sh"
    script.write_text(f"set -euo pipefail\nsource {REPO}/scripts/slurm/common.sh\n"
                      f"echo started > {tmp_path}/ready\n"
                      f"train_until_signal {sys.executable} -c '{FAKE_STEP.replace('ACK', str(ack))}'\n")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = subprocess.Popen(["bash", str(script)], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=clean | {"MEGARL_STOP_FILE": str(tmp_path / "stop")} | env)
    for _ in range(200):
        if (tmp_path / "ready").exists():
            break
        time.sleep(0.05)
    time.sleep(1.0)  # the step is running and polling
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=60)
    return proc.returncode, out, err


def test_slurm_signal_becomes_a_stop_file(tmp_path):
    """The launchers' USR1 trap: the running step is asked to checkpoint and stop, and its exit code is kept."""
    code, out, err = usr1_during_a_step(tmp_path, {})
    assert code == 0, err
    assert "USR1 from Slurm" in out and "saved and stopped" in out
    assert not (tmp_path / "stop").exists()


def test_a_stale_stop_file_of_a_requeued_job_does_not_stop_its_next_run(tmp_path):
    """A requeued job keeps its id, so its stop file can outlive the run that never acknowledged it: the next run
    must not see it (the fake step stops at once, exit 0, when it does: trained one step, COMPLETED)."""
    (tmp_path / "stop").write_text("")
    script = tmp_path / "job.sh"
    step = "import pathlib, sys; sys.exit(5 if pathlib.Path(sys.argv[-1].split('=', 1)[1]).exists() else 0)"
    script.write_text(f"set -euo pipefail\nsource {REPO}/scripts/slurm/common.sh\n"
                      f"train_until_signal {sys.executable} -c \"{step}\"\n")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = subprocess.run(["bash", str(script)], cwd=tmp_path, capture_output=True, text=True,
                          env=clean | {"MEGARL_STOP_FILE": str(tmp_path / "stop")})
    assert proc.returncode == 0, proc.stderr


def test_job_steps_get_the_batch_jobs_cpus():
    """srun no longer inherits --cpus-per-task: common.sh hands it on, unless the user set SRUN_CPUS_PER_TASK."""
    def srun_cpus(env: dict[str, str]) -> str:
        clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SRUN_"))}
        return subprocess.run(["bash", "-c", f"source {REPO}/scripts/slurm/common.sh; echo ${{SRUN_CPUS_PER_TASK:-}}"],
                              cwd=REPO, capture_output=True, text=True, env=clean | env, check=True).stdout.strip()

    assert srun_cpus({"SLURM_CPUS_PER_TASK": "64"}) == "64"
    assert srun_cpus({"SLURM_CPUS_PER_TASK": "64", "SRUN_CPUS_PER_TASK": "8"}) == "8"
    assert srun_cpus({}) == ""


def fake_scontrol(tmp_path: Path) -> dict[str, str]:
    """A scontrol that logs its calls to tmp_path/calls and succeeds; the environment that finds it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f"#!/bin/bash\necho \"$*\" >> {tmp_path}/calls\n")
    (bin_dir / "scontrol").chmod(0o755)
    return {"SLURM_JOB_ID": "77", "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def test_a_stop_request_after_the_runs_last_step_does_not_requeue_the_finished_run(tmp_path):
    """USR1 after the last step's stop check: the run ends without saving for it (the stop file stays); a requeue
    would train the finished run again."""
    code, out, err = usr1_during_a_step(tmp_path, fake_scontrol(tmp_path), ack=False)
    assert code == 0, err
    assert "finished" in out and "not requeued" in out and not (tmp_path / "calls").exists()
    assert not (tmp_path / "stop").exists()


@pytest.mark.parametrize("failures", [2, 9])
def test_a_requeue_slurmctld_refuses_is_asked_again_and_a_lost_one_says_what_to_do(tmp_path, failures):
    """After the checkpoint a USR1 asked for, `scontrol requeue` is tried again while it fails (a busy slurmctld
    times clients out): two failures, and the third try requeues the job (exit 0); nine, and after the fifth the job
    ends with one paragraph that the checkpoint is saved and the job should be submitted again (exit 1)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f"#!/bin/bash\necho \"$*\" >> {tmp_path}/calls\n"
                                      f"[ $(wc -l < {tmp_path}/calls) -gt {failures} ] && exit 0\n"
                                      "echo 'slurm_requeue error: Socket timed out' >&2; exit 1\n")
    (bin_dir / "scontrol").chmod(0o755)
    code, out, err = usr1_during_a_step(tmp_path, {"SLURM_JOB_ID": "77", "MEGARL_REQUEUE_DELAY": "0",
                                                   "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"})
    calls = (tmp_path / "calls").read_text().splitlines()
    assert "saved and stopped" in out
    if failures == 2:
        assert code == 0 and calls == ["requeue 77"] * 3, (calls, err)
        assert err.count("scontrol requeue 77 failed") == 2 and "megarl error" not in err
    else:
        assert code == 1 and calls == ["requeue 77"] * 5, (calls, err)
        last = err.strip().splitlines()[-1]
        assert last.startswith("megarl error: the run saved its checkpoint") and "Socket timed out" in last, err
        assert "submit the job again with the same checkpoint.dir" in last


def test_slurm_launchers_keep_compiled_kernels_beside_the_job(tmp_path):
    """The caches of torch.compile and Triton go to .cache/ in the job's directory, shared by its nodes and kept for
    a requeue, not each node's /tmp; a cache directory set by the user stays."""
    def caches(env: dict[str, str]) -> list[str]:
        clean = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
        out = subprocess.run(["bash", "-c", f"source {REPO}/scripts/slurm/common.sh && "
                              "echo $TORCHINDUCTOR_CACHE_DIR && echo $TRITON_CACHE_DIR"],
                             cwd=tmp_path, env=clean | env, capture_output=True, text=True, check=True).stdout
        return out.split()

    # relative: the job's directory is /workspace inside the containers' launchers
    assert caches({}) == [".cache/torchinductor", ".cache/triton"]
    assert (tmp_path / ".cache/torchinductor").is_dir() and (tmp_path / ".cache/triton").is_dir()
    mine = tmp_path / "shared"
    assert caches({"TORCHINDUCTOR_CACHE_DIR": str(mine)})[0] == str(mine) and mine.is_dir()


def test_launcher_checks_before_any_worker_starts(tmp_path):
    """A bad run directory, found in the launcher's own process: one paragraph, exit 2, no torchrun."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    for launcher in ([sys.executable, "-m", "megarl.launch"], [sys.executable]):
        proc = subprocess.run([*launcher, "megarl/train.py", "--config", "recipes/tiny_cpu_grpo.yaml", "--set",
                               f"checkpoint.dir={blocker / 'run'}"], cwd=REPO, capture_output=True, text=True,
                              env={"PYTHONPATH": str(REPO), "MEGARL_NPROC": "1", "PATH": os.environ["PATH"]},
                              timeout=120)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr and "megarl/train.py FAILED" not in proc.stderr
        assert proc.stderr.strip().splitlines()[-1].startswith(
            f"megarl error: checkpoint.dir = '{blocker / 'run'}' cannot be written"), proc.stderr


def test_a_moe_model_under_tensor_parallelism_needs_sequence_parallelism(tmp_path):
    """Megatron's MoE layers refuse to train under TP without sequence parallelism: the launcher says so
    before any worker starts, in one paragraph naming the field and the fix, exit 2."""
    from helpers import make_hf_model

    model = make_hf_model(tmp_path / "moe", "qwen3_moe")
    proc = subprocess.run([sys.executable, "megarl/train.py", "--config", "recipes/tiny_cpu_grpo.yaml", "--set",
                           f"model.hf_path={model}", "--set", "parallel.tensor_parallel=2", "--set",
                           f"checkpoint.dir={tmp_path / 'run'}"], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={"PYTHONPATH": str(REPO), "MEGARL_NPROC": "2", "PATH": os.environ["PATH"]})
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "parallel.sequence_parallel" in last and "set parallel.sequence_parallel: true" in last, last


def test_expert_parallelism_on_a_dense_model_is_refused_before_any_worker_starts(tmp_path):
    proc = subprocess.run([sys.executable, "megarl/train.py", "--config", "recipes/tiny_cpu_grpo.yaml", "--set",
                           "parallel.expert_parallel=2", "--set", f"checkpoint.dir={tmp_path / 'run'}"], cwd=REPO,
                          capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(REPO), "MEGARL_NPROC": "2", "PATH": os.environ["PATH"]})
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "parallel.expert_parallel" in last and "be 1 for a dense model" in last, last


def test_routing_replay_on_a_dense_model_is_refused_before_any_worker_starts(tmp_path):
    proc = subprocess.run([sys.executable, "megarl/train.py", "--config", "recipes/tiny_cpu_grpo.yaml", "--set",
                           "algorithm.routing_replay=true", "--set", "rollout.engine=sglang", "--set",
                           f"checkpoint.dir={tmp_path / 'run'}"], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(REPO), "MEGARL_NPROC": "1", "PATH": os.environ["PATH"]})
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "algorithm.routing_replay" in last and "be false for a dense model" in last, last


# A worker that reports the signal torchrun ends it with (torchrun passes on the one it got), then exits.
SIGNAL_WORKER = """
import pathlib, signal, sys, time
out = pathlib.Path(sys.argv[1])
for signum in (signal.SIGTERM, signal.SIGHUP):
    signal.signal(signum, lambda s, f: (out.write_text(str(s)), sys.exit(0)))
out.with_suffix(".ready").write_text("")
time.sleep(120)
"""


def test_sighup_of_the_launcher_ends_the_workers(tmp_path):
    """A closed terminal or ssh session sends the launcher SIGHUP; unforwarded, it killed the launcher and left
    torchrun and its workers running on, orphaned. The launcher then exits as the signal's, with no traceback."""
    script, out = tmp_path / "worker.py", tmp_path / "signal.txt"
    script.write_text(SIGNAL_WORKER)
    proc = subprocess.Popen([sys.executable, "-m", "megarl.launch", str(script), str(out)], cwd=REPO,
                            env=os.environ | {"PYTHONPATH": str(REPO), "MEGARL_NPROC": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not out.with_suffix(".ready").exists():
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        proc.send_signal(signal.SIGHUP)
        _, err = proc.communicate(timeout=60)
        assert out.exists(), "torchrun did not end the worker"
        # torchrun's SignalException is no traceback in the job's log (scancel sends SIGTERM the same way)
        assert "Traceback" not in err.decode() and proc.returncode == 128 + signal.SIGHUP, err.decode()[-3000:]
        assert out.read_text() in (str(int(signal.SIGTERM)), str(int(signal.SIGHUP)))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.parametrize(("sig", "why"), [("SIGKILL", "OOM killer"), ("SIGABRT", "NCCL's watchdog")])
def test_a_worker_killed_by_a_signal_is_named_last_without_a_traceback(tmp_path, sig, why):
    """SIGKILL (the OOM killer, a kill of the job step) leaves a worker no time to write its error: torchrun's report,
    then one paragraph naming the rank and the signal, no traceback, exit 1. A SIGABRT (NCCL's watchdog after a
    collective timed out, a torn-down process group) was blamed on the OOM killer."""
    script = tmp_path / "worker.py"
    script.write_text(f"import os, signal\nos.kill(os.getpid(), signal.{sig})\n")
    proc = subprocess.run([sys.executable, "-m", "megarl.launch", str(script)], cwd=REPO, capture_output=True,
                          text=True, env=os.environ | {"PYTHONPATH": str(REPO), "MEGARL_NPROC": "1"}, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"{script} FAILED" in proc.stderr  # torchrun's report
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"megarl error: rank 0 of {script} was killed by {sig}") and why in last, last



# A worker that writes its parent's (torchrun's) pid, then counts the SIGTERMs it gets and does not stop.
COUNTING_WORKER = """
import os, pathlib, signal, sys, time
out = pathlib.Path(sys.argv[1])
def count(signum, frame):
    with out.open("a") as f:
        f.write("SIGTERM\\n")
signal.signal(signal.SIGTERM, count)
out.with_suffix(".ppid").write_text(str(os.getppid()))
while True:
    time.sleep(1)
"""


def test_torchrun_acts_on_the_first_signal_only(tmp_path):
    """scancel signals every process of the job step, and the launcher forwards the signal too: torchrun gets
    SIGTERM twice, the second while it waits for its workers to stop. It used to start its shutdown again (signalling
    the workers again), and a second signal landing in its own log line printed a traceback into the job's log."""
    script, out = tmp_path / "worker.py", tmp_path / "signals.txt"
    script.write_text(COUNTING_WORKER)
    proc = subprocess.Popen([sys.executable, "-m", "megarl.launch", str(script), str(out)], cwd=REPO,
                            env=os.environ | {"PYTHONPATH": str(REPO), "MEGARL_NPROC": "1",
                                              "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "10"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)

    def wait_for(path: Path) -> None:
        deadline = time.monotonic() + 60
        while not path.exists():
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.1)

    try:
        wait_for(out.with_suffix(".ppid"))
        torchrun = int(out.with_suffix(".ppid").read_text())
        os.kill(torchrun, signal.SIGTERM)
        wait_for(out)  # torchrun is in its shutdown: it has signalled the worker and waits (10 s) for it to end
        os.kill(torchrun, signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
        text = err.decode()
        assert out.read_text().splitlines() == ["SIGTERM"], "torchrun shut its workers down more than once"
        assert "Traceback" not in text and "Logging error" not in text, text[-3000:]
        assert proc.returncode == 128 + signal.SIGTERM, text[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_a_worker_s_unforeseen_error_is_summed_up_last_and_counts_as_a_failure(tmp_path):
    """A traceback (a bug, not bad input) wrote nothing to the launcher's error file: the launcher printed no line
    of it last, and a rank that torchrun then stopped marked the mlflow run KILLED instead of FAILED."""
    script = tmp_path / "worker.py"
    script.write_text("from megarl.run.command import run_main\n"
                      "def main():\n    raise RuntimeError('boom in the reward\\n  at line 3')\n"
                      "run_main(main)\n")
    proc = subprocess.run([sys.executable, "-m", "megarl.launch", str(script)], cwd=REPO, capture_output=True,
                          text=True, env=os.environ | {"PYTHONPATH": str(REPO), "MEGARL_NPROC": "1"}, timeout=120)
    assert proc.returncode == 1 and "Traceback" in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last == "megarl error: RuntimeError: boom in the reward at line 3 (its traceback above)", last
