"""Disposing of fds a peer sent that nobody wants (SCM_RIGHTS), without letting any of them
hold up this thread: sockets defused and closed at once (Unix sockets drained first), other
files closed on bounded background threads."""

import array
import errno
import os
import queue
import resource
import socket
import struct
import threading
import time

from .constants import MAX_CHUNKS


class _Closer:
    """Background threads that close the fds a peer sent that nobody wants and that
    ``_close_all`` could not defuse: files that are not sockets (closing the last reference to
    a FUSE file runs code its sender chose, FLUSH, and may block past every timeout), and Unix
    sockets too deeply nested or too full to drain within the budget. Sockets are never queued
    here otherwise: they are defused and closed at once. One thread normally; when each has
    been inside one close for more than ``STUCK`` seconds, another (at most ``MAX``), so one
    hostile fd does not keep later refused fds open.

    The residual: a sender that can make closes block forever (a FUSE file whose server never
    answers FLUSH) can still jam all ``MAX`` threads, after which such fds queue here, open,
    until their closes return."""

    STUCK, MAX = 0.1, 8
    _lock = threading.Lock()
    _closers = []  # [queue, busy_since or None] per thread

    @classmethod
    def close(cls, fds):
        fds = list(fds)
        if not fds:
            return
        with cls._lock:
            now = time.monotonic()
            free = [c for c in cls._closers if c[1] is None or now - c[1] <= cls.STUCK]
            if free:
                closer = free[0]
            elif len(cls._closers) < cls.MAX:
                closer = [queue.SimpleQueue(), None]
                try:
                    threading.Thread(target=cls._run, args=(closer,), name="vmm-ipc-closer",
                                     daemon=True).start()
                except RuntimeError:
                    if not cls._closers:
                        for fd in fds:
                            _close_quietly(fd)
                        return
                    closer = cls._closers[-1]
                else:
                    cls._closers.append(closer)
            else:
                closer = cls._closers[-1]
            closer[0].put(fds)

    @staticmethod
    def _run(closer):
        while True:
            for fd in closer[0].get():
                closer[1] = time.monotonic()
                _close_quietly(fd)
                closer[1] = None


def _close_quietly(fd):
    try:
        os.close(fd)
    except OSError:
        pass


_LINGER_ABORT = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close resets, never waits
SO_TIMESTAMP = getattr(socket, "SO_TIMESTAMP", 29)  # asm-generic's SO_TIMESTAMP_OLD
SO_PEEK_OFF = getattr(socket, "SO_PEEK_OFF", 42)
_DEFUSE_DEPTH = 4  # Unix sockets inside Unix sockets drained, at most this deep
_DEFUSE_BUDGET = 1024  # reads and fds one disposal spends draining Unix sockets, at most
_DRAIN_RESERVE = 8  # fds a drain leaves free besides the room of the message it takes


def _close_all(fds):
    """Dispose of fds a peer sent that are refused or unwanted, without letting any of them
    hold up this thread or the listener: every socket is defused and closed at once (SO_LINGER
    on with 0 s makes a TCP close abortive and non-blocking; a Unix socket is first drained,
    non-blocking, of the fds queued in it, which are disposed of the same way, at most
    ``_DEFUSE_DEPTH`` deep and ``_DEFUSE_BUDGET`` reads and fds in all); the rest (files that
    are not sockets, Unix sockets left undrained) go to the background closer."""
    rest, budget = [], [_DEFUSE_BUDGET]
    for fd in fds:
        _dispose(fd, 0, budget, rest)
    _Closer.close(rest)


def _dispose(fd, depth, budget, rest, copy=False):
    """Defuse and close ``fd`` if it is a socket, else add it to ``rest``. A ``copy`` (of a
    reference still queued elsewhere, as a peek installs) is defused as far as it goes and
    closed here whatever it is: its close is never the last."""
    try:
        sock = socket.socket(fileno=fd)  # getsockopt only: touches no file of the sender's
    except OSError:
        if copy:
            _close_quietly(fd)
        else:
            rest.append(fd)  # not a socket
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_ABORT)
        defused = True
    except OSError:
        defused = False
    if sock.family == socket.AF_UNIX:
        defused = _drain_unix(sock, depth, budget, rest)
    if defused or copy:
        sock.close()
    else:
        rest.append(sock.detach())


def _drain_unix(sock, depth, budget, rest):
    """Take every fd queued in the Unix socket ``sock`` (connections waiting on a listening
    one, messages of a connected or datagram one) and dispose of them at ``depth + 1``, so
    that closing ``sock`` releases no hostile file on this thread. True when it is known to be
    empty; False when the depth or the budget ran out first (close it on the closer).

    After ``SHUT_RD`` an empty queue reads as end of file, as does an empty packet; with
    ``SO_TIMESTAMP`` every packet carries a timestamp and the end does not, which tells them
    apart. A message is taken only when all its fds fit in the room this process has left
    (less ``_DRAIN_RESERVE``), as a peek first tells."""
    if depth >= _DEFUSE_DEPTH:
        return False
    try:
        listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
    except OSError:
        listening = 0
    if listening:
        try:
            sock.setblocking(False)
        except OSError:
            return False
        while budget[0] > 0:
            budget[0] -= 1
            try:
                fd, _ = sock._accept()
            except (BlockingIOError, InterruptedError):
                return True
            except OSError:
                return False
            _dispose(fd, depth + 1, budget, rest)
        return False
    try:
        sock.shutdown(socket.SHUT_RD)  # nothing more can be queued
    except OSError:
        pass
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMP, 1)
        stamped = True
    except OSError:
        stamped = False
    try:  # a peek offset its sender set would make the peek below see another message
        sock.setsockopt(socket.SOL_SOCKET, SO_PEEK_OFF, -1)
    except OSError:
        pass
    stream = sock.type == socket.SOCK_STREAM
    flags = socket.MSG_DONTWAIT | getattr(socket, "MSG_CMSG_CLOEXEC", 0)
    while budget[0] > 0:
        budget[0] -= 1
        # Fds the kernel cannot install in a receive it drops in the receiving thread: the
        # very close this avoids. So first peek (a peek installs copies, and drops only
        # copies) with the room there is; take the message only when all its fds fit, else
        # defuse what the peek showed and leave the socket to the closer.
        room = min(_fd_room() - _DRAIN_RESERVE, MAX_CHUNKS)
        if room < 1:
            return False
        space = socket.CMSG_SPACE(room * 4) + socket.CMSG_SPACE(16)
        try:
            msg, ancdata, got, _ = sock.recvmsg(65536, space, flags | socket.MSG_PEEK)
            fds, stamp = _cmsg_fds(ancdata)
            if got & socket.MSG_CTRUNC:
                for fd in fds:
                    budget[0] -= 1
                    _dispose(fd, depth + 1, budget, rest, copy=True)
                return False
            for fd in fds:
                os.close(fd)  # a copy: the queued reference stays
            peeked, fds = bool(msg or fds or stamp), []
            if peeked:
                msg, ancdata, got, _ = sock.recvmsg(65536, space, flags)
                fds, stamp = _cmsg_fds(ancdata)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError as e:
            return e.errno in (errno.ENOTCONN, errno.EINVAL)
        for fd in fds:
            budget[0] -= 1
            _dispose(fd, depth + 1, budget, rest)
        if got & socket.MSG_CTRUNC:
            return False
        if not msg and not fds and (stream or (stamped and not stamp)):
            return True  # the end: nothing is queued
    return False


def _cmsg_fds(ancdata):
    """The fds of a receive's SCM_RIGHTS, and whether it carried a timestamp."""
    fds, stamp = array.array("i"), False
    for level, kind, cmsg in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(cmsg[:len(cmsg) - len(cmsg) % fds.itemsize])
        elif level == socket.SOL_SOCKET and kind == SO_TIMESTAMP:
            stamp = True
    return list(fds), stamp


def _fd_room():
    """How many more fds this process may open, about (0 when it cannot tell: listing its
    fds takes one)."""
    try:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        used = len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0
    return 1 << 20 if soft == resource.RLIM_INFINITY else soft - used
