"""Named endpoints (Unix SOCK_SEQPACKET, by path or abstract ``@name``): ``connect`` and
``Listener``, each side checked by its kernel credentials, and the admitted ``Connection``."""

import array
import collections
import errno
import os
import socket
import stat
import time
import weakref

from .accepting import _RefusalLog, _accept_retrying
from .constants import (
    DEFAULT_TIMEOUT, FRAME_INLINE, IDLE_TIMEOUT, KIND_DATA, KIND_HELLO, KIND_REFUSED,
    MAX_CHUNKS, MAX_CONNECTIONS, MAX_MESSAGE, MAX_PER_UID, _DRAIN_MAX,
)
from .credentials import _admits, _maybe_overflow_uid, _overflow_note, peer_credentials
from .decoding import _Receives, _decode, _discard
from .errors import PeerClosed, PeerRefused, ProtocolError
from .framing import Hello, Refused, encode
from .hostile_fds import _Closer, _close_all, _drain_unix


def _address(name):
    """``@name`` is an abstract socket; anything else a path."""
    if isinstance(name, bytes):
        name = name.decode()
    return b"\0" + name[1:].encode() if name.startswith("@") else name


class Connection(_Receives):
    """An admitted connection: send and receive descriptors and DATA messages. ``peer`` is the
    kernel's Credentials for the other side. Every send and receive is bounded by ``timeout``
    (seconds; None for no limit): TimeoutError (socket.timeout) when it passes."""

    def __init__(self, sock, peer, name, timeout=DEFAULT_TIMEOUT):
        self.sock, self.peer, self.name = sock, peer, name
        self.sock.settimeout(timeout)
        self.active = time.monotonic()  # when a message last crossed (either way)
        self.ended_by_listener = None  # why the listener shut it down (idle, or made room)

    def _send(self, data, fds=()):
        if fds:
            socket.send_fds(self.sock, [FRAME_INLINE, data], list(fds))
        else:
            self.sock.sendmsg([FRAME_INLINE, data])
        self.active = time.monotonic()

    @property
    def closed(self):
        return self.sock.fileno() == -1

    def _end(self, why):
        """Shut the connection down from the listener (another thread may be inside a receive
        on it: it wakes, and reads PeerClosed naming ``why``); the owner still closes it."""
        self.ended_by_listener = why
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def send_descriptor(self, descriptor):
        """Send a VmmDescriptor or HostDescriptor (it keeps its fds: close it afterwards), or a
        FabricDescriptor (a bearer token: send it only to a peer you would give the memory)."""
        data, fds = descriptor.encode()
        self._send(data, fds)

    def send_data(self, data):
        self._send(encode(KIND_DATA, payload=bytes(data)))

    def recv(self):
        """The next message: Data, VmmDescriptor, HostDescriptor (the caller owns their fds) or
        FabricDescriptor."""
        message = self._recv()
        if isinstance(message, (Hello, Refused)):
            raise ProtocolError(f"{type(message).__name__.upper()} after the handshake")
        return message


    def _recv(self):
        space = socket.CMSG_SPACE(MAX_CHUNKS * array.array("i").itemsize)
        msg, ancdata, flags, _ = self.sock.recvmsg(1 + MAX_MESSAGE, space,
                                                   getattr(socket, "MSG_CMSG_CLOEXEC", 0))
        fds = array.array("i")
        for level, kind, cmsg in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(cmsg[:len(cmsg) - len(cmsg) % fds.itemsize])
        fds = list(fds)
        if flags & socket.MSG_CTRUNC:
            _close_all(fds)
            raise ProtocolError(f"control message truncated: the sender's fds did not all arrive "
                                f"({len(fds)} did, closed)")
        if flags & socket.MSG_TRUNC:
            _close_all(fds)
            raise ProtocolError(f"packet larger than {1 + MAX_MESSAGE} bytes")
        if not msg:
            _close_all(fds)
            if self.ended_by_listener:
                raise PeerClosed(f"endpoint {self.name}: the listener shut this connection "
                                 f"down ({self.ended_by_listener})")
            raise PeerClosed(f"endpoint {self.name}: the other end has closed")
        self.active = time.monotonic()
        if msg[0] != 0:
            _close_all(fds)
            raise ProtocolError(f"frame byte {msg[0]}: a peer message starts with 0 (its fds "
                                f"closed unread)")
        try:
            return _decode(bytes(msg[1:]), fds)
        except ProtocolError:
            _close_all(fds)  # off this thread: a hostile fd's close may block
            raise

    def close(self):
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def connect(name, expect_uids=None, expect_gids=(), timeout=DEFAULT_TIMEOUT):
    """Connect to the endpoint ``name`` (a path, or ``@name``), check the listener's kernel
    credentials before anything is sent or read (default: it must run as this process's uid),
    and wait to be admitted. PeerRefused when the listener is not expected or refuses us."""
    implicit = os.geteuid() if expect_uids is None and not expect_gids else None
    uids = [implicit] if implicit is not None else list(expect_uids or ())
    gids = list(expect_gids)
    deadline = None if timeout is None else time.monotonic() + timeout
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)  # close-on-exec (PEP 446)
    try:
        sock.settimeout(timeout)
        address = _address(name)
        while True:
            try:
                sock.connect(address)
                break
            except BlockingIOError as e:
                # The listener's backlog is full: it is alive but slow; try again until the
                # deadline (a Unix socket has no connection in progress to wait on).
                if e.errno != errno.EAGAIN:
                    raise
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"connecting to endpoint {name}: its backlog stayed "
                                       f"full") from None
                time.sleep(0.0005)
        if deadline is not None:
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
        server = peer_credentials(sock)
        if not _admits(uids, gids, server, implicit):
            raise PeerRefused(f"endpoint {name}: its listener is pid {server.pid} (uid {server.uid}, "
                              f"gid {server.gid}), not whom this client expects (uids {uids}, "
                              f"gids {gids}){_overflow_note(server)}: another process may have "
                              f"taken the name; nothing was sent to it")
        conn = Connection(sock, server, name, timeout)
        try:
            first = conn._recv()
        except PeerClosed:
            raise PeerRefused(f"endpoint {name}: the listener closed the connection without "
                              f"admitting it") from None
        if isinstance(first, Refused):
            raise PeerRefused(f"endpoint {name}: its listener refused this process: {first.reason}")
        if not isinstance(first, Hello):
            _discard(first)
            raise ProtocolError(f"endpoint {name}: the listener's first message is not HELLO")
        conn.sock.settimeout(timeout)
        return conn
    except BaseException:
        sock.close()
        raise


def _check_directory(directory):
    why = None
    try:
        st = os.lstat(directory)
    except FileNotFoundError:
        try:
            os.mkdir(directory, 0o700)
        except FileExistsError:
            pass
        st = os.lstat(directory)
    if stat.S_ISLNK(st.st_mode):
        why = "is a symbolic link"
    elif not stat.S_ISDIR(st.st_mode):
        why = "is not a directory"
    elif _maybe_overflow_uid(os.geteuid()):
        why = (f"this process's uid {os.geteuid()} is the overflow uid (or "
               f"/proc/sys/kernel/overflowuid cannot be read): the owner of a directory cannot "
               f"tell it from other users that have no mapping in its user namespace")
    elif st.st_uid != os.geteuid():
        why = f"is owned by uid {st.st_uid}, not by this process's uid {os.geteuid()}"
    elif st.st_mode & 0o077:
        why = f"has mode {stat.S_IMODE(st.st_mode):04o}: group or others may enter or list it"
    if why:
        raise PermissionError(f"endpoint directory {directory}: {why}; a path endpoint lives in a "
                              f"directory only its owner can enter (0700), or use an abstract name")


class Listener(_RefusalLog):
    """Listen on ``name`` (a path, or ``@name``) and admit peers by their kernel credentials
    (default: this process's uid). A path socket is created 0600 in an owner-only directory;
    a dead listener's socket file is replaced, a live one's never (OSError EADDRINUSE).

    Admitted connections are counted while open (until their owner closes them, or they are
    garbage), and ``accept`` keeps one uid from taking every slot:
    - at most ``max_per_uid`` open connections per uid (default 16): the next is refused
      (REFUSED says why), the uid's open ones go on;
    - at most ``max_connections`` open in all (default 64): when full, a newcomer whose uid
      holds fewer than the uid holding most, by two or more, takes the slot of that uid's
      longest-idle connection (shut down), else it is refused as busy (max-min fair);
    - a connection across which no message has gone either way for ``idle_timeout`` seconds
      (default 60; None: never) is shut down by the next ``accept``: its owner's receive wakes
      with PeerClosed saying so.
    None for a cap lifts it."""

    def __init__(self, name, allow_uids=None, allow_gids=(), timeout=DEFAULT_TIMEOUT, log=True,
                 backlog=128, max_connections=MAX_CONNECTIONS, max_per_uid=MAX_PER_UID,
                 idle_timeout=IDLE_TIMEOUT):
        self.name, self.timeout = name, timeout
        self._init_log(f"endpoint {name}", log)
        self._implicit = os.geteuid() if allow_uids is None and not allow_gids else None
        self.uids = [self._implicit] if self._implicit is not None else list(allow_uids or ())
        self.gids = list(allow_gids)
        self.max_connections, self.max_per_uid = max_connections, max_per_uid
        self.idle_timeout = idle_timeout
        self._open = weakref.WeakSet()  # admitted connections (closed ones are skipped)
        self._file = None
        address = _address(name)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            if isinstance(address, str):
                self._prepare_path(address)
            self.sock.bind(address)
            if isinstance(address, str):
                os.chmod(address, 0o600)
                st = os.lstat(address)
                self._file = (address, st.st_dev, st.st_ino)
            self.sock.listen(backlog)
        except BaseException:
            self.sock.close()
            raise

    @staticmethod
    def _prepare_path(path):
        _check_directory(os.path.dirname(path) or ".")
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise FileExistsError(f"endpoint path {path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        probe.setblocking(False)
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            os.unlink(path)  # a dead listener's file
            return
        except (BlockingIOError, OSError):
            pass
        finally:
            probe.close()
        raise OSError(98, f"{path}: a live listener already serves this name")  # EADDRINUSE

    def open_connections(self):
        """The admitted connections still open (not closed by their owner, not shut down)."""
        return [c for c in list(self._open) if not c.closed and not c.ended_by_listener]

    def _reap_idle(self):
        if self.idle_timeout is None:
            return
        now = time.monotonic()
        for c in self.open_connections():
            idle = now - c.active
            if idle >= self.idle_timeout:
                c._end(f"idle for {idle:.1f} s, at most {self.idle_timeout:g} s")

    def _admission(self, creds):
        """None to admit, else why not (after making room fairly where it can)."""
        self._reap_idle()
        live = self.open_connections()
        mine = sum(c.peer.uid == creds.uid for c in live)
        if self.max_per_uid is not None and mine >= self.max_per_uid:
            return (f"uid {creds.uid} has {mine} connection(s) open on this endpoint, at most "
                    f"{self.max_per_uid} per uid")
        if self.max_connections is not None and len(live) >= self.max_connections:
            held = collections.Counter(c.peer.uid for c in live)
            top_uid, top = held.most_common(1)[0]
            if top < mine + 2:
                return (f"busy: {len(live)} connection(s) open on this endpoint, at most "
                        f"{self.max_connections}, and uid {creds.uid} holds its share")
            victim = min((c for c in live if c.peer.uid == top_uid), key=lambda c: c.active)
            victim._end(f"its slot went to uid {creds.uid}: uid {top_uid} held {top} of the "
                        f"{self.max_connections} slots")
        return None

    def accept(self, timeout=None):
        """The next admitted Connection (refused peers are told, logged, remembered in
        ``refused`` and skipped). TimeoutError after ``timeout`` seconds (None: forever). At
        the fd limit it waits and tries again (see ``_accept_retrying``)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            conn, _ = _accept_retrying(self.sock, deadline, f"endpoint {self.name}")
            creds = peer_credentials(conn)
            if not _admits(self.uids, self.gids, creds, self._implicit):
                self._refuse(conn, creds, f"uid {creds.uid} (gid {creds.gid}) is not allowed "
                                          f"to connect{_overflow_note(creds)}")
                continue
            why = self._admission(creds)
            if why is not None:
                self._refuse(conn, creds, why)
                continue
            try:
                conn.sendmsg([FRAME_INLINE, encode(KIND_HELLO)])
            except OSError:
                conn.close()
                continue
            admitted = Connection(conn, creds, self.name, self.timeout)
            self._open.add(admitted)
            return admitted

    def _refuse(self, conn, creds, reason):
        """Stop the refused peer sending, drain what it sent (a Unix socket closed with unread
        messages resets the connection, and its peer would read ECONNRESET instead of the
        reason; and closing it with fds still queued would release them on this thread),
        disposing of every fd it sent (``_close_all``: sockets defused and closed at once),
        tell it why, remember and log it, close."""
        rest, empty = [], False
        try:
            conn.setblocking(False)
            empty = _drain_unix(conn, 0, [_DRAIN_MAX], rest)
            conn.sendmsg([FRAME_INLINE, encode(KIND_REFUSED, payload=reason.encode())])
        except OSError:
            pass
        _Closer.close(rest)
        if empty:
            conn.close()
        else:
            _Closer.close([conn.detach()])  # more queued than the budget: closed off this thread
        self._note_refusal(creds, f"refused pid {creds.pid} (uid {creds.uid}, gid {creds.gid}): "
                                  f"{reason}")

    def close(self):
        self._log_count()
        self.sock.close()
        if self._file:
            path, dev, ino = self._file
            try:
                st = os.lstat(path)
                if (st.st_dev, st.st_ino) == (dev, ino):
                    os.unlink(path)
            except FileNotFoundError:
                pass
            self._file = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
