"""Start torchrun for megarl: on every node of a Slurm allocation, or on this machine alone.

  srun --ntasks-per-node 1 python -m megarl.launch megarl/train.py --config RECIPE   # one task per node
  python -m megarl.launch megarl/train.py --config RECIPE    # outside Slurm: all GPUs here (MEGARL_NPROC)
  python -m megarl.launch --print megarl/train.py ...        # show the command

Nodes rendezvous through c10d at the first node of SLURM_JOB_NODELIST (port MEGARL_RDZV_PORT,
default 29500) under the job id, so all nodes find each other without a shared file system.

For megarl/train.py the launcher first checks, in this one process, everything that can be checked
before a worker starts (config, run directory, layout, memory plan, prompts). A worker's error comes
back through a file (MEGARL_ERROR_FILE) and is printed once, after torchrun's own report, with exit code 2.
"""

from __future__ import annotations

import itertools
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Mapping

from megarl.errors import BUG, ERROR_FILE, UserError
from megarl.run.command import run_main


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand Slurm's compressed host list: "gpu[01-03,07],login1" -> [gpu01, gpu02, gpu03, gpu07, login1]; text
    after a bracket and several brackets in a name too ("gpu[01-02]-ib", "r[1-2]n[1-2]"), in Slurm's order."""
    names, depth, start = [], 0, 0
    for i, c in enumerate(nodelist + ","):
        depth += (c == "[") - (c == "]")
        if c == "," and depth == 0:
            names.append(nodelist[start:i])
            start = i + 1
    hosts = []
    for name in filter(None, names):
        parts = re.split(r"\[([^\]]*)\]", name)  # text, ranges, text, ranges, ..., text
        choices = [[parts[0]]]
        for ranges, text in zip(parts[1::2], parts[2::2], strict=True):
            choices += [_expand_ranges(ranges), [text]]
        hosts += ["".join(c) for c in itertools.product(*choices)]
    return hosts


def _expand_ranges(ranges: str) -> list[str]:
    """ "01-03,07" -> [01, 02, 03, 07]: zero-padded as written."""
    out = []
    for part in ranges.split(","):
        lo, _, hi = part.partition("-")
        out += [f"{i:0{len(lo)}d}" for i in range(int(lo), int(hi or lo) + 1)]
    return out


def _gpus_per_node(env: Mapping[str, str]) -> int:
    # not SLURM_NTASKS_PER_NODE: the launchers start one task per node, whatever its GPUs
    for key in ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE"):
        value = env.get(key, "")
        digits = value.split(":")[-1].split("(")[0]  # "h100:8" or "8(x2)"
        if digits.isdigit() and int(digits) > 0:
            return int(digits)
    raise UserError("cannot tell how many GPUs each node has: none of SLURM_GPUS_ON_NODE, SLURM_GPUS_PER_NODE "
                    "is set. Request GPUs with `#SBATCH --gpus-per-node=8` (or set MEGARL_GPUS_PER_NODE).")


def trainer_ranks(gpus: int, reserved: int, where: str) -> int:
    """Trainer ranks on a node of ``gpus`` GPUs whose last ``reserved`` run the engines (async_rl.engine_gpus)."""
    if gpus - reserved < 1:
        raise UserError(f"async_rl.engine_gpus = {reserved} leaves no GPU for the trainer: {where} has {gpus}. "
                        "Give the engines fewer GPUs, or run where there are more.")
    return gpus - reserved


def env_count(env: Mapping[str, str], name: str, what: str) -> int:
    """The whole number >= 1 in environment variable ``name``; anything else is a UserError naming it."""
    value = env[name]
    if not value.strip().isdigit() or int(value) < 1:
        raise UserError(f"{name} = {value!r} must be a whole number >= 1 ({what}). Fix: set it to one, or unset it.")
    return int(value)


def torchrun_command(script_args: list[str], env: Mapping[str, str], reserved: int = 0) -> list[str]:
    """The torchrun command line for this node of the allocation (``reserved``: GPUs each node keeps for the
    engines, async_rl.engine_gpus)."""
    missing = [k for k in ("SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURM_NNODES") if not env.get(k)]
    if missing:
        raise UserError(f"{', '.join(missing)} not set: `python -m megarl.launch` must run inside a Slurm job "
                        "(sbatch/salloc + srun). Outside Slurm call torchrun directly.")
    hosts = expand_nodelist(env["SLURM_JOB_NODELIST"])
    nnodes = env_count(env, "SLURM_NNODES", "the nodes of the Slurm job")
    if len(hosts) != nnodes:
        raise UserError(f"SLURM_JOB_NODELIST={env['SLURM_JOB_NODELIST']!r} expands to {len(hosts)} hosts but "
                        f"SLURM_NNODES={nnodes}.")
    gpus = env_count(env, "MEGARL_GPUS_PER_NODE", "GPUs per node") if env.get("MEGARL_GPUS_PER_NODE") \
        else _gpus_per_node(env)
    gpus = trainer_ranks(gpus, reserved, "each node of the allocation")
    port = env.get("MEGARL_RDZV_PORT", "29500")
    return ["torchrun", f"--nnodes={nnodes}", f"--nproc-per-node={gpus}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={hosts[0]}:{port}", f"--rdzv-id={env['SLURM_JOB_ID']}", "--max-restarts=0",
            *script_args]


def check_rendezvous_host(cmd: list[str], env: Mapping[str, str]) -> None:
    """On a node of a job of several nodes, before torchrun: torchrun's c10d rendezvous lets the node that takes the
    endpoint (the job's first node, by its Slurm name) for itself host the store, judging by this node's hostname
    and the address it resolves to. Where the first node does not, every node waits for a store no node starts and
    the rendezvous times out with no word on why; where a name does not resolve, torchrun fails with a traceback
    about name resolution (and a worker's MASTER_ADDR can be that name). Both named here, at once."""
    option = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in cmd if a.startswith("--") and "=" in a}
    if int(option.get("--nnodes", "1")) < 2 or "--rdzv-endpoint" not in option:
        return
    host = option["--rdzv-endpoint"].rsplit(":", 1)[0]
    here, node, node_id = socket.gethostname(), env.get("SLURMD_NODENAME", "?"), env.get("SLURM_NODEID", "?")
    fix = ("Each node's hostname must be its Slurm node name (or resolve to the address the node name resolves to) "
           "for torchrun's rendezvous to find the first node: set the hostnames, or the NodeName/NodeHostname "
           "entries of slurm.conf, to match.")
    for name, what in ((host, f"the rendezvous endpoint {host!r} (the job's first node)"),
                       (here, f"this node's hostname {here!r}")):
        try:
            socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)
        except (OSError, UnicodeError) as err:
            raise UserError(f"{what} does not resolve on node {node!r} (SLURM_NODEID={node_id}): {err}. "
                            f"{fix}") from None
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

    if node_id == "0" and not _matches_machine_hostname(host):
        raise UserError(f"node {node!r} is the job's first node (SLURM_NODEID=0), where torchrun's rendezvous store "
                        f"must run, but torchrun would not start it: its hostname {here!r} is not the endpoint "
                        f"{host!r}, nor does it resolve to the endpoint's address. Every node would wait for a store "
                        f"no node starts. {fix}")


def standalone_command(script_args: list[str], env: Mapping[str, str], reserved: int = 0) -> list[str]:
    """torchrun on this machine alone: MEGARL_NPROC ranks, else one per visible GPU (CUDA_VISIBLE_DEVICES or
    nvidia-smi) but the ``reserved`` last (the engines', async_rl.engine_gpus), else one."""
    if env.get("MEGARL_NPROC"):
        nproc = env_count(env, "MEGARL_NPROC", "the trainer ranks to start")
    elif env.get("CUDA_VISIBLE_DEVICES"):
        nproc = trainer_ranks(len(env["CUDA_VISIBLE_DEVICES"].split(",")), reserved, "CUDA_VISIBLE_DEVICES")
    else:  # nvidia-smi, not torch: no CUDA context in the launcher
        try:
            out = subprocess.run(["nvidia-smi", "--list-gpus"], capture_output=True, text=True, timeout=60)
            gpus = len(out.stdout.splitlines()) if out.returncode == 0 else 0
        except (OSError, subprocess.TimeoutExpired):
            gpus = 0
        nproc = trainer_ranks(gpus, reserved, "this machine") if gpus else 1
    return ["torchrun", "--standalone", f"--nproc-per-node={nproc}", *script_args]


def _world(cmd: list[str]) -> tuple[int, int]:
    """(world size, ranks per node) of a torchrun command line."""
    option = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in cmd if a.startswith("--") and "=" in a}
    per_node = int(option["--nproc-per-node"])
    return int(option.get("--nnodes", "1")) * per_node, per_node


def precheck(script_args: list[str], world: int, per_node: int) -> None:
    """For megarl/train.py: the checks every worker would make, made once, here, before any starts."""
    if not script_args[0].endswith("train.py"):
        return
    from megarl.loop.bootstrap import check_run
    from megarl.train import parse_args

    args = parse_args(script_args[1:])
    check_run(args.config, args.set, world, per_node, gpu_bytes=gpu_memory_bytes())


def engine_gpus(script_args: list[str]) -> int:
    """The GPUs megarl/train.py's config keeps for its engines (async_rl.engine_gpus; 0 for other scripts, and
    without a config, which the precheck then asks for)."""
    if not script_args[0].endswith("train.py") or not any(a.startswith("--config") for a in script_args[1:]):
        return 0
    from megarl.config import load_config
    from megarl.train import parse_args

    args = parse_args(script_args[1:])
    return load_config(args.config, args.set).async_rl.engine_gpus


def gpu_memory_bytes() -> int:
    """Memory of this machine's first GPU as nvidia-smi reports it, 0 without one. Not through torch: a CUDA
    context here would hold memory on GPU 0 for the whole run."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    fields = out.stdout.split()
    return int(fields[0]) * 2**20 if out.returncode == 0 and fields and fields[0].isdigit() else 0


# torchrun of this interpreter (whether or not its bin/ is on PATH), its tracebacks left out of the job's log. Ended by
# a signal (scancel's SIGTERM, forwarded below), it stops its workers and raises SignalException: it exits 128 + the
# signal's number instead, as a process the signal ended would, leaving the trainer's own line saying how to resume
# last. A worker killed by a signal (the OOM killer, a kill of the job step) writes no error of its own: torchrun's
# report is printed without its traceback, then one paragraph saying so. torchrun acts on the first signal only:
# under scancel it gets SIGTERM twice (from slurmstepd and from this launcher), and a second SignalException raised
# inside its shutdown (in the middle of its own log line) would print a traceback and cut the shutdown short.
TORCHRUN = """import signal, sys
from torch.distributed.elastic.multiprocessing import api
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main
received = []
def first_signal_only(signum, frame):
    if received:
        return
    received.append(signum)
    raise SignalException(f"torchrun got {signal.Signals(signum).name}", sigval=signal.Signals(signum))
api._terminate_process_handler = first_signal_only
try:
    main()
except SignalException as e:
    sys.exit(128 + int(e.sigval))
except ChildFailedError as e:
    print(e, file=sys.stderr)
    rank, failure = e.get_first_failure()
    if failure.exitcode < 0:
        signal_name = failure.signal_name()
        why = {"SIGKILL": "by the kernel's OOM killer (see dmesg), a kill of the job step, or its node's failure",
               "SIGABRT": "by an abort in native code: most often NCCL's watchdog ending a collective that timed out "
                          "(parallel.timeout_minutes) while another rank was stuck or gone, or a process group torn "
                          "down after the error above"}.get(
            signal_name, "by a signal from outside: torchrun ends the other ranks once one fails (see the error "
                         "above), or the job was cancelled")
        print(f"megarl error: rank {rank} of {e.name} was killed by {signal_name}, not stopped by an error of its "
              f"own: {why}. A training run resumes from its newest complete checkpoint with checkpoint.resume: auto.",
              file=sys.stderr, flush=True)
    sys.exit(1)
"""


def run(cmd: list[str]) -> int:
    """Run torchrun with an error file; forward SIGTERM (Slurm, scancel) and SIGHUP (a closed terminal or
    ssh session) to it and let Ctrl-C reach the workers, which share the terminal. A worker's error paragraph
    is printed last, once."""
    with tempfile.NamedTemporaryFile(prefix="megarl-error-", delete=False) as f:
        error_file = f.name
    try:
        argv = [sys.executable, "-c", TORCHRUN, *cmd[1:]]
        child = subprocess.Popen(argv, env=os.environ | {ERROR_FILE: error_file})
        for forwarded in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(forwarded, lambda signum, frame: child.send_signal(signum))
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        code = child.wait()
        lines = list(dict.fromkeys(open(error_file).read().splitlines()))
    finally:
        os.unlink(error_file)
    if code != 0 and lines:
        print("\n".join(lines), file=sys.stderr, flush=True)
        return 1 if all(line.endswith(BUG) for line in lines) else 2
    return code if code >= 0 else 128 - code


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    show = bool(args) and args[0] == "--print"
    if show:
        args = args[1:]
    if not args:
        raise UserError("usage: python -m megarl.launch [--print] SCRIPT [ARGS...], e.g. megarl/train.py "
                        "--config recipes/llama3_8b_ppo.yaml")
    env = os.environ
    reserved = engine_gpus(args)
    cmd = torchrun_command(args, env, reserved) if env.get("SLURM_JOB_ID") else standalone_command(args, env, reserved)
    print(shlex.join(cmd), flush=True)
    if show:
        return
    check_rendezvous_host(cmd, env)
    precheck(args, *_world(cmd))
    sys.exit(run(cmd))


if __name__ == "__main__":
    run_main(main)
