"""How a command ends: a UserError as one paragraph and exit code 2, an interrupt as 128 + the signal, a finished
run on a GPU without C++ static destructors."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from megarl.errors import UserError, failed, report
from megarl.run.interrupt import Interrupted, handle


def end_finished_run() -> None:
    """The last call of a run that finished, on a GPU: Python's exit handlers run (mlflow, logging,
    multiprocessing's resource tracker), then the process ends without C++ static destructors. The engine's
    processes are gone by now (shutdown waits for them), but they never released the CUDA IPC handles of the
    trainer's tensors they mapped, and torch's bookkeeping of those would print "Producer process has been
    terminated before all shared CUDA tensors released" at exit; the driver frees the memory either way."""
    import atexit

    import torch

    if not torch.cuda.is_available():
        return
    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_main(main: Callable[[], object]) -> None:
    """Run a CLI entry point: a UserError becomes one paragraph on stderr and exit code 2. Under several
    ranks, an error every rank raises is reported by rank 0 only. Any error runs the ``at_failure`` clean-ups,
    an interrupt the ``at_interrupt`` ones (megarl.run.interrupt)."""
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
        rank = os.environ.get("RANK")
        if rank in (None, "0") or not err.on_every_rank:
            prefix = f"megarl error (rank {rank}): " if rank not in (None, "0") else "megarl error: "
            report(prefix + " ".join(str(err).split()))
        sys.exit(2)
    except BaseException as err:  # a bug or an unforeseen error: its traceback, and the run marked failed
        if not isinstance(err, SystemExit) or err.code not in (None, 0):
            failed()
        raise
