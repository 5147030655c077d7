"""vmm_ipc_cuda's logic against a strict fake of cuda.bindings (fake_cuda/, no GPU): a 2-chunk
export travels over an endpoint to an importer that reads and writes it across the chunk
boundary; a descriptor of another device and a failed import leave nothing behind. The real
driver runs the same code on the GPU machine (peer_python's GPU tests, the daemon example)."""

import os
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


if __name__ == "__main__":
    unittest.main()
