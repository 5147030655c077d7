"""``python -m vmm_memd`` and ``vmm_memd.service``: the service's command line with defaults for
one user, the socket the client uses by default (the same), the typed error when no
``vmm-memd`` is installed; and a service started by ``python -m vmm_memd`` serving a client
that names no socket, stopped by SIGTERM with status 0.

The last needs a runnable ``vmm-memd`` in ``$VMM_MEMD_BIN`` (vmm-memd/tests/python_client.rs
gives its test executable, which plays ``vmm-memd``); it skips without one. The installed
programs are tested by ``test_memd_install.py`` (a real ``pip install``)."""

import os
import signal
import stat
import subprocess
import sys
import tempfile
import unittest
import uuid
from unittest import mock

import vmm_memd
from vmm_memd import service


class Defaults(unittest.TestCase):
    def test_the_client_and_the_service_default_to_the_same_socket(self):
        for env, expected in (({}, "@vmm-memd"), ({"VMM_MEMD_SOCKET": "@elsewhere"}, "@elsewhere"),
                              ({"VMM_MEMD_SOCKET": ""}, "@vmm-memd")):
            with mock.patch.dict(os.environ, env, clear=False):
                if "VMM_MEMD_SOCKET" not in env:
                    os.environ.pop("VMM_MEMD_SOCKET", None)
                self.assertEqual(service.default_socket(), expected)
                argv = service.command([], executable="/bin/vmm-memd")
                self.assertEqual(argv[argv.index("--socket") + 1], expected)
                named = []

                def connect(name, **kw):
                    named.append(name)
                    raise ConnectionRefusedError(111, "nobody")
                with mock.patch("vmm_ipc_peer.connect", connect):
                    with self.assertRaises(vmm_memd.ServiceGone):
                        vmm_memd.Client.connect()
                self.assertEqual(named, [expected])

    def test_the_command_adds_only_what_the_arguments_leave_out(self):
        with mock.patch.dict(os.environ, {"VMM_MEMD_SOCKET": "@s"}):
            argv = service.command(["--lease-ttl-ms", "5"], executable="/x/vmm-memd")
            self.assertEqual(argv, ["/x/vmm-memd", "--socket", "@s", "--quota-bytes",
                                    str(service.default_quota_bytes()), "--lease-ttl-ms", "5"])
            mine = ["--quota-bytes", "4096", "--socket", "/run/me/memd"]
            self.assertEqual(service.command(mine, executable="/x/vmm-memd"),
                             ["/x/vmm-memd"] + mine)
            keeper = ["--keeper", "@s"]
            self.assertEqual(service.command(keeper, executable="/x/vmm-memd"),
                             ["/x/vmm-memd"] + keeper)
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        self.assertEqual(service.default_quota_bytes(), total)

    def test_the_interpreters_scripts_directory_comes_first(self):
        import sysconfig
        self.assertEqual(service.scripts_dirs()[0], sysconfig.get_path("scripts"))


class Finding(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.addCleanup(self.dir.cleanup)
        patcher = mock.patch.dict(os.environ)
        patcher.start()
        self.addCleanup(patcher.stop)
        os.environ.pop("VMM_MEMD_BIN", None)

    def test_the_program_is_found_in_the_first_directory_that_has_it(self):
        empty = os.path.join(self.dir.name, "empty")
        full = os.path.join(self.dir.name, "bin")
        os.mkdir(empty)
        os.mkdir(full)
        program = os.path.join(full, "vmm-memd")
        with open(program, "w") as f:
            f.write("#!/bin/sh\n")
        # Not executable: not found.
        with self.assertRaises(vmm_memd.ExecutableNotFound):
            service.find_executable(dirs=[empty, full])
        os.chmod(program, stat.S_IRWXU)
        self.assertEqual(service.find_executable(dirs=[empty, full]), program)

    def test_a_missing_program_is_typed_and_says_where_it_looked(self):
        with self.assertRaises(vmm_memd.ExecutableNotFound) as raised:
            service.find_executable("vmm-memctl", dirs=[self.dir.name])
        e = raised.exception
        self.assertIsInstance(e, vmm_memd.MemdError)
        self.assertIsInstance(e, FileNotFoundError)
        self.assertEqual((e.name, e.searched), ("vmm-memctl", (self.dir.name,)))
        self.assertIn(self.dir.name, str(e))
        self.assertIn("pip install", str(e))
        os.environ["VMM_MEMD_BIN"] = os.path.join(self.dir.name, "nothing")
        with self.assertRaises(vmm_memd.ExecutableNotFound) as raised:
            service.find_executable()
        self.assertIn("VMM_MEMD_BIN=", raised.exception.why)

    def test_python_m_vmm_memd_without_the_program_exits_127_and_says_why(self):
        env = dict(os.environ, VMM_MEMD_BIN=os.path.join(self.dir.name, "nothing"))
        done = subprocess.run([sys.executable, "-m", "vmm_memd"], env=env, capture_output=True,
                              text=True, timeout=60)
        self.assertEqual(done.returncode, 127, done.stderr)
        self.assertIn("python -m vmm_memd: no vmm-memd executable", done.stderr)
        self.assertNotIn("Traceback", done.stderr)


class Serving(unittest.TestCase):
    def test_python_m_vmm_memd_serves_a_client_that_names_no_socket(self):
        program = os.environ.get("VMM_MEMD_BIN")
        if not program or not os.access(program, os.X_OK):
            self.skipTest("no runnable vmm-memd in $VMM_MEMD_BIN")
        socket = f"@vmm-memd-python-m-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        env = dict(os.environ, VMM_MEMD_SOCKET=socket)
        with tempfile.TemporaryFile("w+") as log:
            child = subprocess.Popen([sys.executable, "-m", "vmm_memd", "--retain", "1"],
                                     env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
            try:
                with mock.patch.dict(os.environ, {"VMM_MEMD_SOCKET": socket}):
                    client = vmm_memd.Client.reconnect(within=30)
                with client:
                    self.assertEqual(client.name, socket)
                    data = bytes(range(256)) * 4
                    generation = vmm_memd.publish(client, "python-m", {"b": data})
                    attached = client.attach("python-m")
                    self.assertEqual(attached.generation, generation)
                    self.assertEqual(attached["b"].tobytes(), data)
                    client.detach(attached)
            finally:
                # `python -m vmm_memd` exec'd the service: this is its pid, its status.
                child.send_signal(signal.SIGTERM)
                try:
                    status = child.wait(30)
                except subprocess.TimeoutExpired:
                    child.kill()
                    status = child.wait()
            log.seek(0)
            out = log.read()
        self.assertEqual(status, 0, out)
        self.assertIn(f"python -m vmm_memd: {program} --socket {socket} --quota-bytes "
                      f"{service.default_quota_bytes()} --retain 1", out)
        self.assertIn(f"vmm-memd: serving on {socket}", out)
        self.assertIn("vmm-memd: stopped", out)


if __name__ == "__main__":
    unittest.main()
