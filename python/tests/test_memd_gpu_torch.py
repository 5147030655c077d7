"""A GPU region published from Rust, attached from Python on the real driver and handed to
torch by DLPack: the CUDA tensor's data pointer is our mapping, its bytes are what Rust
wrote, our mapping is read-only for the device, and the tensor outlives the lease. And torch
tensors published from Python (``publish_gpu``: device to device copies, bfloat16 by the
tuple form) come back equal. A torch tensor over a region kept through a sleep reads the
woken generation at the same device address.

Run by vmm-memd's python_client test on a GPU machine (it publishes the region and sets
VMM_MEMD_SOCKET and VMM_MEMD_GPU_REGION=name:generation); skipped anywhere else."""

import os
import unittest

try:
    import torch
    from cuda.bindings import driver as cu
except ImportError:  # the Rust test checks both are there before it runs this module
    torch = cu = None

import vmm_memd


def pattern(generation, chunk, length):
    """What the Rust writer put in chunk ``chunk`` (vmm-memd/tests/common/gpu.rs)."""
    return bytes(((i * 31) ^ (generation * 7 + chunk * 13)) & 0xFF for i in range(length))


@unittest.skipUnless(torch is not None and "VMM_MEMD_GPU_REGION" in os.environ,
                     "needs torch, cuda.bindings and a GPU region (run by python_client.rs)")
class TorchOnTheGpu(unittest.TestCase):
    def test_torch_gets_the_mapping_zero_copy_with_what_rust_published(self):
        region, generation = os.environ["VMM_MEMD_GPU_REGION"].rsplit(":", 1)
        generation = int(generation)
        client = vmm_memd.Client.connect(os.environ["VMM_MEMD_SOCKET"])
        attached = client.attach(region)
        self.assertEqual(attached.generation, generation)
        tensors = []
        for i in range(len(attached.chunks)):
            t = attached[f"t{i}"]
            x = torch.from_dlpack(t)
            self.assertEqual(x.device.type, "cuda")
            self.assertEqual(x.device.index, t.__dlpack_device__()[1])
            self.assertEqual(x.data_ptr(), t.address, "zero-copy: the tensor is the mapping")
            expected = pattern(generation, i, t.nbytes)
            self.assertEqual(bytes(x.cpu().numpy()), expected)
            self.assertEqual(t.tobytes(), expected)
            # A kernel reads it.
            self.assertEqual(int(x.to(torch.int64).sum()), sum(expected))
            tensors.append((x, expected))
        # Our mapping is read-only for the device.
        location = cu.CUmemLocation()
        location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        location.id = attached["t0"].__dlpack_device__()[1]
        err, flags = cu.cuMemGetAccess(location, attached["t0"].address)
        self.assertEqual(err, cu.CUresult.CUDA_SUCCESS)
        self.assertEqual(int(flags), int(cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ))
        # The lease ends, the tensors stay valid (they keep the mapping).
        attached.detach()
        del attached
        for x, expected in tensors:
            torch.cuda.synchronize()
            self.assertEqual(bytes(x.cpu().numpy()), expected)
        # Nothing was written: the digests taken at commit still match.
        client.verify(region)
        client.close()

    def test_torch_tensors_published_from_python_come_back_equal(self):
        region = os.environ["VMM_MEMD_GPU_REGION"].rsplit(":", 1)[0] + "-from-python"
        client = vmm_memd.Client.connect(os.environ["VMM_MEMD_SOCKET"])
        weights = torch.arange(4096, dtype=torch.float32, device="cuda").reshape(64, 64)
        half = (torch.linspace(-1, 1, 1000, device="cuda")).to(torch.bfloat16)
        torch.cuda.synchronize()
        generation = vmm_memd.publish_gpu(client, region, {
            "weights": weights,
            "half": (half, vmm_memd.Dtype.BF16, half.shape),
            "host": bytes(range(256)),
        })
        attached = client.attach(region)
        self.assertEqual(attached.generation, generation)
        self.assertTrue(torch.equal(torch.from_dlpack(attached["weights"]), weights))
        got = attached["half"]
        self.assertEqual(got.dtype, vmm_memd.Dtype.BF16)
        self.assertEqual(got.tobytes(), bytes(half.view(torch.uint8).cpu().numpy()))
        self.assertEqual(attached["host"].tobytes(), bytes(range(256)))
        client.verify(region)
        client.close()

    def test_a_torch_tensor_over_a_slept_region_reads_the_woken_generation(self):
        region = os.environ["VMM_MEMD_GPU_REGION"].rsplit(":", 1)[0] + "-sleep"
        client = vmm_memd.Client.connect(os.environ["VMM_MEMD_SOCKET"])
        weights = torch.arange(1 << 20, dtype=torch.float32, device="cuda")  # 4 MiB
        torch.cuda.synchronize()
        first = vmm_memd.publish_gpu(client, region, {"w": weights})
        attached = client.attach(region)
        x = torch.from_dlpack(attached["w"])  # a torch tensor kept over the sleep
        address, size = attached.gpu.address, sum(attached.gpu.sizes)
        self.assertEqual(x.data_ptr(), address)
        sleeping = client.sleep(attached)
        self.assertEqual(sleeping.gpu_address(), address)
        # The range stays reserved: a reservation hinted at it is placed elsewhere.
        err, squatter = cu.cuMemAddressReserve(size, 0, address, 0)
        self.assertEqual(err, cu.CUresult.CUDA_SUCCESS)
        self.assertNotEqual(int(squatter), address)
        self.assertEqual(cu.cuMemAddressFree(squatter, size)[0], cu.CUresult.CUDA_SUCCESS)
        # The same layout republished: the wake maps the new generation at the same address,
        # and the tensor made before the sleep reads it.
        second = vmm_memd.publish_gpu(client, region, {"w": weights * 2})
        self.assertEqual(second, first + 1)
        woken = client.wake(sleeping)
        self.assertEqual((woken.generation, woken.gpu.address), (second, address))
        self.assertTrue(torch.equal(x, weights * 2))
        # A discard sleep: the wake gets the generation again, zeroed, at the same address.
        woken = client.wake(client.sleep(woken, discard=True))
        self.assertEqual((woken.generation, woken.gpu.address), (second, address))
        self.assertEqual(int(torch.count_nonzero(x)), 0)
        client.detach(woken)
        client.close()


if __name__ == "__main__":
    unittest.main()
