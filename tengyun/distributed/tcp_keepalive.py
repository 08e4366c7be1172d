"""How a link between nodes notices a cut network, for both node links (executor/node_link.py for
tensor / pipeline ranks, engine/data_parallel_link.py for data-parallel replicas); torch-free.

A cut network (a link down, a host powered off) sends no FIN: TCP keepalive probes an idle
connection every second after 2 s, and TCP_USER_TIMEOUT bounds unacknowledged data, so either
side's socket errors (reads as closed) about LOST_AFTER_S after the peer's last answer.
"""

from __future__ import annotations

import socket

LOST_AFTER_S = 5


def watch_peer(sock: socket.socket) -> None:
    """Keepalive and user timeout on a link connection (Linux; elsewhere only SO_KEEPALIVE)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", 2), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", LOST_AFTER_S - 2),
                          ("TCP_USER_TIMEOUT", LOST_AFTER_S * 1000)):
        if hasattr(socket, option):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
