"""Attacks on the standard-library peer's endpoints, from outside: raw sockets, another
process in a user namespace that maps nobody, a full backlog, and an fd whose close blocks.
Run with ``python3 -m unittest test_vmm_ipc_attacks`` from this directory (the Rust suite runs
them too: ``peer_python::python_unit_tests``)."""

import os
import socket
import struct
import threading
import time
import unittest

import vmm_ipc_peer as peer
from peer_fixtures import peer_pythonpath, raw_client, unique


def _in_userns(script, *args):
    """``script`` run by python3 in a user namespace that maps nobody (``unshare -U``): it runs
    as the overflow uid, and every uid outside reads there as the overflow uid."""
    import subprocess
    import sys
    env = dict(os.environ, PYTHONPATH=peer_pythonpath(),
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


if __name__ == "__main__":
    unittest.main()
