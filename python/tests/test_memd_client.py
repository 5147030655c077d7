"""vmm_memd's client against a real vmm-memd (``VMM_MEMD_SOCKET`` names it; the Rust test
``vmm-memd/tests/python_client.rs`` starts one and runs these): publish and attach, zero-copy
DLPack into numpy, read-only by construction, the typed refusals, and the service's
``StillMapped`` on a writer that kept a view."""

import ctypes
import gc
import mmap
import os
import signal
import subprocess
import sys
import time
import unittest

import vmm_memd
from vmm_memd import dlpack
from vmm_memd.protocol import MAX_REQUEST, TensorMeta, Dtype

try:
    import numpy
except ImportError:  # the Rust test SKIPs without numpy; by hand, say why
    numpy = None

SOCKET = os.environ.get("VMM_MEMD_SOCKET")
QUOTA = int(os.environ.get("VMM_MEMD_QUOTA", str(1 << 30)))
_N = [0]


def fresh(tag):
    _N[0] += 1
    return f"py-{tag}-{os.getpid()}-{_N[0]}"


def mapped(address):
    """Whether ``address`` lies in a mapping of this process (/proc/self/maps)."""
    with open("/proc/self/maps") as f:
        for line in f:
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            if start <= address < end:
                return line
    return None


@unittest.skipUnless(SOCKET, "VMM_MEMD_SOCKET names no running vmm-memd")
class Service(unittest.TestCase):
    def setUp(self):
        self.client = vmm_memd.Client.connect(SOCKET)

    def tearDown(self):
        self.client.close()


@unittest.skipUnless(numpy is not None, "numpy is not installed")
class ZeroCopy(Service):
    def test_published_arrays_come_back_zero_copy_and_read_only(self):
        region = fresh("weights")
        arrays = {
            "embed": numpy.arange(24, dtype=numpy.float32).reshape(2, 3, 4),
            "bias": numpy.array([-1, 2, -3], dtype=numpy.int64),
            "mask": numpy.array([True, False, True]),
            "half": numpy.linspace(0, 1, 5, dtype=numpy.float16),
            "raw": b"\x01\x02\x03",
            "scalar": numpy.float64(2.5).reshape(()),
        }
        generation = vmm_memd.publish(self.client, region, arrays)
        self.assertEqual(generation, 1)
        attached = self.client.attach(region)
        self.assertEqual((attached.region, attached.generation), (region, 1))
        self.assertEqual(set(attached.meta), set(arrays))
        for key, value in arrays.items():
            tensor = attached[key]
            self.assertEqual(tensor.__dlpack_device__(), (1, 0))
            array = numpy.from_dlpack(tensor)
            expected = numpy.frombuffer(value, numpy.uint8) if key == "raw" else value
            numpy.testing.assert_array_equal(array, expected)
            self.assertEqual(array.dtype, expected.dtype)
            # Zero copy: the array's data pointer is the mapping's.
            chunk = attached.chunks[tensor.chunk_index]
            self.assertEqual(array.__array_interface__["data"][0], tensor.address)
            self.assertEqual(tensor.address, chunk.address + attached.meta[key].offset)
            self.assertEqual(tensor.address % vmm_memd.ALIGNMENT, 0)
            # Read-only: the flag, numpy's refusal to write or to lift it.
            self.assertFalse(array.flags.writeable)
            with self.assertRaises(ValueError):
                array[...] = 0
            with self.assertRaises(ValueError):
                array.setflags(write=True)
        self.assertEqual(bytes(attached["raw"].memoryview()), b"\x01\x02\x03")
        self.assertTrue(attached["raw"].memoryview().readonly)
        self.client.detach(attached)
        # A host region is sealed, so it has no digests to verify against.
        from vmm_memd.protocol import Verified
        self.assertEqual(self.client.verify(region), Verified(1, ()))

    def test_an_array_keeps_its_mapping_alive_and_lets_it_go(self):
        region = fresh("alive")
        vmm_memd.publish(self.client, region, {"x": numpy.full(10000, 7, numpy.uint32)})
        attached = self.client.attach(region)
        before = dlpack.live_exports()
        array = numpy.from_dlpack(attached["x"])
        address = attached["x"].address
        self.client.detach(attached)
        del attached
        gc.collect()
        self.assertIsNotNone(mapped(address), "the array keeps the chunk mapped")
        self.assertEqual(int(array.sum()), 70000)
        del array
        gc.collect()
        self.assertIsNone(mapped(address), "the last array gone, the chunk is unmapped")
        self.assertEqual(dlpack.live_exports(), before)

    def test_capsules_nobody_consumed_are_freed(self):
        region = fresh("capsule")
        vmm_memd.publish(self.client, region, {"x": numpy.ones(4, numpy.int8)})
        tensor = self.client.attach(region)["x"]
        before = dlpack.live_exports()
        legacy = tensor.__dlpack__()
        versioned = tensor.__dlpack__(max_version=(1, 0))
        self.assertIn("dltensor", repr(legacy))
        self.assertIn("dltensor_versioned", repr(versioned))
        self.assertEqual(dlpack.live_exports(), before + 2)
        del legacy, versioned
        gc.collect()
        self.assertEqual(dlpack.live_exports(), before)
        with self.assertRaises(BufferError):
            tensor.__dlpack__(copy=True)
        with self.assertRaises(BufferError):
            tensor.__dlpack__(dl_device=(2, 0))

    def test_bfloat16_and_other_dtypes_travel_as_buffer_dtype_shape(self):
        # The buffer protocol cannot name bfloat16: (buffer, Dtype, shape) can.
        region = fresh("bf16")
        raw = bytes(range(16))
        vmm_memd.publish(self.client, region, {"w": (raw, Dtype.BF16, (2, 4))})
        attached = self.client.attach(region)
        self.assertEqual(attached.meta["w"], TensorMeta(0, 0, 16, Dtype.BF16, (2, 4)))
        tensor = attached["w"]
        self.assertEqual(bytes(tensor.memoryview()), raw)
        self.assertIn("dltensor", repr(tensor.__dlpack__(max_version=(1, 0))))
        with self.assertRaises(ValueError):
            vmm_memd.publish(self.client, region, {"w": (raw, Dtype.F32, (2, 4))})
        self.assertEqual(self.client.attach(region).generation, 1, "nothing was begun")

    def test_a_legacy_consumer_gets_the_unversioned_capsule_zero_copy(self):
        # An older consumer calls __dlpack__(stream=None) only: the legacy capsule, over the
        # same mapping, freed by the consumer's deleter when its array goes.
        class Legacy:
            def __init__(self, tensor):
                self.tensor = tensor

            def __dlpack_device__(self):
                return self.tensor.__dlpack_device__()

            def __dlpack__(self, stream=None):
                return self.tensor.__dlpack__(stream=stream)

        region = fresh("legacy")
        vmm_memd.publish(self.client, region, {"x": numpy.arange(6, dtype=numpy.int16)})
        tensor = self.client.attach(region)["x"]
        before = dlpack.live_exports()
        array = numpy.from_dlpack(Legacy(tensor))
        self.assertEqual(array.__array_interface__["data"][0], tensor.address)
        numpy.testing.assert_array_equal(array, numpy.arange(6, dtype=numpy.int16))
        self.assertEqual(dlpack.live_exports(), before + 1)
        del array
        gc.collect()
        self.assertEqual(dlpack.live_exports(), before)

    def test_a_reader_cannot_write_through_the_mapping(self):
        region = fresh("ro")
        vmm_memd.publish(self.client, region, {"x": numpy.full(4096, 9, numpy.uint8)})
        attached = self.client.attach(region)
        tensor = attached["x"]
        chunk = attached.chunks[0]
        self.assertIn(" r--s ", mapped(chunk.address))
        # mprotect to writable: refused by the kernel (a shared mapping of a write-sealed
        # memfd may never become writable).
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        page = chunk.address & ~(mmap.PAGESIZE - 1)
        self.assertEqual(libc.mprotect(page, mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_WRITE),
                         -1)
        self.assertEqual(ctypes.get_errno(), 13)  # EACCES
        # Reopening the mapped memfd through /proc and writing: refused (EPERM).
        line = mapped(chunk.address)
        span = line.split()[0]
        try:
            fd = os.open(f"/proc/self/map_files/{span}", os.O_RDWR)
        except PermissionError:
            fd = None  # not root: map_files is closed to us, nothing to try
        if fd is not None:
            try:
                with self.assertRaises(PermissionError):
                    os.pwrite(fd, b"\x00", 0)
                with self.assertRaises(PermissionError):
                    mmap.mmap(fd, 4096, flags=mmap.MAP_SHARED,
                              prot=mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
        # A store to the address: the process faults (the pages are PROT_READ).
        code = ("import ctypes, sys, vmm_memd\n"
                f"c = vmm_memd.Client.connect({SOCKET!r})\n"
                f"t = c.attach({region!r})['x']\n"
                "print('attached', flush=True)\n"
                "ctypes.memset(t.address, 0, 1)\n"
                "print('wrote', flush=True)\n")
        env = dict(os.environ, PYTHONFAULTHANDLER="")
        env.pop("PYTHONFAULTHANDLER")
        child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                               env=env, timeout=60)
        self.assertIn("attached", child.stdout, child.stderr)
        self.assertNotIn("wrote", child.stdout)
        self.assertEqual(child.returncode, -signal.SIGSEGV, child.stderr)
        self.assertTrue((numpy.from_dlpack(tensor) == 9).all(), "the bytes did not change")
        self.client.detach(attached)


class Refusals(Service):
    def test_refusals_arrive_typed(self):
        with self.assertRaises(vmm_memd.NoSuchRegion) as caught:
            self.client.attach(fresh("none"))
        self.assertTrue(caught.exception.region.startswith("py-none-"))
        with self.assertRaises(vmm_memd.QuotaExceeded) as caught:
            self.client.begin(fresh("big"), [QUOTA + 1])
        q = caught.exception
        self.assertEqual((q.uid, q.asked, q.quota), (os.geteuid(), QUOTA + 1, QUOTA))
        with self.assertRaises(vmm_memd.InvalidRequest) as caught:
            self.client.begin("a b", [4096])
        self.assertEqual(caught.exception.rule, "RegionName")
        with self.assertRaises(vmm_memd.InvalidRequest) as caught:
            self.client.detach(123456789)
        self.assertEqual(caught.exception.rule, "NoSuchLease")
        too_large = self.client.request_raw(b"\x00" * (MAX_REQUEST + 1))
        self.assertEqual(too_large, vmm_memd.TooLarge(MAX_REQUEST + 1, MAX_REQUEST))
        with self.assertRaises(vmm_memd.InvalidRequest) as caught:
            self.client.request(b"\x63", object)
        self.assertEqual(caught.exception.rule, "Decode")

    def test_a_tokened_commit_is_known_and_its_token_is_not_taken_twice(self):
        region = fresh("token")
        token, other_token = vmm_memd.commit_token(), vmm_memd.commit_token()
        with self.client.begin(region, [4096], token=token) as w:
            generation = w.commit()
        self.assertEqual(self.client.commit_state(region, token),
                         vmm_memd.CommitState("Landed", generation))
        with self.assertRaises(vmm_memd.InvalidRequest) as caught:
            self.client.begin(region, [4096], token=token)
        self.assertEqual(caught.exception.rule, "Token")
        with self.client.begin(region, [4096]) as w:  # the refused one was aborted
            self.assertEqual(w.commit(), generation + 1)
        # A writer's connection open with its generation: Pending; gone before its commit:
        # Unknown, and nothing landed.
        other = vmm_memd.Client.connect(SOCKET)
        other.begin(region, [4096], token=other_token)
        self.assertEqual(self.client.commit_state(region, other_token).state, "Pending")
        other.close()
        deadline = time.monotonic() + 5
        while self.client.commit_state(region, other_token).state == "Pending" \
                and time.monotonic() < deadline:
            time.sleep(0.01)
        self.assertEqual(self.client.commit_state(region, other_token),
                         vmm_memd.CommitState("Unknown"))
        self.assertEqual([r.generation for r in self.client.list() if r.region == region],
                         [generation + 1])

    def test_a_second_writer_waits_then_is_refused_writer_busy(self):
        region = fresh("busy")
        with self.client.begin(region, [4096]):
            with vmm_memd.Client.connect(SOCKET) as other:
                with self.assertRaises(vmm_memd.WriterBusy) as caught:
                    other.begin(region, [4096], wait=0.05)
                self.assertEqual(caught.exception.region, region)
                self.assertGreaterEqual(caught.exception.waited_ms, 50)
        # The first writer's context aborted its generation: nothing committed.
        with self.assertRaises(vmm_memd.NoSuchRegion):
            self.client.attach(region)

    def test_a_kept_view_makes_the_commit_still_mapped_until_it_goes(self):
        region = fresh("kept")
        writer = self.client.begin(region, [8192])
        writer.chunk(0)[:4] = b"abcd"
        view = memoryview(writer.chunk(0))
        writer.put("x", TensorMeta(0, 0, 4, Dtype.U8, (4,)))
        with self.assertRaises(vmm_memd.StillMapped) as caught:
            writer.commit()
        self.assertEqual((caught.exception.region, caught.exception.generation), (region, 1))
        view.release()
        self.assertEqual(writer.commit(), 1)
        attached = self.client.attach(region)
        self.assertEqual(bytes(attached["x"].memoryview()), b"abcd")

    def test_a_gone_service_is_service_gone(self):
        with self.assertRaises(vmm_memd.ServiceGone):
            vmm_memd.Client.connect(f"@vmm-memd-nobody-{os.getpid()}")

    def test_list_status_metrics_and_renew(self):
        region = fresh("listed")
        vmm_memd.publish(self.client, region, {"x": b"\x00" * 100})
        listed = {r.region: r for r in self.client.list()}
        self.assertEqual(listed[region].generation, 1)
        attached = self.client.attach(region)
        status = self.client.status()
        self.assertEqual(status.uid, os.geteuid())
        mine = [r for r in status.regions if r.region == region][0]
        self.assertEqual(mine.generations[0].readers, (os.getpid(),))
        self.assertIn(f'vmm_memd_region_generation{{region="{region}"}} 1',
                      self.client.metrics())
        self.assertEqual(self.client.renew(), 1)
        attached.detach()
        self.assertEqual(self.client.renew(), 0)
        self.client.delete(region)
        with self.assertRaises(vmm_memd.NoSuchRegion):
            self.client.attach(region)


try:
    import torch
except ImportError:
    torch = None


@unittest.skipUnless(torch is not None and numpy is not None, "torch is not installed")
class Torch(Service):
    def test_torch_from_dlpack_is_zero_copy_over_the_mapping(self):
        region = fresh("torch")
        values = numpy.arange(12, dtype=numpy.float32).reshape(3, 4)
        vmm_memd.publish(self.client, region, {"x": values})
        tensor = self.client.attach(region)["x"]
        t = torch.from_dlpack(tensor)
        self.assertEqual(t.data_ptr(), tensor.address)
        self.assertEqual(t.device.type, "cpu")
        self.assertEqual(t.tolist(), values.tolist())


NOBODY = 65534


@unittest.skipUnless(os.geteuid() == 0, "needs root to run a process as uid 65534")
class OtherUid(Service):
    """Another uid (65534, which the service admits) reads what the region's ACL gives it and
    meets AccessDenied and NoSuchRegion, typed, for the rest."""

    def run_as_nobody(self, python, code):
        source = os.path.dirname(os.path.dirname(os.path.abspath(vmm_memd.__file__)))
        env = dict(os.environ, PYTHONPATH=source, PYTHONDONTWRITEBYTECODE="1")
        return subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60,
                              user=NOBODY, group=NOBODY, extra_groups=[], cwd="/", env=env)

    def as_nobody(self, code):
        # An interpreter uid 65534 may run (a pyenv one under /root is closed to it).
        for python in (sys.executable, "/usr/bin/python3"):
            try:
                if self.run_as_nobody(python, "import vmm_memd").returncode == 0:
                    break
            except OSError:
                pass
        else:
            self.skipTest("no python3 that uid 65534 can run with these sources")
        prelude = ("import vmm_memd\n"
                   f"c = vmm_memd.Client.connect({SOCKET!r}, expect_uids=[{os.geteuid()}])\n")
        child = self.run_as_nobody(python, prelude + code)
        self.assertEqual(child.returncode, 0, child.stderr)
        return child.stdout.split()

    def test_acls_give_reads_and_refuse_writes_typed(self):
        shared, private = fresh("shared"), fresh("private")
        acl = vmm_memd.Acl(read=(vmm_memd.Uid(NOBODY),))
        vmm_memd.publish(self.client, shared, {"x": b"shared"}, acl=acl)
        vmm_memd.publish(self.client, private, {"x": b"private"})
        out = self.as_nobody(
            f"print(bytes(c.attach({shared!r})['x'].memoryview()).decode())\n"
            f"print(sorted(r.region for r in c.list()))\n"
            "for call in (lambda: c.attach(%r), lambda: c.begin(%r, [4096]),\n"
            "             lambda: c.delete(%r)):\n"
            "    try:\n"
            "        call()\n"
            "    except vmm_memd.Refused as e:\n"
            "        print(type(e).__name__, getattr(e, 'right', '-'))\n"
            % (private, shared, shared))
        self.assertEqual(out[0], "shared")
        self.assertIn(shared, out[1])
        self.assertNotIn(private, out[1])
        self.assertEqual(out[2:], ["NoSuchRegion", "-", "AccessDenied", "write",
                                   "AccessDenied", "delete"])


@unittest.skipUnless(SOCKET and os.environ.get("VMM_MEMD_RUST_REGION"),
                     "no region published by Rust named")
class FromRust(Service):
    def test_a_region_rust_published_reads_here(self):
        # The Rust test published it: tensor "t0" of U8, every byte its fill byte.
        region, size, fill = os.environ["VMM_MEMD_RUST_REGION"].split(":")
        attached = self.client.attach(region)
        view = attached["t0"].memoryview()
        self.assertEqual(len(view), int(size))
        self.assertEqual(bytes(view), bytes([int(fill)]) * int(size))
        self.client.detach(attached)

    def test_publish_for_rust(self):
        # Rust attaches this after the Python tests and checks it.
        region = os.environ["VMM_MEMD_RUST_REGION"].split(":")[0] + "-from-python"
        vmm_memd.publish(self.client, region, {"pattern": bytes(range(256)) * 16})


if __name__ == "__main__":
    unittest.main()
