"""Unit tests of the standard-library peer: the codec's rules, the handshake and credential
checks, path sockets, timeouts, and that no fd outlives a refusal. Run with
``python3 -m unittest test_vmm_ipc_peer`` from this directory (the Rust suite runs them too:
``peer_python::python_unit_tests``)."""

import fcntl
import json
import mmap
import os
import socket
import stat
import struct
import tempfile
import threading
import time
import unittest

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


class Codec(unittest.TestCase):
    def test_header_layout(self):
        data = peer.encode(peer.KIND_CUDA_VMM, handle_type=1, size=0x1FFFFF, chunk_sizes=[0x200000],
                           device_uuid=b"\x11" * 16, device_ordinal=2, location=(1, 3))
        self.assertEqual(len(data), 72)
        self.assertEqual(data[:4], b"VMMI")
        self.assertEqual(struct.unpack_from("<HHHHIII", data, 4), (1, 4, 64, 1, 1, 1, 0))
        self.assertEqual(struct.unpack_from("<Q", data, 24)[0], 0x1FFFFF)
        self.assertEqual(data[32:48], b"\x11" * 16)
        self.assertEqual(struct.unpack_from("<IIiIQ", data, 48), (2, 1, 3, 0, 0x200000))

    def test_round_trips(self):
        fd = peer.sealed_memfd(4096)
        d = peer.decode(*peer.HostDescriptor(fd, 4096).encode())
        self.assertIsInstance(d, peer.HostDescriptor)
        self.assertEqual((d.fd, d.size), (fd, 4096))
        d.close()
        self.assertEqual(peer.decode(peer.encode(peer.KIND_DATA, payload=b"hi"), []), b"hi")
        fds = [os.dup(0), os.dup(0)]
        v = peer.VmmDescriptor(fds, [2 << 20, 2 << 20], 3 << 20, device_uuid=b"\x01" * 16)
        back = peer.decode(*v.encode())
        self.assertEqual((back.chunk_sizes, back.size, back.device_uuid, back.location),
                         ([2 << 20, 2 << 20], 3 << 20, b"\x01" * 16, ("device", 0)))
        back.close()

    def refused(self, data, nfds, words):
        fds = [os.dup(0) for _ in range(nfds)]
        with self.assertRaises(peer.ProtocolError) as caught:
            peer.decode(data, fds)
        for word in words:
            self.assertIn(word, str(caught.exception))
        for fd in fds:  # every fd closed by the refusal
            with self.assertRaises(OSError):
                os.fstat(fd)

    def test_refusals_follow_the_documented_rules(self):
        good = peer.encode(peer.KIND_CUDA_VMM, handle_type=1, size=4096, chunk_sizes=[4096])
        self.refused(b"", 0, ["VMMI"])
        self.refused(b"GET / HTTP/1.1", 1, ["not a vmm-ipc"])
        self.refused(good[:40], 1, ["shorter than the 64-byte header"])
        self.refused(good[:4] + b"\x02\x00" + good[6:], 1, ["protocol version 2"])
        self.refused(good[:6] + b"\x09\x00" + good[8:], 1, ["unknown message kind 9"])
        self.refused(good, 0, ["1 chunk(s) arrived with 0 fd(s)"])
        self.refused(good, 2, ["arrived with 2 fd(s)"])
        self.refused(good[:-8], 1, ["announces"])
        huge = bytearray(good)
        struct.pack_into("<I", huge, 16, 2**32 - 1)
        self.refused(bytes(huge), 1, ["at most 253"])
        self.refused(peer.encode(peer.KIND_CUDA_VMM, handle_type=8, size=1, chunk_sizes=[4096]),
                     1, ["handle type 8"])
        self.refused(peer.encode(peer.KIND_CUDA_VMM, handle_type=1, size=1, chunk_sizes=[0]), 1,
                     ["size 0"])
        self.refused(peer.encode(peer.KIND_CUDA_VMM, handle_type=1, size=8193,
                                 chunk_sizes=[4096, 4096]), 2, ["exceeds"])
        self.refused(peer.encode(peer.KIND_HOST_MEMFD, size=10, chunk_sizes=[20]), 1, ["HOST_MEMFD"])


class Endpoints(unittest.TestCase):
    def serve_one(self, listener, action):
        errors = []

        def run():
            try:
                with listener.accept(timeout=10) as conn:
                    action(conn)
            except BaseException as e:  # reported by the test
                errors.append(e)

        thread = threading.Thread(target=run)
        thread.start()
        return thread, errors

    def test_a_memfd_travels_both_ways_and_nothing_leaks(self):
        before = open_fds()
        name = unique("memfd")
        size = 10000
        fd = peer.sealed_memfd(size)
        view = mmap.mmap(fd, size)
        view[:] = peer.pattern(3, size)

        def owner(conn):
            with peer.HostDescriptor(fd, size) as d:
                conn.send_descriptor(d)
            self.assertEqual(conn.recv_data(), b"done")

        with peer.Listener(name) as listener:
            thread, errors = self.serve_one(listener, owner)
            with peer.connect(name) as conn:
                self.assertEqual(conn.peer.pid, os.getpid())
                with conn.recv_descriptor() as d:
                    alias = d.map()
                self.assertEqual(alias[:], peer.pattern(3, size))
                alias[:] = peer.pattern(4, size)
                alias.close()
                conn.send_data(b"done")
            thread.join()
        self.assertEqual(errors, [])
        self.assertEqual(view[:], peer.pattern(4, size))
        view.close()
        self.assertEqual(open_fds(), before)

    def test_a_client_refuses_a_listener_it_does_not_expect(self):
        name = unique("squat")
        with peer.Listener(name, log=False) as listener:
            with self.assertRaises(peer.PeerRefused) as caught:
                peer.connect(name, expect_uids=[os.geteuid() + 1])
            self.assertIn("not whom this client expects", str(caught.exception))
            self.assertIn("nothing was sent", str(caught.exception))
            del listener

    def test_a_listener_refuses_a_client_it_does_not_allow(self):
        name = unique("refuse")
        with peer.Listener(name, allow_uids=[os.geteuid() + 1], log=False) as listener:
            result = []
            thread = threading.Thread(target=lambda: result.append(self.accept_timeout(listener)))
            thread.start()
            with self.assertRaises(peer.PeerRefused) as caught:
                peer.connect(name)
            thread.join()
            self.assertIn(f"uid {os.geteuid()}", str(caught.exception))
            self.assertEqual(result, ["timeout"])
            self.assertEqual([c.uid for c in listener.refused], [os.geteuid()])

    @staticmethod
    def accept_timeout(listener):
        try:
            listener.accept(timeout=1)
            return "accepted"
        except TimeoutError:
            return "timeout"

    def test_a_silent_peer_times_out_and_garbage_is_refused(self):
        name = unique("silent")
        with peer.Listener(name, timeout=0.2) as listener:
            result = []

            def run():
                conn = listener.accept(timeout=5)
                for _ in range(2):
                    try:
                        conn.recv()
                        result.append("message")
                    except peer.ProtocolError as e:
                        result.append(f"refused: {e}")
                    except (TimeoutError, socket.timeout):
                        result.append("timeout")
                conn.close()

            thread = threading.Thread(target=run)
            thread.start()
            sock = raw_client(name)
            sock.recv(100)  # HELLO
            sock.sendmsg([b"\0VMMI\x07\x00"])
            thread.join()
            sock.close()
            self.assertTrue(result[0].startswith("refused: protocol version 7"), result)
            self.assertEqual(result[1], "timeout")

    def test_path_endpoints(self):
        with tempfile.TemporaryDirectory() as tmp:
            os.chmod(tmp, 0o755)
            with self.assertRaises(PermissionError) as caught:
                peer.Listener(os.path.join(tmp, "sock"))
            self.assertIn("mode 0755", str(caught.exception))
            os.chmod(tmp, 0o700)
            path = os.path.join(tmp, "sock")
            # A dead listener's file is replaced.
            stale = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            stale.bind(path)
            stale.close()
            with peer.Listener(path) as listener:
                self.assertEqual(stat.S_IMODE(os.lstat(path).st_mode), 0o600)
                # A live one's is not.
                with self.assertRaises(OSError) as caught:
                    peer.Listener(path)
                self.assertEqual(caught.exception.errno, 98)
                del listener
            self.assertFalse(os.path.exists(path))
            created = os.path.join(tmp, "made", "sock")
            with peer.Listener(created):
                self.assertEqual(stat.S_IMODE(os.lstat(os.path.dirname(created)).st_mode), 0o700)


if __name__ == "__main__":
    unittest.main()


def _in_userns(script, *args):
    """``script`` run by python3 in a user namespace that maps nobody (``unshare -U``): it runs
    as the overflow uid, and every uid outside reads there as the overflow uid."""
    import subprocess
    import sys
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.abspath(peer.__file__)),
               PYTHONDONTWRITEBYTECODE="1")
    return subprocess.Popen(["unshare", "-U", sys.executable, "-c", script, *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _userns_works():
    import subprocess
    try:
        return subprocess.run(["unshare", "-U", "true"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL).returncode == 0
    except OSError:
        return False


def _refused_kind(sock):
    msg = sock.recv(70000)
    return struct.unpack_from("<H", msg, 7)[0], msg


class HostImports(unittest.TestCase):
    def sealed_memfd(self, size, flags=0):
        fd = os.memfd_create("t", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | flags)
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        return fd

    def test_a_sparse_memfd_over_the_cap_is_refused_before_it_is_mapped(self):
        fd = self.sealed_memfd(60 << 40)  # 60 TiB, sparse: costs the sender nothing
        d = peer.HostDescriptor(fd, 60 << 40)
        try:
            with self.assertRaisesRegex(peer.ProtocolError, "more than this importer maps"):
                d.map()
            small = peer.HostDescriptor(os.dup(fd), 4096)
            try:
                small.map(max_size=4096).close()  # within the cap: maps
            finally:
                small.close()
        finally:
            d.close()

    def test_a_hugetlbfs_memfd_is_refused(self):
        try:
            fd = self.sealed_memfd(2 << 20, os.MFD_HUGETLB)
        except OSError as e:
            self.skipTest(f"no hugetlbfs memfd here ({e})")
        d = peer.HostDescriptor(fd, 2 << 20)
        try:
            with self.assertRaisesRegex(peer.ProtocolError, "not on tmpfs"):
                d.map()
        finally:
            d.close()


class Attacks(unittest.TestCase):
    """Attacks on the peer's endpoints, from outside: raw sockets, another process in a user
    namespace that maps nobody, and an fd whose close blocks."""

    def test_an_unmapped_listener_admits_the_overflow_uid_only_when_named(self):
        if not _userns_works():
            self.skipTest("unshare -U cannot make a user namespace here")
        overflow = peer.overflow_ids()[0]
        script = """
import sys, vmm_ipc_peer as peer
allow = [peer.overflow_ids()[0]] if sys.argv[2] == "named" else None
with peer.Listener(sys.argv[1], allow_uids=allow, log=False) as listener:
    print("READY", flush=True)
    try:
        with listener.accept(timeout=3) as conn:
            print("ADMITTED", conn.peer.uid, flush=True)
            conn.send_data(b"welcome")
    except TimeoutError:
        print("NO CONNECTION", flush=True)
"""
        for allow, admitted in (("default", False), ("named", True)):
            name = unique(f"ns-listener-{allow}")
            child = _in_userns(script, name, allow)
            self.assertEqual(child.stdout.readline().strip(), "READY")
            if admitted:
                with peer.connect(name) as conn:
                    self.assertEqual(conn.recv_data(), b"welcome")
            else:
                with self.assertRaises(peer.PeerRefused) as caught:
                    peer.connect(name)
                self.assertIn(f"uid {overflow}", str(caught.exception))
                self.assertIn("overflow uid", str(caught.exception))
            out = child.communicate(timeout=30)[0]
            self.assertIn(f"ADMITTED {overflow}" if admitted else "NO CONNECTION", out)

    def test_an_unmapped_client_takes_an_unmapped_listener_for_a_squatter_unless_named(self):
        if not _userns_works():
            self.skipTest("unshare -U cannot make a user namespace here")
        script = """
import sys, vmm_ipc_peer as peer
expect = [peer.overflow_ids()[0]] if sys.argv[2] == "named" else None
try:
    with peer.connect(sys.argv[1], expect_uids=expect) as conn:
        print("ADMITTED", flush=True)
except peer.PeerRefused as e:
    print("REFUSED", e, flush=True)
"""
        for expect, admitted in (("default", False), ("named", True)):
            name = unique(f"ns-client-{expect}")
            with peer.Listener(name, log=False) as listener:
                child = _in_userns(script, name, expect)
                try:
                    with listener.accept(timeout=20 if admitted else 2):
                        pass
                except TimeoutError:
                    pass
                out = child.communicate(timeout=30)[0]
            if admitted:
                self.assertIn("ADMITTED", out)
            else:
                self.assertIn("REFUSED", out)
                self.assertIn("overflow uid", out)
                self.assertIn("nothing was sent to it", out)

    def test_refused_peers_are_remembered_boundedly_and_logged_at_a_bounded_rate(self):
        import contextlib
        import io
        name = unique("flood")
        log = io.StringIO()
        with contextlib.redirect_stderr(log):
            with peer.Listener(name, allow_uids=[os.geteuid() + 1]) as listener:
                clients = [raw_client(name) for _ in range(100)]
                with self.assertRaises(TimeoutError):
                    listener.accept(timeout=1)
                self.assertEqual(len(listener.refused), peer.REFUSALS_KEPT)
                for c in clients:
                    c.close()
        lines = log.getvalue().splitlines()
        self.assertEqual(sum("refused pid" in line for line in lines), peer.LOG_BURST, lines)
        self.assertIn(f"{100 - peer.LOG_BURST} more refused connection(s) not logged",
                      log.getvalue())

    def test_a_refused_client_that_spoke_first_reads_the_reason(self):
        name = unique("spoke-first")
        with peer.Listener(name, allow_uids=[os.geteuid() + 1], log=False) as listener:
            client = raw_client(name)
            r, w = os.pipe()
            socket.send_fds(client, [b"\0" + peer.encode(peer.KIND_DATA, payload=b"hi")], [w])
            os.close(w)
            with self.assertRaises(TimeoutError):
                listener.accept(timeout=0.5)
            kind, msg = _refused_kind(client)  # not ConnectionResetError
            self.assertEqual(kind, peer.KIND_REFUSED)
            self.assertIn(b"is not allowed to connect", msg)
            client.close()
            self.assertEqual(os.read(r, 1), b"")  # the fd it sent was closed
            os.close(r)

    def test_connect_waits_out_a_full_backlog(self):
        name = unique("backlog")
        with peer.Listener(name, backlog=1) as listener:
            waiting = []
            while True:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                s.setblocking(False)
                try:
                    s.connect(peer._address(name))
                except BlockingIOError:
                    s.close()
                    break
                waiting.append(s)
            results = []

            def client():
                try:
                    with peer.connect(name, timeout=20) as conn:
                        results.append(conn.recv_data())
                except BaseException as e:
                    results.append(e)

            thread = threading.Thread(target=client)
            thread.start()
            for _ in range(len(waiting) + 1):
                conn = listener.accept(timeout=20)
                if conn.peer.pid == os.getpid() and thread.is_alive():
                    try:
                        conn.send_data(b"served")
                    except OSError:
                        pass
                conn.close()
            thread.join(timeout=30)
            for s in waiting:
                s.close()
        self.assertEqual(results, [b"served"])

    def test_a_hostile_fd_whose_close_blocks_does_not_hold_up_a_receive(self):
        # A TCP socket with SO_LINGER and unsent data: its last close blocks for ten minutes
        # (the stand-in for a FUSE file whose server never answers).
        server = socket.create_server(("127.0.0.1", 0))
        hostile = socket.create_connection(server.getsockname())
        never_reads, _ = server.accept()
        hostile.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        never_reads.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        hostile.setblocking(False)
        try:
            while True:
                hostile.send(bytes(4096))
        except BlockingIOError:
            pass
        hostile.setblocking(True)
        hostile.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 600))
        name = unique("linger")
        with peer.Listener(name) as listener:
            client = raw_client(name)
            conn = listener.accept(timeout=5)
            conn.sock.settimeout(2)
            socket.send_fds(client, [b"\0" + peer.encode(peer.KIND_DATA, payload=b"x")],
                            [hostile.fileno()])
            hostile.close()  # not the last reference: the one in flight is
            outcome = []

            def receive():
                try:
                    conn.recv()
                except peer.ProtocolError as e:
                    outcome.append(e)

            thread = threading.Thread(target=receive, daemon=True)
            thread.start()
            thread.join(timeout=120)  # far within the close's ten minutes
            self.assertFalse(thread.is_alive(), "the receive waited for the hostile fd's close")
            self.assertIn("arrived with 1 fd", str(outcome[0]))
            # Later refused fds still close: another closer takes them once this one is stuck.
            time.sleep(0.3)
            r, w = os.pipe()
            socket.send_fds(client, [b"\0" + peer.encode(peer.KIND_DATA, payload=b"y")], [w])
            os.close(w)
            with self.assertRaises(peer.ProtocolError):
                conn.recv()
            import select
            self.assertEqual(len(select.select([r], [], [], 30)[0]), 1,
                             "the second refused fd was not closed")
            self.assertEqual(os.read(r, 1), b"")
            os.close(r)
            conn.close()
            client.close()
        never_reads.close()
        server.close()


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
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.abspath(peer.__file__)),
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
# request when argv[2] is "request"), from a pool of 64 worker threads (the daemon's slot
# count); starts accepting when a line arrives on stdin. argv[3]: extra Listener arguments
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
