"""vmm_memd's client against a hostile service: a real endpoint (vmm_ipc_peer's Listener, in a
thread of this process) that answers requests with forged replies and descriptors. Every one
must end in a typed exception, with nothing mapped that the protocol does not promise, and the
client staying in step (reading the rest of the reply, giving the lease back)."""

import fcntl
import os
import threading
import unittest

import vmm_ipc_peer as peer
import vmm_memd
from vmm_memd.postcard import Reader, Writer

_N = [0]
SIZE = 4096


def reply(index, fields=()):
    """A reply's bytes: the variant index, then (kind, value) fields."""
    w = Writer()
    w.variant(index)
    for kind, value in fields:
        getattr(w, kind)(value)
    return w.bytes()


def attached_reply(chunks, meta_pages=0, lease=5):
    w = Writer()
    w.variant(6)
    w.u64(lease)
    w.u64(1)
    w.usize(len(chunks))
    for c in chunks:
        w.u64(c)
    w.u32(meta_pages)
    w.u64(10_000)
    return w.bytes()


def memfd(size, seals):
    fd = os.memfd_create("hostile", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


SIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
COMMITTED = SIZE_SEALS | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL


def send_memfd(size, seals, announced=None):
    def step(conn):
        fd = memfd(size, seals)
        try:
            conn.send_descriptor(peer.HostDescriptor(fd, size if announced is None else announced))
        finally:
            os.close(fd)
    return step


def send_data(data):
    return lambda conn: conn.send_data(data)


class HostileService:
    """Accepts one client; for each request it reads, runs the next list of steps (sends);
    records every request's variant index until the client goes."""

    def __init__(self, *answers):
        _N[0] += 1
        self.name = f"@vmm-memd-hostile-{os.getpid()}-{_N[0]}"
        self.listener = peer.Listener(self.name, log=False)
        self.answers, self.requests, self.raw = list(answers), [], []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        with self.listener.accept(timeout=30) as conn:
            answers = iter(self.answers)
            while True:
                try:
                    request = conn.recv_data()
                except (peer.PeerClosed, OSError):
                    return
                self.requests.append(Reader(request).u32())
                self.raw.append(bytes(request))
                for step in next(answers, []):
                    step(conn)

    def __enter__(self):
        self.client = vmm_memd.Client.connect(self.name)
        return self

    def __exit__(self, *exc):
        self.client.close()
        self.thread.join(10)
        self.listener.close()


class HostileReplies(unittest.TestCase):
    def refused(self, data, kind=vmm_memd.DecodeError):
        with HostileService([send_data(data)]) as service:
            with self.assertRaises(kind) as caught:
                service.client.list()
        self.assertIsInstance(caught.exception, vmm_memd.BadReply)
        return caught.exception

    def test_an_oversized_length_is_refused(self):
        w = Writer()
        w.variant(1)
        w.usize(2**40)
        self.refused(w.bytes())
        w = Writer()
        w.variant(7)
        w.usize(vmm_memd.protocol.MAX_META_ENTRIES + 1)
        self.refused(w.bytes() + b"\x00" * 10)

    def test_a_truncated_reply_is_refused(self):
        full = reply(1, [("usize", 1), ("str", "region"), ("u64", 1), ("u64", 4096)])
        for cut in range(len(full)):
            self.refused(full[:cut])

    def test_trailing_bytes_are_refused(self):
        self.refused(reply(1, [("usize", 0)]) + b"\x00")

    def test_unknown_variants_are_refused(self):
        self.refused(reply(10))
        self.refused(reply(0, [("variant", 10)]))

    def test_a_reply_of_the_wrong_kind_is_bad_reply(self):
        e = self.refused(reply(4), vmm_memd.BadReply)
        self.assertNotIsInstance(e, vmm_memd.DecodeError)

    def test_an_end_mid_exchange_is_service_gone(self):
        with HostileService([lambda conn: conn.sock.close()]) as service:
            with self.assertRaises(vmm_memd.ServiceGone):
                service.client.list()


class HostileDescriptors(unittest.TestCase):
    def attach_refused(self, steps, kind, detach=False):
        # ``detach``: the client gives the lease back; the service says Done to that.
        answers = [steps, [send_data(reply(4))]] if detach else [steps]
        with HostileService(*answers) as service:
            with self.assertRaises(kind):
                service.client.attach("r")
        return service

    def test_a_chunk_not_sealed_against_writes_is_not_mapped(self):
        service = self.attach_refused(
            [send_data(attached_reply([SIZE])), send_memfd(SIZE, SIZE_SEALS)],
            vmm_memd.BadDescriptor, detach=True)
        # The lease was given back (Detach, variant 7).
        self.assertEqual(service.requests, [6, 7])

    def test_a_chunk_without_f_seal_seal_is_not_mapped(self):
        self.attach_refused(
            [send_data(attached_reply([SIZE])),
             send_memfd(SIZE, SIZE_SEALS | fcntl.F_SEAL_WRITE)], vmm_memd.BadDescriptor,
            detach=True)

    def test_a_bad_first_chunk_leaves_the_client_in_step(self):
        # The second chunk is read and closed, the lease given back, and the next request
        # gets its own reply.
        with HostileService(
                [send_data(attached_reply([SIZE, SIZE])), send_memfd(SIZE, 0),
                 send_memfd(SIZE, COMMITTED)],
                [send_data(reply(4))],
                [send_data(reply(1, [("usize", 0)]))]) as service:
            with self.assertRaises(vmm_memd.BadDescriptor):
                service.client.attach("r")
            self.assertEqual(service.client.list(), [])
        self.assertEqual(service.requests, [6, 7, 0])

    def test_a_descriptor_of_another_size_is_bad_reply(self):
        self.attach_refused(
            [send_data(attached_reply([SIZE])), send_memfd(2 * SIZE, COMMITTED)],
            vmm_memd.BadReply, detach=True)

    def test_a_descriptor_where_a_reply_belongs_is_bad_reply(self):
        with HostileService([send_memfd(SIZE, COMMITTED)]) as service:
            with self.assertRaises(vmm_memd.BadReply):
                service.client.list()

    def test_too_many_chunks_are_refused_before_any_is_read(self):
        self.attach_refused([send_data(attached_reply([SIZE] * 65))], vmm_memd.DecodeError)

    def test_a_tensor_outside_its_chunk_is_bad_reply(self):
        page = Writer()
        page.variant(7)
        page.usize(1)
        page.str("t")
        page.u32(0)
        page.u64(SIZE - 4)
        page.u64(8)  # past the chunk's end
        page.variant(0)
        page.usize(1)
        page.u64(8)
        service = self.attach_refused(
            [send_data(attached_reply([SIZE], meta_pages=1)), send_data(page.bytes()),
             send_memfd(SIZE, COMMITTED)], vmm_memd.BadReply, detach=True)
        self.assertEqual(service.requests, [6, 7])

    def test_a_committed_chunk_is_accepted(self):
        # The control: the same exchange with a properly sealed chunk maps it.
        with HostileService([send_data(attached_reply([SIZE])),
                             send_memfd(SIZE, COMMITTED)]) as service:
            attached = service.client.attach("r")
            self.assertEqual(attached.chunks[0].length, SIZE)

    def test_a_writer_is_refused_chunks_other_than_it_asked(self):
        began = reply(3, [("u64", 1), ("usize", 1), ("u64", 2 * SIZE)])
        with HostileService([send_data(began)]) as service:
            with self.assertRaises(vmm_memd.BadReply):
                service.client.begin("r", [SIZE])


if __name__ == "__main__":
    unittest.main()
