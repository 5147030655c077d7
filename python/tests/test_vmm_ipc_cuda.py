"""vmm_ipc_cuda's logic against a strict fake of cuda.bindings (fake_cuda/, no GPU): a 2-chunk
export travels over an endpoint to an importer that reads and writes it across the chunk
boundary; a descriptor of another device and a failed import leave nothing behind; a fabric
export travels over an endpoint and over TCP and is imported, and a failed fabric import rolls
back; a mapping taken apart keeps its address range, and an import at that range maps there
again (or gives it back intact). The real driver runs the same code on the GPU machine
(peer_python's GPU tests)."""

import gc
import os
import socket
import sys
import threading
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_cuda"))

from cuda.bindings import driver as fake  # noqa: E402  (the fake, first on the path)

import vmm_ipc_cuda as vc  # noqa: E402
import vmm_ipc_peer as peer  # noqa: E402

G = fake.GRANULARITY


def open_fds():
    return len(os.listdir("/proc/self/fd")) - 1


class FakeDriver(unittest.TestCase):
    def setUp(self):
        self.assertTrue(fake.__file__.endswith(os.path.join("fake_cuda", "cuda", "bindings",
                                                            "driver.py")), fake.__file__)

    def test_a_two_chunk_export_is_imported_over_an_endpoint(self):
        ctx = vc.Context(0)
        before = open_fds()
        owned = vc.Allocation(ctx, chunks=2)
        self.assertEqual((owned.size, owned.chunk_sizes), (2 * G, [G, G]))
        expected = bytearray(peer.pattern(5, owned.size))
        owned.write(0, expected)
        owned.write(G - 3, b"abcdef")  # across the boundary between the chunks
        expected[G - 3:G + 3] = b"abcdef"
        name = f"@vmm-py-fake-cuda-{os.getpid()}"
        errors = []
        with peer.Listener(name) as listener:
            def serve():
                try:
                    with listener.accept(timeout=10) as conn, owned.export() as desc:
                        conn.send_descriptor(desc)
                        if conn.recv_data() != b"written":
                            errors.append("no reply")
                except BaseException as e:
                    errors.append(e)

            thread = threading.Thread(target=serve)
            thread.start()
            with peer.connect(name) as conn:
                with conn.recv_descriptor() as desc:
                    self.assertIsInstance(desc, peer.VmmDescriptor)
                    self.assertEqual((desc.chunk_sizes, desc.size, desc.device_uuid),
                                     ([G, G], 2 * G, ctx.uuid))
                    mapping = vc.import_descriptor(ctx, desc)
                self.assertEqual(mapping.read(0, mapping.size), bytes(expected))
                self.assertEqual(mapping.read(G - 1, 2), b"cd")
                mapping.write(0, peer.pattern(6, mapping.size))
                mapping.close()
                conn.send_data(b"written")
            thread.join()
        self.assertEqual(errors, [])
        self.assertEqual(owned.read(0, owned.size), peer.pattern(6, owned.size))
        owned.close()
        self.assertEqual(fake._allocations, {})
        self.assertEqual(fake._mappings, {})
        self.assertEqual(fake._reservations, {})
        self.assertEqual(open_fds(), before)

    def test_another_devices_descriptor_is_refused_before_any_import(self):
        ctx = vc.Context(0)
        owned = vc.Allocation(ctx)
        with owned.export() as desc:
            desc.device_uuid = bytes(16)
            with self.assertRaises(ValueError):
                vc.import_descriptor(ctx, desc)
        self.assertEqual(len(fake._allocations), 1)  # only the exporter's own
        owned.close()

    def test_a_failed_import_releases_what_it_imported(self):
        ctx = vc.Context(0)
        owned = vc.Allocation(ctx)
        before = open_fds()
        with owned.export() as desc:
            desc.fds.append(999_999)  # a second "chunk" whose fd is not open
            desc.chunk_sizes.append(G)
            with self.assertRaises(RuntimeError) as caught:
                vc.import_descriptor(ctx, desc)
            self.assertIn("cuMemImportFromShareableHandle", str(caught.exception))
            desc.fds.pop()
        self.assertEqual(len(fake._allocations), 1)
        self.assertEqual(open_fds(), before)
        owned.close()

    def test_a_kept_range_is_mapped_again_at_the_same_address(self):
        ctx = vc.Context(0)
        before = open_fds()
        owned = vc.Allocation(ctx, chunks=2)
        data = peer.pattern(8, 2 * G)
        owned.write(0, data)
        with owned.export() as desc:
            mapping = vc.import_descriptor(ctx, desc, read_only=True)
        va = mapping.va

        def mapped_in_range():
            return [m for m in fake._mappings if va <= m < va + 2 * G]

        # Unmapped and the imports released; the range still reserved.
        kept = mapping.unmap_keep_range()
        self.assertEqual((kept.va, kept.size, kept.reserved), (va, 2 * G, True))
        self.assertEqual(fake._reservations.get(va), 2 * G)
        self.assertEqual(mapped_in_range(), [])
        self.assertEqual(len(fake._allocations), 2)  # the exporter's own two only
        mapping.close()  # taken apart already: nothing to do
        with self.assertRaises(ValueError):
            mapping.unmap_keep_range()
        self.assertTrue(kept.reserved)
        # A reservation hinted at the kept range gets another one.
        squatter = vc.check(fake.cuMemAddressReserve(2 * G, 0, va, 0), "cuMemAddressReserve")
        self.assertNotEqual(int(squatter), va)
        vc.check(fake.cuMemAddressFree(squatter, 2 * G), "cuMemAddressFree")

        # An import the driver refuses (its second chunk's memory is not the size the
        # descriptor says): nothing mapped, the range given back.
        big = vc.Allocation(ctx, chunk_size=2 * G)
        with owned.export() as a, big.export() as b:
            bad = peer.VmmDescriptor([a.fds[0], b.fds[0]], [G, G], 2 * G,
                                     device_uuid=ctx.uuid)
            with self.assertRaises(RuntimeError) as caught:
                vc.import_descriptor(ctx, bad, read_only=True, at=kept)
            self.assertIn("cuMemMap", str(caught.exception))
            # A descriptor of another total size is refused before anything is imported.
            one = peer.VmmDescriptor([a.fds[0]], [G], G, device_uuid=ctx.uuid)
            with self.assertRaises(ValueError):
                vc.import_descriptor(ctx, one, at=kept)
        self.assertTrue(kept.reserved)
        self.assertEqual(fake._reservations.get(va), 2 * G)
        self.assertEqual(mapped_in_range(), [])
        self.assertEqual(len(fake._allocations), 3)  # the exporters' only
        big.close()

        # Mapped again there: the same address, the memory's bytes; the range is the
        # mapping's now (an import at it again is refused, closing it does nothing).
        with owned.export() as desc:
            again = vc.import_descriptor(ctx, desc, read_only=True, at=kept)
            self.assertEqual(again.va, va)
            self.assertFalse(kept.reserved)
            with self.assertRaises(ValueError):
                vc.import_descriptor(ctx, desc, at=kept)
        kept.close()
        self.assertEqual(again.read(G - 4, 8), data[G - 4:G + 4])
        self.assertEqual([fake._mappings[m][3] for m in mapped_in_range()], ["read", "read"])
        again.close()
        self.assertNotIn(va, fake._reservations)
        # Free, the range is what a hint gets (so the squatter above was kept out).
        hinted = vc.check(fake.cuMemAddressReserve(2 * G, 0, va, 0), "cuMemAddressReserve")
        self.assertEqual(int(hinted), va)
        vc.check(fake.cuMemAddressFree(hinted, 2 * G), "cuMemAddressFree")

        # A kept range is freed by close() or once nothing refers to it.
        for how in ("close", "drop"):
            with owned.export() as desc:
                kept = vc.import_descriptor(ctx, desc).unmap_keep_range()
            self.assertIn(kept.va, fake._reservations)
            freed = kept.va
            if how == "close":
                kept.close()
                kept.close()
            del kept
            gc.collect()
            self.assertNotIn(freed, fake._reservations)
        owned.close()
        self.assertEqual((fake._allocations, fake._mappings, fake._reservations), ({}, {}, {}))
        self.assertEqual(open_fds(), before)


class FakeFabric(unittest.TestCase):
    def tearDown(self):
        self.assertEqual(fake._mappings, {})
        self.assertEqual(fake._reservations, {})

    def exchange(self, owned, send, receive):
        """``send(desc)`` on one thread, ``receive()`` (a FabricDescriptor) here; import it,
        check the owner's pattern across the chunk boundary, write ours, reply."""
        ctx = owned.ctx
        errors = []

        def serve():
            try:
                desc = owned.export_fabric()
                self.assertIn("redacted", repr(desc))
                send(desc)
            except BaseException as e:
                errors.append(e)

        thread = threading.Thread(target=serve)
        thread.start()
        desc = receive()
        thread.join()
        self.assertEqual(errors, [])
        self.assertIsInstance(desc, peer.FabricDescriptor)
        self.assertEqual((desc.chunk_sizes, desc.size, desc.owner_uuid, desc.owner_ordinal),
                         (owned.chunk_sizes, owned.size, ctx.uuid, ctx.ordinal))
        mapping = vc.import_fabric(ctx, desc)
        self.assertEqual(mapping.read(0, mapping.size), peer.pattern(11, mapping.size))
        self.assertEqual(mapping.read(G - 2, 4), peer.pattern(11, G + 2)[G - 2:])
        mapping.write(0, peer.pattern(12, mapping.size))
        mapping.close()
        self.assertEqual(owned.read(0, owned.size), peer.pattern(12, owned.size))

    def test_a_fabric_export_is_imported_over_an_endpoint(self):
        ctx = vc.Context(0)
        before = open_fds()
        owned = vc.Allocation(ctx, chunks=2, fabric=True, size=2 * G - 4096)
        owned.write(0, peer.pattern(11, owned.size))
        name = f"@vmm-py-fake-fabric-{os.getpid()}"
        with peer.Listener(name) as listener:
            accepted = []
            acceptor = threading.Thread(
                target=lambda: accepted.append(listener.accept(timeout=10)))
            acceptor.start()
            with peer.connect(name) as conn:
                acceptor.join()
                with accepted[0] as theirs:
                    self.exchange(owned, theirs.send_descriptor, conn.recv_descriptor)
        owned.close()
        self.assertEqual(fake._allocations, {})
        self.assertEqual(fake._fabric, {})
        self.assertEqual(open_fds(), before)

    def test_a_fabric_export_is_imported_over_tcp(self):
        ctx = vc.Context(0)
        before = open_fds()
        owned = vc.Allocation(ctx, chunks=2, fabric=True)
        owned.write(0, peer.pattern(11, owned.size))
        with socket.create_server(("127.0.0.1", 0)) as server:
            client = peer.StreamConnection(socket.create_connection(server.getsockname()),
                                           caller_authenticated=True)
            theirs, _ = server.accept()
            with peer.StreamConnection(theirs, caller_authenticated=True) as sender, client:
                self.exchange(owned, sender.send_descriptor, client.recv_descriptor)
        owned.close()
        self.assertEqual(fake._allocations, {})
        self.assertEqual(open_fds(), before)

    def test_another_owner_device_is_left_to_the_driver(self):
        ctx = vc.Context(0)
        owned = vc.Allocation(ctx, fabric=True)
        desc = owned.export_fabric()
        desc.owner_uuid = bytes(reversed(ctx.uuid))  # a GPU this process may not see
        mapping = vc.import_fabric(ctx, desc)
        mapping.close()
        owned.close()
        self.assertEqual(fake._allocations, {})

    def test_a_posix_allocation_does_not_export_fabric_handles(self):
        ctx = vc.Context(0)
        owned = vc.Allocation(ctx)
        with self.assertRaisesRegex(ValueError, "fabric=True"):
            owned.export_fabric()
        owned.fabric = True  # asked anyway: the driver refuses
        with self.assertRaisesRegex(RuntimeError, "cuMemExportToShareableHandle"):
            owned.export_fabric()
        owned.close()

    def test_a_failed_fabric_import_releases_what_it_imported(self):
        ctx = vc.Context(0)
        start = open_fds()
        owned = vc.Allocation(ctx, chunks=2, fabric=True)
        before = open_fds()
        good = owned.export_fabric()
        forged = bytes(64)
        desc = peer.FabricDescriptor([good.handles[0], forged], good.chunk_sizes, good.size,
                                     good.owner_uuid)
        with self.assertRaises(RuntimeError) as caught:
            vc.import_fabric(ctx, desc)
        self.assertIn("chunk 2 of 2", str(caught.exception))
        self.assertNotIn(good.handles[0].hex(), str(caught.exception))
        self.assertEqual(len(fake._allocations), 2)  # only the exporter's own
        self.assertEqual(open_fds(), before)
        # A mapping failure (a chunk size the allocation does not have) rolls back too.
        wrong = peer.FabricDescriptor(good.handles, [G, 2 * G], G, good.owner_uuid)
        with self.assertRaisesRegex(RuntimeError, "cuMemMap"):
            vc.import_fabric(ctx, wrong)
        self.assertEqual(len(fake._allocations), 2)
        self.assertEqual(open_fds(), before)
        # Chunk sizes off the granularity are refused before any driver call.
        odd = peer.FabricDescriptor(good.handles, [G, G + 1], G, good.owner_uuid)
        with self.assertRaisesRegex(ValueError, "chunk 2 of 2"):
            vc.import_fabric(ctx, odd)
        owned.close()
        # The exporter released the memory: its handles no longer import.
        with self.assertRaisesRegex(RuntimeError, "chunk 1 of 2"):
            vc.import_fabric(ctx, good)
        self.assertEqual(fake._allocations, {})
        self.assertEqual(open_fds(), start)


if __name__ == "__main__":
    unittest.main()
