"""vmm_memd's GPU attach against a forged service and the strict fake of cuda.bindings
(fake_cuda/, no GPU): a GPU generation's chunks are imported, mapped read-only back to back,
read, and exported by DLPack as CUDA memory whose data pointer is the mapping; everything is
released with the last reference. A descriptor of another device, a driver refusal and a
process without cuda.bindings each end in a typed exception with the lease given back and no
fd, import or mapping left. A GPU writer (``publish_gpu``) copies host and CUDA arrays into
its pending chunk, describes them and commits; a reply with smaller chunks aborts. A refused
discard sleep leaves the attachment mapped and leased; a wake the driver refuses keeps the
slept range reserved and gives the lease back. The real driver runs the same code on the GPU machine
(test_memd_gpu_torch.py, from vmm-memd's python_client test)."""

import ctypes
import gc
import os
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_cuda"))

from cuda.bindings import driver as fake  # noqa: E402  (the fake, first on the path)

import vmm_ipc_cuda as vc  # noqa: E402
import vmm_ipc_peer as peer  # noqa: E402
import vmm_memd  # noqa: E402
from vmm_memd import dlpack  # noqa: E402
from vmm_memd.postcard import Writer  # noqa: E402
from vmm_memd.protocol import Dtype, TensorMeta  # noqa: E402
from test_memd_hostile import HostileService, reply, send_data  # noqa: E402

G = fake.GRANULARITY
ATTACH, DETACH, DISCARD = 6, 7, 13  # request variants
META = {"w": TensorMeta(0, 0, 64, Dtype.U8, (64,)),
        "b": TensorMeta(1, 256, 1024, Dtype.F32, (16, 16))}


def open_fds():
    return len(os.listdir("/proc/self/fd"))


def attached_gpu(chunks, uuid, lease=9, generation=3):
    w = Writer()
    w.variant(11)  # AttachedGpu
    w.u64(lease)
    w.u64(generation)
    w.usize(len(chunks))
    for c in chunks:
        w.u64(c)
    w.u32(1)  # one metadata page
    w.u64(10_000)
    for b in uuid:
        w.u8(b)
    w.bool(False)
    return w.bytes()


def meta_page(entries):
    w = Writer()
    w.variant(7)  # MetaPage
    w.usize(len(entries))
    for key, m in entries.items():
        w.str(key)
        w.u32(m.chunk)
        w.u64(m.offset)
        w.u64(m.len)
        w.variant(int(m.dtype))
        w.usize(len(m.shape))
        for d in m.shape:
            w.u64(d)
    return w.bytes()


class Exported:
    """Two chunks of device memory (the fake's memfds) filled with a pattern, as the service
    holds a GPU generation; ``steps`` answer an attach with them."""

    def __init__(self, chunk=G, uuid=fake.UUID):
        self.ctx = vc.Context(0)
        self.owned = vc.Allocation(self.ctx, chunks=2)
        self.data = bytes(peer.pattern(4, 2 * G))
        self.owned.write(0, self.data)
        self.chunk, self.uuid = chunk, uuid

    def steps(self, uuid=None):
        uuid = self.uuid if uuid is None else uuid

        def send_chunks(conn):
            with self.owned.export() as whole:
                for fd in whole.fds:
                    conn.send_descriptor(peer.VmmDescriptor([fd], [self.chunk], self.chunk,
                                                            device_uuid=uuid))
        return [send_data(attached_gpu([self.chunk, self.chunk], uuid)),
                send_data(meta_page(META)), send_chunks]

    def close(self):
        self.owned.close()


def imports():
    """Allocations the fake driver holds (the exporter's and every import)."""
    return len(fake._allocations)


class GpuAttach(unittest.TestCase):
    def setUp(self):
        self.assertTrue(fake.__file__.endswith(os.path.join("fake_cuda", "cuda", "bindings",
                                                            "driver.py")), fake.__file__)
        self.exported = Exported()
        self.fds, self.imports, self.mapped = open_fds(), imports(), len(fake._mappings)

    def tearDown(self):
        self.exported.close()

    def assert_nothing_left(self):
        gc.collect()
        self.assertEqual(open_fds(), self.fds)
        self.assertEqual(imports(), self.imports)
        self.assertEqual(len(fake._mappings), self.mapped)

    def test_chunks_are_imported_read_only_and_exported_by_dlpack_on_the_device(self):
        with HostileService(self.exported.steps()) as service:
            attached = service.client.attach("weights")
            self.assertEqual((attached.generation, attached.lease), (3, 9))
            w, b = attached["w"], attached["b"]
            self.assertEqual(w.tobytes(), self.exported.data[:64])
            self.assertEqual(b.tobytes(), self.exported.data[G + 256:G + 256 + 1024])
            # Back to back in one reservation, and read-only for the device.
            self.assertEqual(b.address, w.address + G + 256)
            ours = [a for va, (_, _, _, a) in fake._mappings.items()
                    if w.address <= va < w.address + 2 * G]
            self.assertEqual(ours, ["read", "read"])
            self.assertEqual(w.__dlpack_device__(), (dlpack.KDL_CUDA, 0))
            with self.assertRaises(BufferError):
                w.memoryview()
            # The capsule's tensor is the mapping itself, on CUDA device 0, read-only.
            capsule = b.__dlpack__(stream=7, max_version=(1, 0))
            get = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
                ("PyCapsule_GetPointer", ctypes.pythonapi))
            managed = dlpack.DLManagedTensorVersioned.from_address(
                get(capsule, b"dltensor_versioned"))
            t = managed.dl_tensor
            self.assertEqual((t.data, t.device.device_type, t.device.device_id),
                             (b.address, dlpack.KDL_CUDA, 0))
            self.assertEqual((t.ndim, t.shape[0], t.shape[1]), (2, 16, 16))
            self.assertEqual(managed.flags & dlpack.FLAG_READ_ONLY, 1)
            with self.assertRaises(BufferError):
                b.__dlpack__(dl_device=(dlpack.KDL_CPU, 0))
            # The capsule keeps the mapping after everything else has gone.
            del attached, w, managed, t
            gc.collect()
            self.assertEqual(len(fake._mappings), self.mapped + 2)
            self.assertEqual(b.tobytes()[:4], self.exported.data[G + 256:G + 260])
            del b, capsule
        self.assertEqual(service.requests, [ATTACH])
        self.assert_nothing_left()

    def test_another_device_or_a_mismatched_chunk_is_refused_and_the_lease_given_back(self):
        other = bytes(16)
        # A region on a device this process does not have: GpuRegion.
        with HostileService(self.exported.steps(uuid=other), [send_data(reply(4))]) as service:
            with self.assertRaises(vmm_memd.GpuRegion) as caught:
                service.client.attach("weights")
            self.assertEqual(caught.exception.device, other)
        self.assertEqual(service.requests, [ATTACH, DETACH])
        # The reply names this device, its chunks another: BadReply.
        mismatched = self.exported.steps()
        mismatched[2] = self.exported.steps(uuid=other)[2]
        with HostileService(mismatched, [send_data(reply(4))]) as service:
            with self.assertRaises(vmm_memd.BadReply):
                service.client.attach("weights")
        self.assertEqual(service.requests, [ATTACH, DETACH])
        self.assert_nothing_left()

    def test_a_driver_refusal_is_typed_and_leaves_nothing(self):
        # A chunk size that is not a multiple of the granularity: the reservation fails.
        self.exported.chunk = 4096
        with HostileService(self.exported.steps(), [send_data(reply(4))]) as service:
            with self.assertRaises(vmm_memd.GpuImportFailed):
                service.client.attach("weights")
        self.assertEqual(service.requests, [ATTACH, DETACH])
        self.assert_nothing_left()

    def test_a_refused_discard_sleep_leaves_the_attachment_mapped_and_leased(self):
        denied = reply(0, [("variant", 1), ("str", "weights"), ("variant", 1), ("u32", 0)])
        with HostileService(self.exported.steps(), [send_data(denied)],
                            [send_data(reply(4))]) as service:
            attached = service.client.attach("weights")
            with self.assertRaises(vmm_memd.AccessDenied) as caught:
                service.client.sleep(attached, discard=True)
            self.assertEqual(caught.exception.right, "write")
            # Untouched: still mapped, its bytes there, the lease still to end.
            self.assertTrue(attached.gpu.mapped)
            self.assertEqual(attached["w"].tobytes(), self.exported.data[:64])
            service.client.detach(attached)
        self.assertEqual(service.requests, [ATTACH, DISCARD, DETACH])
        del attached
        self.assert_nothing_left()

    def test_a_wake_the_driver_refuses_keeps_the_range_and_gives_the_lease_back(self):
        def forged_chunks(conn):  # memfds that are no exported allocation: the driver refuses
            for _ in range(2):
                fd = os.memfd_create("not-an-allocation", os.MFD_CLOEXEC)
                try:
                    os.ftruncate(fd, G)
                    conn.send_descriptor(peer.VmmDescriptor([fd], [G], G,
                                                            device_uuid=fake.UUID))
                finally:
                    os.close(fd)
        forged = self.exported.steps()[:2] + [forged_chunks]
        done = [send_data(reply(4))]
        with HostileService(self.exported.steps(), done, forged, done,
                            self.exported.steps()) as service:
            attached = service.client.attach("weights")
            w = attached["w"]
            sleeping = service.client.sleep(attached)
            address = sleeping.gpu_address()
            self.assertEqual(address, w.address)
            with self.assertRaises(vmm_memd.GpuImportFailed) as caught:
                service.client.wake(sleeping)
            self.assertIn("cuMemImportFromShareableHandle", caught.exception.why)
            self.assertTrue(attached.gpu.asleep)
            self.assertEqual(fake._reservations.get(address), 2 * G)
            self.assertFalse(any(address <= va < address + 2 * G for va in fake._mappings))
            woken = service.client.wake(sleeping)
            self.assertEqual(woken.gpu.address, address)
            self.assertEqual(w.tobytes(), self.exported.data[:64])
        self.assertEqual(service.requests, [ATTACH, DETACH, ATTACH, DETACH, ATTACH])
        del attached, w, sleeping, woken, caught
        self.assert_nothing_left()

    def test_without_cuda_bindings_a_gpu_region_is_GpuRegion(self):
        saved = sys.modules.get("vmm_ipc_cuda")
        sys.modules["vmm_ipc_cuda"] = None  # `import vmm_ipc_cuda` raises ImportError
        try:
            with HostileService(self.exported.steps(), [send_data(reply(4))]) as service:
                with self.assertRaises(vmm_memd.GpuRegion) as caught:
                    service.client.attach("weights")
            self.assertIn("cuda.bindings", caught.exception.why)
        finally:
            sys.modules["vmm_ipc_cuda"] = saved
        self.assertEqual(service.requests, [ATTACH, DETACH])
        self.assert_nothing_left()


def began_gpu(chunks, uuid, generation=4):
    w = Writer()
    w.variant(10)  # BeganGpu
    w.u64(generation)
    w.usize(len(chunks))
    for c in chunks:
        w.u64(c)
    for b in uuid:
        w.u8(b)
    w.bool(False)
    return w.bytes()


def committed(generation):
    return reply(5, [("u64", generation)])


class CudaArray:
    """A CUDA array as torch and CuPy describe theirs (__cuda_array_interface__), over device
    memory of the fake driver."""

    def __init__(self, address, shape, typestr):
        self.__cuda_array_interface__ = {"data": (address, False), "shape": shape,
                                         "typestr": typestr, "version": 3}


class GpuPublish(unittest.TestCase):
    def setUp(self):
        self.exported = Exported()
        self.fds, self.imports, self.mapped = open_fds(), imports(), len(fake._mappings)

    def tearDown(self):
        self.exported.close()

    def served(self):
        """Answers to BeginOn (the pending chunk: the exporter's first chunk, writable), then
        PutMeta (Done) and Commit (Committed 4)."""
        def send_chunk(conn):
            with self.exported.owned.export() as whole:
                conn.send_descriptor(peer.VmmDescriptor([whole.fds[0]], [G], G,
                                                        device_uuid=fake.UUID))
        return [[send_data(began_gpu([G], fake.UUID)), send_chunk],
                [send_data(reply(4))], [send_data(committed(4))]]

    def test_host_and_cuda_arrays_are_copied_in_described_and_committed(self):
        # The source on the device: the exporter's second chunk, 64 float32s.
        source = self.exported.owned.va + G
        on_device = CudaArray(source, (4, 16), "<f4")
        on_host = bytes(range(100))
        with HostileService(*self.served()) as service:
            generation = vmm_memd.publish_gpu(service.client, "weights",
                                              {"h": on_host, "d": on_device})
        self.assertEqual(generation, 4)
        self.assertEqual(service.requests, [11, 3, 4])  # BeginOn, PutMeta, Commit
        self.assertEqual(service.raw[0], vmm_memd.protocol.encode_begin_gpu(
            "weights", [512], fake.UUID))
        metas = [("h", TensorMeta(0, 0, 100, Dtype.U8, (100,))),
                 ("d", TensorMeta(0, 256, 256, Dtype.F32, (4, 16)))]
        self.assertEqual(service.raw[1], vmm_memd.protocol.encode_put_meta(metas))
        # What the service's chunk holds now.
        self.assertEqual(self.exported.owned.read(0, 100), on_host)
        self.assertEqual(self.exported.owned.read(256, 256), self.exported.data[G:G + 256])
        # The writer's mapping went before the commit.
        self.assert_nothing_left()

    def test_a_reply_with_smaller_chunks_aborts_and_a_non_contiguous_array_is_refused(self):
        with HostileService([send_data(began_gpu([G // 2], fake.UUID))],
                            [send_data(reply(4))]) as service:
            with self.assertRaises(vmm_memd.BadReply):
                service.client.begin_gpu("weights", [G])
        self.assertEqual(service.requests, [11, 5])  # BeginOn, Abort
        strided = CudaArray(self.exported.owned.va, (4, 4), "<f4")
        strided.__cuda_array_interface__["strides"] = (32, 4)
        with self.assertRaises(ValueError):
            vmm_memd.publishing.describe_device(strided)
        with self.assertRaises(TypeError):
            vmm_memd.publishing.describe_device(CudaArray(0, (1,), "<c8"))
        self.assert_nothing_left()

    assert_nothing_left = GpuAttach.assert_nothing_left


if __name__ == "__main__":
    unittest.main()
