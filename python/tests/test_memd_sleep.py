"""Sleep and wake from Python against a real vmm-memd (``VMM_MEMD_SOCKET``; run by
``vmm-memd/tests/python_client.rs``): the memory is given up while the addresses stay reserved,
a wake maps the next generation of the same layout at the same addresses (an array made before
the sleep reads the new bytes), another layout is StaleLayout with the region still asleep, a
discard sleep wakes to zeroed memory, and a closed sleeper's addresses are given back."""

import unittest

import vmm_memd
from vmm_memd.protocol import Dtype, TensorMeta

from test_memd_client import SOCKET, fresh, mapped as mapping_of


class LayoutHash(unittest.TestCase):
    def test_the_layout_hash_is_vmm_memds(self):
        # The same value is checked against vmm-memd's layout_hash in python_client.rs.
        meta = {"b": TensorMeta(1, 16, 8, Dtype.F32, (2,)),
                "a": TensorMeta(0, 0, 4096, Dtype.U8, (4096,))}
        self.assertEqual(vmm_memd.layout_hash([4096, 8192], meta), 16243066540437555579)
        moved = dict(meta, b=TensorMeta(1, 24, 8, Dtype.F32, (2,)))
        self.assertNotEqual(vmm_memd.layout_hash([4096, 8192], moved), 16243066540437555579)
        # A GPU region's hashes its device's UUID on after it (vmm-memd's layout_hash_on).
        self.assertEqual(vmm_memd.layout_hash_on([4096, 8192], meta, bytes(range(16))),
                         6180394435458095547)
        self.assertEqual(vmm_memd.layout_hash_on([4096, 8192], meta), 16243066540437555579)


@unittest.skipUnless(SOCKET, "VMM_MEMD_SOCKET names no running vmm-memd")
class SleepAndWake(unittest.TestCase):
    def setUp(self):
        self.client = vmm_memd.Client.connect(SOCKET)

    def tearDown(self):
        self.client.close()

    def publish(self, region, fill, size=8192):
        return vmm_memd.publish(self.client, region, {"w": bytes([fill]) * size})

    def test_wake_maps_the_next_generation_at_the_same_addresses(self):
        region = fresh("sleep")
        self.publish(region, 1)
        attached = self.client.attach(region)
        tensor = attached["w"]
        view = tensor.memoryview()  # made before the sleep: it must see the wake's bytes
        address = tensor.address
        self.assertEqual(view[0], 1)
        sleeping = self.client.sleep(attached)
        self.assertEqual(sleeping.addresses(), [c.address for c in attached.chunks])
        # The memory is gone, the addresses are reserved (PROT_NONE, anonymous).
        line = mapping_of(address)
        self.assertIsNotNone(line)
        self.assertTrue(line.split()[1].startswith("---"), line)
        self.assertNotIn("memfd", line)
        # The lease ended with the sleep.
        status = self.client.status()
        generation = [r for r in status.regions if r.region == region][0].generations[0]
        self.assertEqual(list(generation.readers), [])
        self.assertEqual(self.publish(region, 2), 2)
        woken = self.client.wake(sleeping)
        self.assertEqual(woken.generation, 2)
        self.assertEqual(woken["w"].address, address)
        self.assertEqual(view[0], 2, "an old view reads the new generation")
        self.assertEqual(bytes(view), bytes([2]) * 8192)
        self.assertTrue(mapping_of(address).split()[1].startswith("r--"))

    def test_another_layout_is_stale_and_the_region_stays_asleep(self):
        region = fresh("stale")
        self.publish(region, 1)
        sleeping = self.client.sleep(self.client.attach(region))
        address = sleeping.addresses()[0]
        self.publish(region, 3, size=4096)  # another layout
        with self.assertRaises(vmm_memd.StaleLayout) as caught:
            self.client.wake(sleeping)
        self.assertEqual(caught.exception.slept, sleeping.layout)
        self.assertTrue(mapping_of(address).split()[1].startswith("---"))
        status = self.client.status()
        current = [r for r in status.regions if r.region == region][0]
        self.assertTrue(all(list(g.readers) == [] for g in current.generations),
                        "the refused wake gave its lease back")
        # The same layout again: the wake maps it where it slept.
        self.publish(region, 4)
        self.assertEqual(self.client.wake(sleeping)["w"].address, address)

    def test_a_discard_sleep_wakes_to_zeroed_memory(self):
        region = fresh("discard")
        self.publish(region, 9)
        sleeping = self.client.sleep(self.client.attach(region), discard=True)
        woken = self.client.wake(sleeping)
        self.assertEqual(woken.generation, 1, "the same generation, made again")
        self.assertEqual(woken["w"].tobytes(), bytes(8192))

    def test_a_closed_sleeper_gives_its_addresses_back_and_cannot_wake(self):
        region = fresh("closed")
        self.publish(region, 5)
        sleeping = self.client.sleep(self.client.attach(region))
        address = sleeping.addresses()[0]
        sleeping.close()
        self.assertIsNone(mapping_of(address))
        with self.assertRaises(vmm_memd.NotAsleep):
            self.client.wake(sleeping)
        # A sleeper woken is not one to wake again (nor does its close unmap the woken).
        sleeping = self.client.sleep(self.client.attach(region))
        woken = self.client.wake(sleeping)
        sleeping.close()
        with self.assertRaises(vmm_memd.NotAsleep):
            self.client.wake(sleeping)
        self.assertEqual(woken["w"].tobytes(), bytes([5]) * 8192)


if __name__ == "__main__":
    unittest.main()
