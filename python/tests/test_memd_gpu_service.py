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
    """What the fake driver holds in this process: allocations, mappings, address
    reservations, open fds."""
    gc.collect()
    return (len(fake._allocations), len(fake._mappings), len(fake._reservations),
            len(os.listdir("/proc/self/fd")))


def reserve_at(address, size):
    """A reservation of this process hinted at ``address`` (where the driver places it when
    that range is free); freed again. Where it went."""
    got = int(vc.check(fake.cuMemAddressReserve(size, 0, address, 0), "cuMemAddressReserve"))
    vc.check(fake.cuMemAddressFree(got, size), "cuMemAddressFree")
    return got


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


@unittest.skipUnless(SOCKET, "VMM_MEMD_SOCKET names no running vmm-memd")
class GpuSleep(unittest.TestCase):
    """Sleep and wake of a GPU region at a stable device address: the service's chunks (its
    fake driver's memfds) imported here on the fake cuda.bindings."""

    META = {"a": TensorMeta(0, 0, G, Dtype.U8, (G,)),
            "b": TensorMeta(1, 0, 256, Dtype.U8, (256,))}

    def setUp(self):
        self.client = vmm_memd.Client.connect(SOCKET)
        self.before = state()

    def tearDown(self):
        self.client.close()

    def publish(self, region, second=G, meta=None):
        """A generation of two chunks (``G`` and ``second`` bytes) filled with
        ``pattern(generation, chunk, ...)``, tensors ``META``; its number."""
        meta = self.META if meta is None else meta
        with self.client.begin_gpu(region, [G, second]) as writer:
            generation = writer.generation
            writer.write(0, 0, pattern(generation, 0, G))
            writer.write(1, 0, pattern(generation, 1, second))
            for key, m in meta.items():
                writer.put(key, m)
            self.assertEqual(writer.commit(), generation)
        return generation

    def readers(self, region):
        """The leases the service holds on ``region``'s generations."""
        status = self.client.status()
        current = [r for r in status.regions if r.region == region][0]
        return [lease for g in current.generations for lease in g.readers]

    def mapped_at(self, address):
        """The fake's access of each mapping in the two-chunk range at ``address``."""
        return [a for va, (_, _, _, a) in sorted(fake._mappings.items())
                if address <= va < address + 2 * G]

    def test_a_sleep_and_wake_keep_the_device_address_and_the_bytes(self):
        region = f"py-gpu-sleep-{os.getpid()}"
        generation = self.publish(region)
        attached = self.client.attach(region)
        a, b = attached["a"], attached["b"]
        address = attached.gpu.address
        self.assertEqual((a.address, b.address), (address, address + G))
        capsule = b.__dlpack__(max_version=(1, 0))  # a consumer's pointer, kept over the sleep
        imported = len(fake._allocations)
        sleeping = self.client.sleep(attached)
        self.assertEqual((sleeping.gpu_address(), sleeping.addresses()),
                         (address, [address, address + G]))
        self.assertEqual(sleeping.layout,
                         vmm_memd.layout_hash_on([G, G], self.META, fake.UUID))
        # Unmapped, the imports released, the range still reserved; the lease ended.
        self.assertEqual(self.mapped_at(address), [])
        self.assertEqual(len(fake._allocations), imported - 2)
        self.assertEqual(fake._reservations.get(address), 2 * G)
        self.assertEqual(self.readers(region), [])
        # Nothing of it may be used while it sleeps; it cannot sleep twice.
        with self.assertRaises(vmm_memd.NotMapped):
            a.tobytes()
        with self.assertRaises(vmm_memd.NotMapped):
            self.client.sleep(attached)
        # Another reservation of this process hinted at the slept range does not get it.
        self.assertNotEqual(reserve_at(address, 2 * G), address)
        woken = self.client.wake(sleeping)
        self.assertEqual((woken.generation, woken.gpu.address, woken["b"].address),
                         (generation, address, address + G))
        self.assertIs(woken.gpu, attached.gpu)
        self.assertEqual(self.mapped_at(address), ["read", "read"])
        # The tensors made before the sleep read the woken memory, at the same addresses.
        self.assertEqual(a.tobytes(), pattern(generation, 0, G))
        self.assertEqual(b.tobytes(), pattern(generation, 1, 256))
        self.assertEqual(len(self.readers(region)), 1)
        with self.assertRaises(vmm_memd.NotAsleep):
            self.client.wake(sleeping)
        self.assertEqual(self.client.verify(region).generation, generation)
        self.client.detach(woken)
        del attached, woken, sleeping, a, b, capsule
        self.assertEqual(state(), self.before)

    def test_a_republished_layout_wakes_onto_the_new_generation_at_the_same_address(self):
        region = f"py-gpu-republish-{os.getpid()}"
        first = self.publish(region)
        attached = self.client.attach(region)
        a = attached["a"]
        sleeping = self.client.sleep(attached)
        second = self.publish(region)
        self.assertEqual(second, first + 1)
        woken = self.client.wake(sleeping)
        self.assertEqual((woken.generation, woken.gpu.address), (second, a.address))
        self.assertEqual(a.tobytes(), pattern(second, 0, G))
        self.assertEqual(woken["b"].tobytes(), pattern(second, 1, 256))
        self.client.detach(woken)

    def test_a_changed_layout_is_stale_and_the_range_stays_reserved(self):
        region = f"py-gpu-stale-{os.getpid()}"
        self.publish(region)
        sleeping = self.client.sleep(self.client.attach(region))
        address = sleeping.gpu_address()
        self.publish(region, second=2 * G)  # another layout: a larger second chunk
        with self.assertRaises(vmm_memd.StaleLayout) as caught:
            self.client.wake(sleeping)
        self.assertEqual((caught.exception.slept, caught.exception.now),
                         (sleeping.layout, vmm_memd.layout_hash_on([G, 2 * G], self.META,
                                                                   fake.UUID)))
        moved = dict(self.META, b=TensorMeta(1, 256, 256, Dtype.U8, (256,)))
        self.publish(region, meta=moved)  # the same chunks, a tensor moved: stale too
        with self.assertRaises(vmm_memd.StaleLayout):
            self.client.wake(sleeping)
        # Nothing mapped, the leases given back, the range still this sleeper's.
        self.assertEqual(self.mapped_at(address), [])
        self.assertEqual(fake._reservations.get(address), 2 * G)
        self.assertNotEqual(reserve_at(address, 2 * G), address)
        self.assertEqual(self.readers(region), [])
        # The slept layout again: the wake maps it where it slept.
        generation = self.publish(region)
        woken = self.client.wake(sleeping)
        self.assertEqual((woken.generation, woken.gpu.address), (generation, address))
        self.assertEqual(woken["a"].tobytes()[:512], pattern(generation, 0, 512))
        self.client.detach(woken)

    def test_a_discard_sleep_wakes_to_zeros_at_the_same_address(self):
        region = f"py-gpu-discard-{os.getpid()}"
        generation = self.publish(region)
        attached = self.client.attach(region)
        a = attached["a"]
        sleeping = self.client.sleep(attached, discard=True)
        self.assertEqual(self.readers(region), [])
        woken = self.client.wake(sleeping)
        self.assertEqual((woken.generation, woken.gpu.address), (generation, a.address))
        self.assertEqual(a.tobytes(), bytes(G), "the discarded generation, made again zeroed")
        self.assertEqual(woken["b"].tobytes(), bytes(256))
        # A sleeper closed gives its range back: a hint gets it now, and it cannot wake.
        again = self.client.sleep(woken)
        again.close()
        self.assertNotIn(a.address, fake._reservations)
        self.assertEqual(reserve_at(a.address, 2 * G), a.address)
        with self.assertRaises(vmm_memd.NotAsleep):
            self.client.wake(again)
        with self.assertRaises(vmm_memd.NotMapped):
            a.tobytes()
        del attached, woken, sleeping, again, a
        self.assertEqual(state(), self.before)


if __name__ == "__main__":
    unittest.main()
