"""Unit tests of the peer's version 2: CUDA_FABRIC descriptors (codec, every receipt check,
redaction), per-message versions (version 1 kinds stay byte-identical version 1), fabric
descriptors on endpoints, and byte-stream framing over a socketpair, TCP loopback and a pipe
(bounded reads, only DATA and CUDA_FABRIC, a refusal ends the stream). Standard library only;
the Rust suite runs them too (``peer_python::python_unit_tests``)."""

import os
import socket
import struct
import threading
import time
import unittest

import vmm_ipc_peer as peer

G = 2 << 20
UUID = bytes(range(0x10, 0x20))
# Distinctive handle bytes: the redaction tests look for them in every repr and error.
HANDLES = [bytes([0xA5, i]) * 32 for i in range(3)]


def open_fds():
    return len(os.listdir("/proc/self/fd")) - 1


def fabric(n=2, size=None, **kw):
    return peer.FabricDescriptor(HANDLES[:n], [G] * n, size, owner_uuid=UUID, **kw)


def fabric_bytes(n=2, chunk_sizes=None, payload=None, **kw):
    """A CUDA_FABRIC message's bytes, with any field forged."""
    fields = dict(handle_type=8, size=n * G, chunk_sizes=[G] * n if chunk_sizes is None
                  else chunk_sizes, device_uuid=UUID, device_ordinal=1,
                  payload=b"".join(HANDLES[:n]) if payload is None else payload)
    fields.update(kw)
    return peer.encode(peer.KIND_CUDA_FABRIC, **fields)


def patch(data, offset, fmt, value):
    data = bytearray(data)
    struct.pack_into(fmt, data, offset, value)
    return bytes(data)


def leaks(text):
    """Whether ``text`` shows any byte of a test handle."""
    return any(h.hex() in text or h[:8].hex() in text or repr(h)[:20] in text
               or "a5" * 4 in text.lower() or "\\xa5" in text for h in HANDLES)


class Versions(unittest.TestCase):
    def test_version_1_kinds_are_byte_identical_version_1(self):
        for kind, fields in ((peer.KIND_HELLO, {}), (peer.KIND_DATA, {"payload": b"hi"}),
                             (peer.KIND_REFUSED, {"payload": b"no"}),
                             (peer.KIND_CUDA_VMM, {"handle_type": 1, "size": G,
                                                   "chunk_sizes": [G]}),
                             (peer.KIND_HOST_MEMFD, {"size": 10, "chunk_sizes": [10]})):
            data = peer.encode(kind, **fields)
            self.assertEqual(struct.unpack_from("<H", data, 4)[0], 1, peer.KIND_NAMES[kind])
        # The exact bytes a version 1 peer sends for DATA "hi".
        self.assertEqual(peer.encode(peer.KIND_DATA, payload=b"hi"),
                         b"VMMI\x01\x00\x03\x00\x40\x00" + bytes(10) + b"\x02\x00\x00\x00"
                         + bytes(40) + b"hi")

    def test_the_fabric_header_layout(self):
        data, fds = fabric(2, size=G + 5, owner_ordinal=3).encode()
        self.assertEqual(fds, [])
        self.assertEqual(len(data), 64 + 16 + 128)
        self.assertEqual(struct.unpack_from("<4sHHHHIII", data),
                         (b"VMMI", 2, 6, 64, 1, 8, 2, 128))
        self.assertEqual(struct.unpack_from("<Q", data, 24)[0], G + 5)
        self.assertEqual(data[32:48], UUID)
        self.assertEqual(struct.unpack_from("<IIiI", data, 48), (3, 0, 0, 0))
        self.assertEqual(struct.unpack_from("<2Q", data, 64), (G, G))
        self.assertEqual(data[80:], HANDLES[0] + HANDLES[1])

    def test_round_trips(self):
        for desc in (fabric(1), fabric(3, size=1, owner_ordinal=7),
                     fabric(2, location=("host_numa", 1))):
            back = peer.decode(*desc.encode())
            self.assertIsInstance(back, peer.FabricDescriptor)
            self.assertEqual((back.handles, back.chunk_sizes, back.size, back.owner_uuid,
                              back.owner_ordinal, back.location),
                             (desc.handles, desc.chunk_sizes, desc.size, desc.owner_uuid,
                              desc.owner_ordinal, desc.location))
            self.assertEqual(back.device_uuid, UUID)
            with back:  # a context manager like the fd-carrying descriptors; nothing to close
                pass

    def test_the_constructor_checks_the_layout(self):
        for args, word in ((([HANDLES[0]], [G, G]), "1 fabric handle(s) for 2"),
                           (([], []), "1 to 253"),
                           (([HANDLES[0][:63]], [G]), "63 bytes"),
                           (([HANDLES[0]], [0]), "size 0"),
                           (([HANDLES[0]], [G], G + 1), "not within")):
            with self.assertRaises(ValueError) as caught:
                peer.FabricDescriptor(*args, owner_uuid=UUID)
            self.assertIn(word, str(caught.exception))
            self.assertFalse(leaks(str(caught.exception)), caught.exception)
        with self.assertRaisesRegex(ValueError, "16-byte UUID"):
            peer.FabricDescriptor([HANDLES[0]], [G])
        with self.assertRaisesRegex(ValueError, "location"):
            peer.FabricDescriptor([HANDLES[0]], [G], owner_uuid=UUID, location=("host_numa", -1))


class Refusals(unittest.TestCase):
    def refused(self, data, words, nfds=0):
        fds = [os.dup(0) for _ in range(nfds)]
        with self.assertRaises(peer.ProtocolError) as caught:
            peer.decode(data, fds)
        text = str(caught.exception)
        for word in words:
            self.assertIn(word, text)
        self.assertFalse(leaks(text), text)
        for fd in fds:  # every fd closed by the refusal
            with self.assertRaises(OSError):
                os.fstat(fd)
        return text

    def test_every_receipt_check_of_cuda_fabric(self):
        good = fabric_bytes(2)
        self.assertIsInstance(peer.decode(good, []), peer.FabricDescriptor)
        # Rule 1: versions.
        self.refused(patch(good, 4, "<H", 3), ["protocol version 3", "versions 1 and 2"])
        self.refused(b"VMMI\x09\x00", ["protocol version 9", "versions 1 and 2"])  # short
        # Rule 2: the version must be the kind's, both ways.
        self.refused(patch(good, 4, "<H", 1), ["CUDA_FABRIC", "protocol version 1",
                                               "version 2"])
        self.refused(peer.encode(peer.KIND_DATA, payload=b"x", version=2),
                     ["DATA", "protocol version 2"])
        self.refused(peer.encode(peer.KIND_HELLO, version=2), ["HELLO", "protocol version 2"])
        self.refused(peer.encode(peer.KIND_CUDA_VMM, handle_type=1, size=G, chunk_sizes=[G],
                                 version=2), ["CUDA_VMM", "protocol version 2"], nfds=1)
        self.refused(patch(good, 10, "<H", 3), ["unknown flags"])
        self.refused(patch(good, 60, "<I", 1), ["reserved"])
        # Rule 3: counts, length, fds.
        self.refused(patch(good, 16, "<I", 254), ["at most 253"])
        self.refused(patch(good, 20, "<I", 16385), ["at most 16384"])
        self.refused(good[:-1], ["announces"])
        self.refused(good + b"\0", ["announces"])
        self.refused(good, ["carries none"], nfds=2)
        # Rule 4: device fields and location.
        self.refused(fabric_bytes(location=(2, 0)), ["unknown location type 2"])
        self.refused(fabric_bytes(location=(1, -1)), ["negative"])
        self.refused(fabric_bytes(location=(0, 4)), ["non-zero id"])
        # Rule 5: the kind's rules.
        self.refused(fabric_bytes(handle_type=1), ["handle type 1", "not 8"])
        unnamed = patch(patch(good, 10, "<H", 0), 48, "<I", 0)
        self.refused(unnamed[:32] + bytes(16) + unnamed[48:], ["device flag is not set"])
        self.refused(fabric_bytes(0, size=0, payload=b""), ["no chunks"])
        self.refused(fabric_bytes(2, payload=b"".join(HANDLES[:2])[:-1]), ["127 payload bytes"])
        self.refused(fabric_bytes(2, payload=b"".join(HANDLES[:3])), ["192 payload bytes"])
        self.refused(fabric_bytes(2, chunk_sizes=[G, 0]), ["chunk 2 of 2 has size 0"])
        self.refused(fabric_bytes(2, size=2 * G + 1), ["exceeds"])
        self.refused(fabric_bytes(2, chunk_sizes=[2**63, 2**63], size=1), ["overflows"])
        # Handle type 8 is carried by CUDA_FABRIC, not by CUDA_VMM.
        self.refused(peer.encode(peer.KIND_CUDA_VMM, handle_type=8, size=G, chunk_sizes=[G]),
                     ["handle type 8", "CUDA_FABRIC"], nfds=1)

    def test_repr_and_errors_show_no_handle_byte(self):
        desc = fabric(3)
        text = repr(desc) + str(desc)
        self.assertIn("<3 fabric handle(s), redacted>", text)
        self.assertIn(UUID.hex(), text)
        self.assertFalse(leaks(text), text)
        # A refused message whose payload is handles: its error names none of them.
        self.refused(patch(desc.encode()[0], 60, "<I", 7), ["reserved"])


class Endpoint(unittest.TestCase):
    def test_a_fabric_descriptor_crosses_an_endpoint_and_one_with_fds_is_refused(self):
        before = open_fds()
        name = f"@vmm-py-fabric-{os.getpid()}"
        with peer.Listener(name) as listener:
            accepted = []
            thread = threading.Thread(target=lambda: accepted.append(listener.accept(timeout=10)))
            thread.start()
            with peer.connect(name) as client:
                thread.join()
                with accepted[0] as server:
                    server.send_descriptor(fabric(3, size=5))
                    server.send_data(b"after")
                    got = client.recv_descriptor()
                    self.assertEqual((got.handles, got.chunk_sizes, got.size),
                                     (HANDLES[:3], [G] * 3, 5))
                    self.assertEqual(client.recv_data(), b"after")
                    # The same message with an fd in SCM_RIGHTS: refused, the fd closed.
                    r, w = os.pipe()
                    socket.send_fds(server.sock, [b"\0" + fabric_bytes(1)], [w])
                    os.close(w)
                    with self.assertRaisesRegex(peer.ProtocolError, "carries none"):
                        client.recv()
                    time.sleep(0.2)  # the closer thread
                    self.assertEqual(os.read(r, 1), b"")
                    os.close(r)
        self.assertEqual(open_fds(), before)


class Streams(unittest.TestCase):
    def pair(self):
        a, b = socket.socketpair()
        self.addCleanup(a.close)
        self.addCleanup(b.close)
        return a, b

    def test_messages_back_to_back_over_a_socketpair_even_byte_by_byte(self):
        a, b = self.pair()
        peer.write_message(a, fabric(2))
        peer.write_message(a, b"between")
        peer.write_message(a, b"")
        peer.write_message(a, fabric(1, size=3))
        got = [peer.read_message(b) for _ in range(4)]
        self.assertEqual(got[0].handles, HANDLES[:2])
        self.assertEqual((got[1], got[2]), (b"between", b""))
        self.assertIsInstance(got[1], peer.Data)
        self.assertEqual((got[3].handles, got[3].size), (HANDLES[:1], 3))
        # One message dribbled a byte at a time: the reader assembles it.
        data = b"\0" + fabric(3).encode()[0]

        def dribble():
            for i in range(len(data)):
                a.send(data[i:i + 1])
                time.sleep(0.0005)

        thread = threading.Thread(target=dribble)
        thread.start()
        self.assertEqual(peer.read_message(b).handles, HANDLES[:3])
        thread.join()
        a.close()
        with self.assertRaises(peer.PeerClosed):  # the stream ended between messages
            peer.read_message(b)

    def test_tcp_loopback_both_ways(self):
        with socket.create_server(("127.0.0.1", 0)) as server:
            client = peer.StreamConnection(socket.create_connection(server.getsockname()),
                                           caller_authenticated=True)
            sock, _ = server.accept()
            with peer.StreamConnection(sock, caller_authenticated=True) as listener_side, client:
                client.send_descriptor(fabric(2))
                got = listener_side.recv_descriptor()
                self.assertEqual(got.handles, HANDLES[:2])
                listener_side.send_data(b"imported")
                self.assertEqual(client.recv_data(), b"imported")
                listener_side.send_descriptor(fabric(1))
                self.assertEqual(client.recv_descriptor().handles, HANDLES[:1])

    def test_a_pipe(self):
        r, w = os.pipe()
        with open(r, "rb", buffering=0) as reader, open(w, "wb", buffering=0) as writer:
            peer.write_message(writer, fabric(2))
            peer.write_message(writer, b"done")
            writer.close()
            self.assertEqual(peer.read_message(reader).handles, HANDLES[:2])
            self.assertEqual(peer.read_message(reader), b"done")
            with self.assertRaises(peer.PeerClosed):
                peer.read_message(reader)

    def test_fd_kinds_cannot_be_written_on_a_stream(self):
        a, _ = self.pair()
        fd = peer.sealed_memfd(10)
        with peer.HostDescriptor(fd, 10) as host:
            with self.assertRaisesRegex(TypeError, "carries fds"):
                peer.write_message(a, host)
        with peer.VmmDescriptor([], [], 0) as vmm, self.assertRaises(TypeError):
            peer.write_message(a, vmm)

    def refused_quickly(self, sent, words, close=False):
        """``sent`` on a stream; the reader refuses it without waiting for more bytes."""
        a, b = self.pair()
        a.sendall(sent)
        if close:
            a.shutdown(socket.SHUT_WR)
        started = time.monotonic()
        with self.assertRaises(peer.ProtocolError) as caught:
            peer.read_message(b, timeout=5)
        self.assertLess(time.monotonic() - started, 2, "the reader waited for more bytes")
        for word in words:
            self.assertIn(word, str(caught.exception))
        self.assertFalse(leaks(str(caught.exception)))

    def test_refusals_on_a_stream(self):
        self.refused_quickly(b"GET / HTTP/1.1\r\n\r\n", ["frame byte 71"])
        self.refused_quickly(b"\0VMMI\x07\x00", ["protocol version 7"])  # 6 bytes: not waited on
        self.refused_quickly(b"\0HTTP/1.1", ["not a vmm-ipc"])
        header = fabric_bytes(2)[:64]
        # Fd kinds and the handshake are refused at the header (their body is never read).
        vmm = peer.encode(peer.KIND_CUDA_VMM, handle_type=1, size=G, chunk_sizes=[G])
        self.refused_quickly(b"\0" + vmm[:64], ["CUDA_VMM on a byte stream"])
        host = peer.encode(peer.KIND_HOST_MEMFD, size=10, chunk_sizes=[10])
        self.refused_quickly(b"\0" + host[:64], ["HOST_MEMFD on a byte stream"])
        self.refused_quickly(b"\0" + peer.encode(peer.KIND_HELLO), ["HELLO on a byte stream"])
        self.refused_quickly(b"\0" + peer.encode(peer.KIND_REFUSED, payload=b"x"),
                             ["REFUSED on a byte stream"])
        # Counts are checked before the body is read or allocated.
        self.refused_quickly(b"\0" + patch(header, 16, "<I", 2**32 - 1), ["at most 253"])
        self.refused_quickly(b"\0" + patch(header, 20, "<I", 2**31), ["at most 16384"])
        self.refused_quickly(b"\0" + patch(header, 4, "<H", 1), ["protocol version 1"])
        # The body's own rules, once it has arrived.
        self.refused_quickly(b"\0" + fabric_bytes(2, handle_type=1), ["handle type 1"])
        # A stream that ends inside a message.
        self.refused_quickly(b"\0VMM", ["ended inside"], close=True)
        self.refused_quickly(b"\0" + header[:40], ["ended inside"], close=True)
        self.refused_quickly(b"\0" + fabric_bytes(2)[:100], ["ended inside a CUDA_FABRIC"],
                             close=True)

    def test_a_silent_stream_times_out(self):
        a, b = self.pair()
        a.sendall(b"\0VMMI")
        started = time.monotonic()
        with self.assertRaises(TimeoutError):
            peer.read_message(b, timeout=0.3)
        self.assertLess(time.monotonic() - started, 2)

    def test_a_refusal_ends_a_stream_connection(self):
        a, b = self.pair()
        conn = peer.StreamConnection(b, caller_authenticated=True)
        a.sendall(b"\0" + patch(fabric_bytes(1), 60, "<I", 1))  # refused: reserved set
        a.sendall(b"\0" + fabric_bytes(1))  # valid, but after a refusal nobody trusts framing
        with self.assertRaisesRegex(peer.ProtocolError, "reserved"):
            conn.recv()
        with self.assertRaisesRegex(peer.ProtocolError, "has ended"):
            conn.recv()
        self.assertEqual(a.recv(10), b"")  # shut down: the writer sees the end
        conn.close()

    def test_a_plain_stream_is_only_the_callers_explicit_choice(self):
        # A plain socket authenticates no one: without the caller's word, no connection.
        a, b = self.pair()
        with self.assertRaisesRegex(ValueError, "authenticates no one"):
            peer.StreamConnection(b)
        a.close()
        b.close()


if __name__ == "__main__":
    unittest.main()
