"""How a command ends: a UserError as one paragraph and exit code 2 (under several ranks without C++ destructors,
which would abort once the others close their connections), an interrupt as 128 + the signal, a rank that
lost another rank in one line and exit code 1, a finished run on a GPU without C++ static destructors."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from megarl.errors import BUG, UserError, failed, file_error, report
from megarl.run.interrupt import Interrupted, handle


def end_finished_run() -> None:
    """The last call of a run that finished, on a GPU: Python's exit handlers run (mlflow, logging,
    multiprocessing's resource tracker), then the process ends without C++ static destructors. The engine's
    processes are gone by now (shutdown waits for them), but they never released the CUDA IPC handles of the
    trainer's tensors they mapped, and torch's bookkeeping of those would print "Producer process has been
    terminated before all shared CUDA tensors released" at exit; the driver frees the memory either way."""
    import torch

    if not torch.cuda.is_available():
        return
    exit_now(0)


def exit_now(code: int) -> None:
    """End the process with ``code`` after Python's exit handlers, without C++ static destructors: besides the
    engines' CUDA IPC handles (end_finished_run), a process group whose peer is gone aborts in its destructor."""
    import atexit

    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_main(main: Callable[[], object]) -> None:
    """Run a CLI entry point: a UserError becomes one paragraph on stderr and exit code 2. Under several
    ranks, an error every rank raises is reported by rank 0 only, and a rank whose collective fails because another
    rank's process ended says so in one line (exit code 1) instead of a traceback that would bury that rank's
    error. Any error runs the ``at_failure`` clean-ups, an interrupt the ``at_interrupt`` ones
    (megarl.run.interrupt)."""
    try:
        main()
    except (Interrupted, KeyboardInterrupt) as stop:
        if os.environ.get("MEGARL_DEBUG") == "1":
            raise
        handle(stop)
    except UserError as err:
        failed()
        if os.environ.get("MEGARL_DEBUG") == "1":
            raise
        if os.environ.get("RANK") in (None, "0") or err.on_every_rank is False or (
                err.on_every_rank is None and _in_process_group()):
            text = " ".join(str(err).split())
            report(f"{_error_label()}: {text}", filed=f"megarl error: {text}" if err.on_every_rank is None else None)
        if _in_process_group():  # other ranks may close their connections first: gloo's destructor would abort
            exit_now(2)
        sys.exit(2)
    except BaseException as err:  # a bug or an unforeseen error: its traceback, and the run marked failed
        if not isinstance(err, SystemExit) or err.code not in (None, 0):
            failed()
        if lost_peer(err) and os.environ.get("MEGARL_DEBUG") != "1":
            # Not through report(): the launcher prints the error file's lines last, and this one is an echo of
            # the error that ended the other rank, not the cause.
            print(f"megarl: rank {os.environ.get('RANK')} stopped: another rank closed its connection, most likely "
                  "because it ended first with the error above (MEGARL_DEBUG=1 shows this rank's traceback). "
                  f"{' '.join(str(err).split())}", file=sys.stderr, flush=True)
            exit_now(1)
        if not isinstance(err, (SystemExit, KeyboardInterrupt)):
            file_error(f"{_error_label()}: {type(err).__name__}: {' '.join(str(err).split())}{BUG}")
        raise


def _error_label() -> str:
    """"megarl error", naming this process's rank where it is not rank 0."""
    rank = os.environ.get("RANK")
    return "megarl error" if rank in (None, "0") else f"megarl error (rank {rank})"


def _in_process_group() -> bool:
    """Whether this process is one rank of several in an initialized torch.distributed process group (without
    importing torch)."""
    dist = sys.modules.get("torch.distributed")
    return (int(os.environ.get("WORLD_SIZE", "1")) > 1 and dist is not None and dist.is_available()
            and dist.is_initialized())


PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "remote process exited", "ncclRemoteError")
"""What gloo's and NCCL's errors say when the process at the other end of a collective is gone."""


def lost_peer(err: BaseException) -> bool:
    """Whether ``err`` is a collective failing because another rank's process ended (under several ranks only)."""
    return (int(os.environ.get("WORLD_SIZE", "1")) > 1 and isinstance(err, RuntimeError)
            and any(text in str(err) for text in PEER_LOST))
