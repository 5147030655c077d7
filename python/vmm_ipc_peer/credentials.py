"""Kernel credentials of a Unix socket's peer (SO_PEERCRED) and the admission rule built on
them, the overflow uid included."""

import socket
import struct
from collections import namedtuple


Credentials = namedtuple("Credentials", "pid uid gid")


def peer_credentials(sock):
    """The kernel's credentials for the peer of a connected Unix socket (SO_PEERCRED)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("iII"))
    return Credentials(*struct.unpack("iII", raw))


def _read_overflow_ids():
    try:
        with open("/proc/sys/kernel/overflowuid") as u, open("/proc/sys/kernel/overflowgid") as g:
            return int(u.read()), int(g.read())
    except (OSError, ValueError):
        return None


# Read once, at import: a listener near its fd limit cannot open them again (and then had to
# treat every uid as possibly the overflow uid, refusing its own).
_OVERFLOW_IDS = _read_overflow_ids()


def overflow_ids():
    """The kernel's overflow uid and gid (``/proc/sys/kernel/overflowuid``, ``overflowgid``):
    what an id with no mapping in this user namespace reads as. Read once (at import; tried
    again only while it could not be read) and cached. None when they cannot be read (then
    every uid is treated as possibly the overflow uid: fail closed)."""
    global _OVERFLOW_IDS
    if _OVERFLOW_IDS is None:
        _OVERFLOW_IDS = _read_overflow_ids()
    return _OVERFLOW_IDS


def _maybe_overflow_uid(uid):
    ids = overflow_ids()
    return ids is None or ids[0] == uid


def _overflow_note(creds):
    ids = overflow_ids()
    if ids is None:
        return (" (the overflow uid cannot be read from /proc/sys/kernel/overflowuid, so a uid is "
                "admitted only when named)")
    if creds.uid == ids[0]:
        return (f" (uid {ids[0]} is the overflow uid: the process's uid has no mapping in this user "
                f"namespace, and it stands for every such user; admitted only when named)")
    return ""


def _admits(uids, gids, creds, implicit=None):
    """Whether ``creds`` is admitted by ``uids`` or ``gids``. ``implicit`` is the uid a default
    put in (this process's own): it never admits the overflow uid."""
    by_uid = creds.uid in uids and (creds.uid != implicit or not _maybe_overflow_uid(creds.uid))
    return by_uid or creds.gid in gids
