"""Free TCP ports for stages that ask for them (``ports = N``)."""

from __future__ import annotations

import socket


def free_ports(count: int, taken: set[int]) -> list[int]:
    """``count`` distinct TCP ports that are free on this machine now (the kernel picks
    them: bind to port 0) and not in ``taken``."""
    ports: list[int] = []
    held: list[socket.socket] = []
    try:
        while len(ports) < count:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(sock)  # kept open until all are chosen: no duplicates
            sock.bind(("", 0))
            port = sock.getsockname()[1]
            if port not in taken and port not in ports:
                ports.append(port)
    finally:
        for sock in held:
            sock.close()
    return ports
