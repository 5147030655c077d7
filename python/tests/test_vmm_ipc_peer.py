"""Unit tests of the standard-library peer: the codec's rules, the handshake and credential
checks, path sockets, timeouts, host imports, and that no fd outlives a refusal. Run with
``python3 -m unittest test_vmm_ipc_peer`` from this directory (the Rust suite runs them too:
``peer_python::python_unit_tests``). Attacks from outside are in ``test_vmm_ipc_attacks``,
the availability attacks and the fd drain in ``test_vmm_ipc_availability``."""

import fcntl
import mmap
import os
import socket
import stat
import struct
import tempfile
import threading
import unittest

import vmm_ipc_peer as peer
from peer_fixtures import open_fds, raw_client, unique


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


if __name__ == "__main__":
    unittest.main()
