"""Availability of the standard-library peer's Listener under hostile users (issue 23, item
6), and the drain that disposes of the fds a peer sent. Run with ``python3 -m unittest
test_vmm_ipc_availability`` from this directory (the Rust suite runs them too:
``peer_python::python_unit_tests``); the attacks need root (to become another uid) and skip
otherwise."""

import json
import os
import socket
import time
import unittest

import vmm_ipc_peer as peer
from peer_fixtures import open_fds, peer_pythonpath, unique


# ---------------------------------------------------------------------------------------------
# Availability under hostile users (issue 23, item 6): each attack runs from outside, against a
# listener in its own process: another uid (``setpriv``), the fd limit (``prlimit``), raw
# sockets. They need root (to become another uid) and skip otherwise.

NOBODY = 65534


def _nobody_python():
    """A python3 that uid 65534 can run (the attacker needs only the standard library)."""
    import subprocess
    import sys
    for exe in (sys.executable, "/usr/bin/python3", "/bin/python3"):
        try:
            ok = subprocess.run(["setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY),
                                 "--clear-groups", exe, "-c", "pass"], timeout=30,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if ok.returncode == 0:
            return exe
    return None


def _spawn(argv, script, *args):
    """``argv + [python, -c, script, args...]`` with this directory on PYTHONPATH, stdin and
    stdout piped (text), stderr merged."""
    import subprocess
    import sys
    env = dict(os.environ, PYTHONPATH=peer_pythonpath(),
               PYTHONDONTWRITEBYTECODE="1")
    python = argv.pop() if argv and argv[-1].endswith(("python3", "python3.11")) else None
    return subprocess.Popen(argv + [python or sys.executable, "-c", script, *args], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


_PENDING = {}  # pid: bytes read from its stdout past the last line returned


def _line(proc, want, within=60):
    """Read ``proc``'s lines until one starts with ``want`` (within ``within`` seconds); that
    line. AssertionError with everything it wrote otherwise. (Reads the pipe's fd directly:
    a buffered reader would hide lines that arrived together from the next select.)"""
    import select
    fd = proc.stdout.fileno()
    pending, seen = _PENDING.pop(proc.pid, b""), []
    end = time.monotonic() + within
    try:
        while True:
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                text = line.decode(errors="replace") + "\n"
                seen.append(text)
                if text.startswith(want):
                    return text
            left = end - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                break
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            pending += chunk
    finally:
        _PENDING[proc.pid] = pending
    raise AssertionError(f"no {want!r} line from pid {proc.pid}: {''.join(seen)}")


def _kill(proc):
    proc.kill()
    try:
        proc.communicate(timeout=30)
    except Exception:
        pass


# A listener under test: serves every admitted connection DATA "served" (after reading one
# request when argv[2] is "request"), from a pool of 64 worker threads (the Listener's
# MAX_CONNECTIONS); starts accepting when a line arrives on stdin. argv[3]: extra Listener arguments
# (JSON).
SERVER = r"""
import json, queue, sys, threading, vmm_ipc_peer as peer
kw = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
listener = peer.Listener(sys.argv[1], log=False, **kw)
work = queue.Queue()
def worker():
    while True:
        conn = work.get()
        try:
            with conn:
                if sys.argv[2] == "request":
                    conn.recv_data()
                conn.send_data(b"served")
        except Exception:
            pass
for _ in range(64):
    threading.Thread(target=worker, daemon=True).start()
print("READY", flush=True)
sys.stdin.readline()
while True:
    try:
        work.put(listener.accept())
    except Exception as e:
        print("ACCEPT FAILED", type(e).__name__, e, flush=True)
        raise
"""

# The attacker of item 6a (runs as another uid, refused): argv[2] connections, each carrying a
# TCP socket with SO_LINGER 30 s and unsent data its peer (kept here, never reading) will not
# take, so that the last close of it blocks; every third inside a Unix socket (queued in it),
# every third after an empty packet. All are in flight before the listener accepts any.
LINGER_ATTACK = r"""
import socket, struct, sys, time
name, count = "\0" + sys.argv[1][1:], int(sys.argv[2])
server = socket.create_server(("127.0.0.1", 0), backlog=count + 8)
kept, sent = [], 0
for i in range(count):
    hostile = socket.create_connection(server.getsockname())
    never_reads, _ = server.accept()
    never_reads.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    hostile.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    hostile.setblocking(False)
    try:
        while True:
            hostile.send(bytes(4096))
    except BlockingIOError:
        pass
    hostile.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 30))
    kept.append(never_reads)
    fd = hostile.detach()
    if i % 3 == 1:  # nested: the TCP socket queued inside a Unix socket that is sent
        outer, inner = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        socket.send_fds(outer, [b"x"], [fd])
        socket.os.close(fd)
        outer.close()
        fd = inner.detach()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.connect(name)
    if i % 3 == 2:
        conn.send(b"")  # an empty packet first
    socket.send_fds(conn, [b"\0hostile"], [fd])
    socket.os.close(fd)  # the reference in flight is now the last
    kept.append(conn)
    sent += 1
print("SENT", sent, flush=True)
time.sleep(600)
"""

# Another uid's idle client (item 6i): argv[2] connections that say nothing; prints how many
# were admitted (HELLO) and refused, then keeps them open (or, with argv[3] "watch", reports
# each one the listener shuts down).
IDLE_ATTACK = r"""
import socket, struct, sys, time
name, count = "\0" + sys.argv[1][1:], int(sys.argv[2])
held, refused = [], 0
for i in range(count):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(5)
    try:
        s.connect(name)
        reply = s.recv(70000)
    except OSError:
        refused += 1
        s.close()
        continue
    kind = struct.unpack_from("<H", reply, 7)[0] if len(reply) >= 9 else 0
    if kind == 1:
        held.append(s)
    else:
        refused += 1
        s.close()
print("HELD", len(held), "REFUSED", refused, flush=True)
if sys.argv[3:] == ["watch"]:
    for s in held:
        s.settimeout(30)
        try:
            print("ENDED" if s.recv(100) == b"" else "DATA", flush=True)
        except OSError as e:
            print("ERROR", e, flush=True)
time.sleep(600)
"""


class Availability(unittest.TestCase):
    """Item 6: refused and admitted users who misbehave cannot stop the listener serving."""

    def setUp(self):
        import shutil
        if os.geteuid() != 0:
            self.skipTest("becoming another uid needs root")
        if not (shutil.which("setpriv") and shutil.which("prlimit")):
            self.skipTest("needs setpriv and prlimit (util-linux)")
        self.nobody = _nobody_python()
        if self.nobody is None:
            self.skipTest(f"no python3 that uid {NOBODY} can run")

    def start(self, argv, script, *args):
        proc = _spawn(list(argv), script, *args)
        self.addCleanup(_kill, proc)
        return proc

    def as_nobody(self, script, *args):
        return self.start(["setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY),
                           "--clear-groups", self.nobody], script, *args)

    def served_within(self, name, seconds, request=False):
        """A legitimate client (this uid) is served by the listener within ``seconds``."""
        started = time.monotonic()
        with peer.connect(name, timeout=seconds) as conn:
            conn.sock.settimeout(max(seconds - (time.monotonic() - started), 0.01))
            if request:
                conn.send_data(b"request")
            self.assertEqual(conn.recv_data(), b"served")
        return time.monotonic() - started

    def test_refused_lingering_sockets_do_not_jam_the_listener(self):
        # 6a: before the fix, the refused sockets' blocking closes jammed the closer threads,
        # their fds queued open, and the listener (at 64 fds) stopped serving.
        name = unique("linger-flood")
        server = self.start(["prlimit", "--nofile=64:64"], SERVER, name, "none")
        _line(server, "READY")
        attacker = self.as_nobody(LINGER_ATTACK, name, "90")
        _line(attacker, "SENT 90")
        server.stdin.write("go\n")
        server.stdin.flush()
        took = self.served_within(name, 10)
        self.assertLess(took, 10)
        # And again, after every refused socket was disposed of.
        self.served_within(name, 10)
        self.assertIsNone(server.poll(), "the listener died")

    def test_a_listener_at_its_fd_limit_admits_its_own_uid_and_waits_out_emfile(self):
        # 6g: the overflow uid is read once (the listener has no fd to reopen it with), and
        # accept at EMFILE waits until an fd is free instead of failing.
        script = r"""
import os, sys, threading, vmm_ipc_peer as peer
listener = peer.Listener(sys.argv[1], log=False)
ballast = []
try:
    while True:
        ballast.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    pass
free = int(sys.argv[2])  # fds left free now; the rest is freed after a second
for fd in ballast[:free]:
    os.close(fd)
threading.Timer(1.0, os.close, [ballast[-1]]).start()
print("READY", flush=True)
try:
    with listener.accept(timeout=20) as conn:
        conn.send_data(b"served")
        print("SERVED", flush=True)
except Exception as e:
    print("FAILED", type(e).__name__, e, flush=True)
"""
        for free in (1, 0):
            with self.subTest(free_fds=free):
                name = unique(f"fd-limit-{free}")
                server = self.start(["prlimit", "--nofile=48:48"], script, name, str(free))
                _line(server, "READY")
                self.served_within(name, 10)
                _line(server, "SERVED")

    def test_one_uids_idle_connections_do_not_starve_another(self):
        # 6i: 300 idle connections of one allowed uid; a good client beside them is served at
        # once (before the fix it waited behind them for the workers' receive timeouts).
        name = unique("idle-flood")
        server = self.start([], SERVER, name, "request",
                            json.dumps({"allow_uids": [os.geteuid(), NOBODY]}))
        _line(server, "READY")
        server.stdin.write("go\n")
        server.stdin.flush()
        attacker = self.as_nobody(IDLE_ATTACK, name, "300")
        held = _line(attacker, "HELD").split()
        took = self.served_within(name, 3, request=True)
        self.assertLess(took, 3)
        self.assertLessEqual(int(held[1]), peer.MAX_PER_UID, held)

    def test_idle_connections_are_shut_down_and_admission_is_fair(self):
        # 6i: the per-uid cap, the idle timeout, and the fair share of a full listener.
        name = unique("idle-fair")
        kw = json.dumps({"allow_uids": [os.geteuid(), NOBODY], "max_per_uid": 3,
                         "max_connections": 4, "idle_timeout": 1.0})
        server = self.start([], SERVER, name, "request", kw)
        _line(server, "READY")
        server.stdin.write("go\n")
        server.stdin.flush()
        attacker = self.as_nobody(IDLE_ATTACK, name, "5", "watch")
        self.assertEqual(_line(attacker, "HELD").split(), ["HELD", "3", "REFUSED", "2"])
        # This uid takes the last slot, then one more: the listener is full, and the uid
        # holding most (3) gives up its longest-idle connection to this one (holding 1).
        mine = [peer.connect(name, timeout=5) for _ in range(2)]
        for conn in mine:
            self.addCleanup(conn.close)
        self.assertEqual(_line(attacker, "ENDED").strip(), "ENDED")
        # The idle timeout ends the rest of the attacker's on the next accept after it.
        time.sleep(1.2)
        for conn in mine:  # they are idle too: served or not, they are not needed
            conn.close()
        self.served_within(name, 5, request=True)
        self.assertEqual(_line(attacker, "ENDED").strip(), "ENDED")
        self.assertEqual(_line(attacker, "ENDED").strip(), "ENDED")


class Defuse(unittest.TestCase):
    """The disposal of fds a peer sent (``_close_all``): the drain of a Unix socket."""

    def test_a_drain_tells_an_empty_packet_from_the_end(self):
        import select
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        r, w = os.pipe()
        a.send(b"")  # an empty packet, then one with an fd
        socket.send_fds(a, [b""], [w])
        os.close(w)
        rest = []
        self.assertTrue(peer._drain_unix(b, 0, [100], rest))
        self.assertEqual(len(rest), 1, "the pipe (not a socket) is left for the closer")
        peer._Closer.close(rest)
        self.assertEqual(len(select.select([r], [], [], 30)[0]), 1)
        self.assertEqual(os.read(r, 1), b"")
        os.close(r)
        a.close()
        b.close()

    def test_a_drain_takes_no_message_whose_fds_do_not_fit(self):
        import resource
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pairs = [socket.socketpair() for _ in range(20)]
        socket.send_fds(a, [b"x"], [p[0].fileno() for p in pairs])
        for p in pairs:
            p[0].close()  # the queued references are the last
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        rest = []
        resource.setrlimit(resource.RLIMIT_NOFILE, (open_fds() + 12, hard))
        try:
            taken = peer._drain_unix(b, 0, [100], rest)
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        self.assertFalse(taken)
        self.assertEqual(rest, [])
        for _, end in pairs:  # nothing was released: every peer is still open
            end.setblocking(False)
            with self.assertRaises(BlockingIOError):
                end.recv(1)
        # With room, the message is taken and its sockets closed at once.
        self.assertTrue(peer._drain_unix(b, 0, [100], rest))
        self.assertEqual(rest, [])
        for _, end in pairs:
            end.settimeout(5)
            self.assertEqual(end.recv(1), b"")
            end.close()
        a.close()
        b.close()


if __name__ == "__main__":
    unittest.main()
