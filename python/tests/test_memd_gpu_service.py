"""vmm_memd's GPU path against the REAL vmm-memd, whose GPU backend runs on a fake libcuda.so
(vmm-fake-driver: allocations are memfds named "fake-cuda", device addresses are host
addresses), while this process runs on the fake cuda.bindings (fake_cuda/, the same model and
device UUID). The service's own bytes reach this client, so any mismatch between what the
service sends for a GPU region and what the client expects fails here, on every commit, with
no GPU. ``vmm-memd/tests/python_fake_gpu.rs`` starts the service and runs these with:

- ``VMM_MEMD_SOCKET``: the service;
- ``VMM_MEMD_GPU_REGION=region:generation``: a GPU region Rust published (two chunks, tensors
  ``t0`` and ``t1``, each chunk filled with ``pattern(generation, chunk, length)``);
- ``VMM_MEMD_GPU_FROM_PYTHON``: the name of the region to publish here, which Rust then
  attaches and checks (``HOST_BYTES`` as ``host``, ``DEVICE_BYTES`` as ``device``).
"""

import gc
import os
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_cuda"))

from cuda.bindings import driver as fake  # noqa: E402  (the fake, first on the path)

import vmm_ipc_cuda as vc  # noqa: E402
import vmm_memd  # noqa: E402
from vmm_memd import dlpack  # noqa: E402
from vmm_memd.protocol import Dtype, TensorMeta  # noqa: E402

SOCKET = os.environ.get("VMM_MEMD_SOCKET")
G = fake.GRANULARITY
#: What Python publishes (Rust checks the same bytes: python_fake_gpu.rs).
HOST_BYTES = bytes(range(256)) * 16
DEVICE_BYTES = bytes((i * 7 + 3) % 256 for i in range(256))


def pattern(generation, chunk, length):
    """vmm-memd's tests' GPU pattern (tests/common/gpu.rs): byte i is
    ``(i * 31) ^ (generation * 7 + chunk * 13)``, truncated to a byte (so it repeats every 256
    bytes)."""
    key = generation * 7 + chunk * 13
    block = bytes(((i * 31) ^ key) & 0xFF for i in range(256))
    return (block * (length // 256 + 1))[:length]


class CudaArray:
    """A CUDA array as torch and CuPy describe theirs, over device memory of the fake."""

    def __init__(self, address, shape, typestr):
        self.__cuda_array_interface__ = {"data": (address, False), "shape": shape,
                                         "typestr": typestr, "version": 3}


def state():
    """What the fake driver holds in this process: allocations, mappings, open fds."""
    gc.collect()
    return len(fake._allocations), len(fake._mappings), len(os.listdir("/proc/self/fd"))


@unittest.skipUnless(SOCKET, "VMM_MEMD_SOCKET names no running vmm-memd")
class GpuService(unittest.TestCase):
    def setUp(self):
        self.assertTrue(fake.__file__.endswith(os.path.join("fake_cuda", "cuda", "bindings",
                                                            "driver.py")), fake.__file__)
        self.client = vmm_memd.Client.connect(SOCKET)

    def tearDown(self):
        self.client.close()

    def access(self, address, length):
        """The fake's access of each mapping in ``address .. address + length``."""
        return [a for va, (_, _, _, a) in sorted(fake._mappings.items())
                if address <= va < address + length]

    def test_a_region_rust_published_attaches_here_read_only(self):
        region, generation = os.environ["VMM_MEMD_GPU_REGION"].rsplit(":", 1)
        generation = int(generation)
        before = state()
        attached = self.client.attach(region)
        self.assertEqual(attached.generation, generation)
        self.assertEqual(sorted(attached.meta), ["t0", "t1"])
        t0, t1 = attached["t0"], attached["t1"]
        for i, tensor in enumerate((t0, t1)):
            self.assertEqual(tensor.__dlpack_device__(), (dlpack.KDL_CUDA, 0))
            self.assertEqual(tensor.tobytes(), pattern(generation, i, tensor.nbytes))
        # Back to back in one reservation, read-only for the device.
        self.assertEqual(t1.address, t0.address + t0.nbytes)
        self.assertEqual(self.access(t0.address, t0.nbytes + t1.nbytes), ["read", "read"])
        verified = self.client.verify(region)
        self.assertEqual((verified.generation, len(verified.digests)), (generation, 2))
        self.client.detach(attached)
        del attached, t0, t1, tensor
        self.assertEqual(state(), before)

    def test_a_region_published_here_attaches_back_and_verifies(self):
        region = os.environ["VMM_MEMD_GPU_FROM_PYTHON"]
        before = state()
        ctx = vc.Context(0)
        self.assertEqual(ctx.uuid, fake.UUID)
        source = vc.Allocation(ctx)  # device memory of this process
        source.write(0, DEVICE_BYTES)
        generation = vmm_memd.publish_gpu(self.client, region, {
            "host": HOST_BYTES,
            "device": CudaArray(source.va, (64,), "<f4"),
        })
        source.close()
        # The writer's imports and mapping went at the commit, and no fd stayed.
        self.assertEqual(state(), before)
        attached = self.client.attach(region)
        self.assertEqual(attached.generation, generation)
        self.assertEqual(attached["host"].tobytes(), HOST_BYTES)
        self.assertEqual(attached["device"].tobytes(), DEVICE_BYTES)
        self.assertEqual(attached.meta["device"], TensorMeta(0, 4096, 256, Dtype.F32, (64,)))
        # The service's digests (taken on its fake driver at the commit) match what this
        # process's fake wrote: both fakes' "device memory" is the same memfd.
        self.assertEqual(self.client.verify(region).generation, generation)
        self.client.detach(attached)

    def test_a_writer_fills_two_chunks_commits_and_aborts(self):
        region = f"py-gpu-writer-{os.getpid()}"
        writer = self.client.begin_gpu(region, [G + 1, 10])
        self.assertEqual(writer.gpu.sizes, [2 * G, G])  # rounded up by the service
        self.assertEqual(self.access(writer.gpu.address, 3 * G), ["rw", "rw"])
        writer.write(0, 2 * G - 3, b"end")
        writer.write(1, 0, b"second chunk")
        writer.put("end", TensorMeta(0, 2 * G - 3, 3, Dtype.U8, (3,)))
        writer.put("second", TensorMeta(1, 0, 12, Dtype.U8, (12,)))
        generation = writer.commit()
        attached = self.client.attach(region)
        self.assertEqual((attached["end"].tobytes(), attached["second"].tobytes()),
                         (b"end", b"second chunk"))
        self.assertEqual(attached["end"].address + 3, attached["second"].address)
        # A generation begun and aborted leaves the committed one current.
        with self.client.begin_gpu(region, [G]) as aborted:
            aborted.write(0, 0, b"never")
            aborted.abort()
        self.assertEqual(self.client.attach(region).generation, generation)
        self.client.verify(region)

    def test_the_fake_refuses_an_fd_that_is_no_allocation(self):
        # A host region's chunk is a memfd too, but no exported allocation: the driver (and so
        # both fakes) refuses to import it.
        fd = os.memfd_create("vmm-memd-chunk", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, G)
            result = fake.cuMemImportFromShareableHandle(
                fd, fake.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
            self.assertEqual(result, (fake.CUresult.CUDA_ERROR_INVALID_VALUE,))
        finally:
            os.close(fd)


if __name__ == "__main__":
    unittest.main()
