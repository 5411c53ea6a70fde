"""User-facing errors: one paragraph, exit code 2, no traceback unless MEGARL_DEBUG=1."""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import NoReturn, TextIO


class UserError(ValueError):
    """Bad input from the user (config, checkpoint, data, CLI flags).

    The message must name what is wrong (field or path), the value seen, and how to fix it.
    """

    on_every_rank: bool | None = None
    """True: raised alike by every rank (a non-finite loss, the start-up's checks of the same files): rank 0 alone
    reports it. False: only some ranks see it (an engine's driver): each reports it. None, unknown: rank 0 reports
    it, and so does another rank once the process group is up; before it every rank checks the same config and data,
    after it an error may be that rank's alone, and unreported the run would end with no error at all."""


class TrainingDiverged(UserError):
    """A NaN or infinity in training. Reported like bad input (one paragraph, exit 2) and raised on every
    rank at the same point, before the step's weights can reach a checkpoint."""

    on_every_rank = True


class HandoverMismatch(UserError):
    """The engine's parameters after a hand-over differ from the trainer's weights (rollout.verify_every).
    Raised on every rank at the same point, before the engine generates with them."""

    on_every_rank = True


@contextmanager
def raised_alike() -> Iterator[None]:
    """A block every rank runs alike (the same checks of the same files): a UserError from it is every rank's."""
    try:
        yield
    except UserError as err:
        if err.on_every_rank is None:
            err.on_every_rank = True
        raise


def check_finite(where: str, values: Mapping[str, float], hint: str) -> None:
    """Raise TrainingDiverged naming ``where`` (e.g. "step 3") and every NaN or infinity among ``values``.

    Comparisons with NaN are all false, so a NaN passes every bound check and would train silently.
    """
    bad = {name: value for name, value in values.items() if not math.isfinite(value)}
    if bad:
        raise TrainingDiverged(f"{where}: {', '.join(f'{k} = {v}' for k, v in bad.items())}. {hint} Training "
                               "stopped before this step reached a checkpoint; the last complete checkpoint is "
                               "intact. Rerun with MEGARL_DEBUG=1 for a traceback.")


def fail(message: str) -> NoReturn:
    raise UserError(message)


_at_failure: list[Callable[[], object]] = []


def at_failure(cleanup: Callable[[], object]) -> None:
    """Run ``cleanup`` (last registered first) when the run ends with an error (``run_main``, or an engine
    call's deadline: megarl.rollout.failures), e.g. to mark the mlflow run FAILED."""
    _at_failure.append(cleanup)


def failed() -> None:
    """Run the failure clean-ups, once; one that fails is reported in a line, never in place of the error."""
    while _at_failure:
        cleanup = _at_failure.pop()
        try:
            cleanup()
        except Exception as err:
            print(f"megarl: clean-up after the error failed: {type(err).__name__}: {err}", file=sys.stderr)


ERROR_FILE = "MEGARL_ERROR_FILE"
"""Where workers append their error paragraph, for the launcher (megarl.launch) to print it last."""


BUG = " (its traceback above)"
"""The end of an error file's line for an error that is not the user's (a traceback): the launcher exits 1, not 2."""


def file_error(line: str) -> None:
    """``line`` in the launcher's error file alone (an error whose traceback the console gets): the launcher prints
    it last, and a rank that another rank's failure interrupts marks the mlflow run FAILED, not KILLED."""
    if os.environ.get(ERROR_FILE):
        with open(os.environ[ERROR_FILE], "a") as f:
            f.write(line + "\n")


def report(line: str, console: TextIO | None = None, filed: str | None = None) -> None:
    """An error's one line on ``console`` (None: stderr), and in the launcher's error file (``filed`` there where
    given: the same error from several ranks, written alike, is printed once)."""
    print(line, file=console or sys.stderr, flush=True)
    file_error(filed or line)
