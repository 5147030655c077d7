"""The service SIGKILLed and restarted under a Python reader (driven by the Rust test
``vmm-memd/tests/python_client.rs``, through files in ``VMM_MEMD_RESTART_DIR``): the reader's
next call is ServiceGone, its numpy array stays valid and unchanged, and it reconnects and
attaches the same generation with the same contents (the keeper kept them)."""

import os
import time
import unittest

import vmm_memd

try:
    import numpy
except ImportError:
    numpy = None

SOCKET = os.environ.get("VMM_MEMD_SOCKET")
CONTROL = os.environ.get("VMM_MEMD_RESTART_DIR")


def wait_for(path, within=60.0):
    deadline = time.monotonic() + within
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {within} s")
        time.sleep(0.01)


@unittest.skipUnless(SOCKET and CONTROL and numpy is not None,
                     "driven by the Rust test (VMM_MEMD_RESTART_DIR), with numpy")
class Restart(unittest.TestCase):
    def test_a_restart_is_service_gone_and_the_mapping_stays(self):
        region = f"py-restart-{os.getpid()}"
        values = numpy.arange(1 << 16, dtype=numpy.int32)
        with vmm_memd.Client.connect(SOCKET) as client:
            generation = vmm_memd.publish(client, region, {"v": values})
            array = numpy.from_dlpack(client.attach(region)["v"])
            with open(os.path.join(CONTROL, "ready"), "w"):
                pass
            wait_for(os.path.join(CONTROL, "restarted"))
            with self.assertRaises(vmm_memd.ServiceGone):
                client.renew()
        numpy.testing.assert_array_equal(array, values)  # the mapping outlived the service
        with vmm_memd.Client.reconnect(SOCKET, within=30.0) as client:
            again = client.attach(region)
            self.assertEqual(again.generation, generation)
            numpy.testing.assert_array_equal(numpy.from_dlpack(again["v"]), values)
            self.assertEqual(vmm_memd.publish(client, region, {"v": values[:4]}), generation + 1)


if __name__ == "__main__":
    unittest.main()
