"""A free TCP port for a meeting point that one process serves (torch.distributed's stores)."""

from __future__ import annotations

import socket


def free_port(host: str = "") -> int:
    """A TCP port on ``host`` ("" = every interface) that no process listens on now."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
