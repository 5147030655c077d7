"""The Python client keeps its leases alive (a renewal thread at a third of the TTL) against the
real service: two services of short TTLs, named by VMM_MEMD_SOCKET_TTL_400 and
VMM_MEMD_SOCKET_TTL_30 (vmm-memd's python_client test starts them)."""

import os
import time
import unittest

import numpy

import vmm_memd

SLOW = os.environ.get("VMM_MEMD_SOCKET_TTL_400")
FAST = os.environ.get("VMM_MEMD_SOCKET_TTL_30")


def readers_of(client, region, generation):
    for r in client.status().regions:
        if r.region == region:
            for g in r.generations:
                if g.generation == generation:
                    return list(g.readers)
    return []


def until(seconds, check):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.01)
    return check()


def weights(chunks=1):
    return {f"t{i}": numpy.full(1024, i, dtype=numpy.float32) for i in range(chunks)}


@unittest.skipUnless(SLOW and FAST, "needs the two short-TTL services of the Rust harness")
class KeepAlive(unittest.TestCase):
    def setUp(self):
        self.region = f"keep-{os.getpid()}-{self.id().rsplit('.', 1)[-1][:30]}"

    def test_a_client_keeps_its_lease_past_the_ttl_until_told_not_to(self):
        with vmm_memd.Client.connect(SLOW) as writer, vmm_memd.Client.connect(SLOW) as reader:
            first = vmm_memd.publish(writer, self.region, weights())
            attached = reader.attach(self.region)
            self.assertAlmostEqual(attached.ttl, 0.4)
            vmm_memd.publish(writer, self.region, weights())  # only our lease keeps the first
            time.sleep(2.0)
            self.assertEqual(readers_of(writer, self.region, first), [os.getpid()],
                             "kept for 5 TTLs by the client's renewals")
            expired = writer.status().expired_leases
            reader.set_keep_alive(False)
            self.assertTrue(until(3.0, lambda: not readers_of(writer, self.region, first)),
                            "with renewal off the lease ends by TTL")
            self.assertEqual(writer.status().expired_leases, expired + 1)
            self.assertEqual(attached.tensor("t0").tobytes(), weights()["t0"].tobytes(),
                             "the mapping stays")

    def test_renewals_never_come_between_a_call_and_its_reply(self):
        # Renewals every 10 ms while the client attaches (a reply, metadata, 4 descriptors),
        # lists and detaches: one inside an exchange would put the connection out of step.
        with vmm_memd.Client.connect(FAST) as writer, vmm_memd.Client.connect(FAST) as reader:
            vmm_memd.publish(writer, self.region, weights())
            with writer.begin(self.region, [4096] * 4) as w:
                for i in range(4):
                    w.put(f"t{i}", vmm_memd.TensorMeta(i, 0, 4096, vmm_memd.Dtype.U8, (4096,)))
                w.commit()
            held = reader.attach(self.region)
            deadline, attaches = time.monotonic() + 2.0, 0
            while time.monotonic() < deadline:
                attached = reader.attach(self.region)
                self.assertEqual(len(attached.chunks), 4)
                try:
                    reader.detach(attached)
                except vmm_memd.InvalidRequest as e:
                    # A 30 ms lease may run out on a loaded machine before it is detached:
                    # the refusal is then this request's own reply, still in step.
                    self.assertEqual(e.rule, "NoSuchLease")
                self.assertIn(self.region, [r.region for r in reader.list()])
                attaches += 1
            self.assertGreater(attaches, 10)
            self.assertEqual(len(reader.attach(self.region).chunks), 4)
            self.assertIsInstance(reader.renew(), int)
            del held

    def test_a_renewal_waits_for_the_call_that_holds_the_connection(self):
        # A call in progress for three TTLs (as a long commit's reply would be): the thread
        # must not use the connection meanwhile, so the lease runs out.
        with vmm_memd.Client.connect(SLOW) as writer, vmm_memd.Client.connect(SLOW) as reader:
            first = vmm_memd.publish(writer, self.region, weights())
            reader.attach(self.region)
            vmm_memd.publish(writer, self.region, weights())
            expired = writer.status().expired_leases
            with reader._turns.call():
                self.assertTrue(until(3.0, lambda: not readers_of(writer, self.region, first)),
                                "no renewal while a call holds the connection")
            self.assertEqual(writer.status().expired_leases, expired + 1)
            self.assertEqual(reader.renew(), 0, "the connection is in step; the lease gone")

    def test_closing_a_client_ends_its_renewal_thread(self):
        with vmm_memd.Client.connect(SLOW) as writer:
            vmm_memd.publish(writer, self.region, weights())
            reader = vmm_memd.Client.connect(SLOW)
            reader.attach(self.region)
            thread = reader._renewer.thread
            self.assertTrue(thread.is_alive())
            reader.close()
            self.assertFalse(thread.is_alive())


if __name__ == "__main__":
    unittest.main()
