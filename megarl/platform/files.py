"""Durable files: what a rename publishes must be on disk first."""

import os
from pathlib import Path


def fsync_file(path: Path) -> None:
    """fsync a file or a directory (a directory's fsync makes its created and renamed entries durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
