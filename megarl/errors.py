"""User-facing errors: one paragraph, exit code 2, no traceback unless MEGARL_DEBUG=1."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import NoReturn


class UserError(ValueError):
    """Bad input from the user (config, checkpoint, data, CLI flags).

    The message must name what is wrong (field or path), the value seen, and how to fix it.
    """


def fail(message: str) -> NoReturn:
    raise UserError(message)


def run_main(main: Callable[[], object]) -> None:
    """Run a CLI entry point: a UserError becomes one paragraph on stderr and exit code 2."""
    try:
        main()
    except UserError as err:
        if os.environ.get("MEGARL_DEBUG") == "1":
            raise
        rank = os.environ.get("RANK")
        prefix = f"megarl error (rank {rank}): " if rank not in (None, "0") else "megarl error: "
        print(prefix + " ".join(str(err).split()), file=sys.stderr, flush=True)
        sys.exit(2)
