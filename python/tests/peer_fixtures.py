"""Helpers the standard-library peer's unit tests share (``test_vmm_ipc_peer``,
``test_vmm_ipc_attacks``, ``test_vmm_ipc_availability``): fd counts, endpoint names, a raw
client, and where the peer package lies for the processes a test starts."""

import os
import socket
import threading

import vmm_ipc_peer as peer


def open_fds():
    return len(os.listdir("/proc/self/fd")) - 1


def unique(tag):
    return f"@vmm-py-{tag}-{os.getpid()}-{threading.get_ident()}"


def raw_client(name):
    """A connected socket that skips the handshake's checks (a hostile but admitted peer)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(5)
    sock.connect(peer._address(name))
    return sock


def peer_pythonpath():
    """The directory that holds the ``vmm_ipc_peer`` package: a child process's PYTHONPATH."""
    return os.path.dirname(os.path.dirname(os.path.abspath(peer.__file__)))
