"""``pip install`` of this directory into a fresh venv, as a Python user does it: pip fetches
maturin for an isolated build, maturin compiles the workspace's ``vmm-memd`` crate and puts its
programs (``vmm-memd``, ``vmm-memctl``) into the wheel beside the pure-Python packages. Then
the venv alone serves and uses memory: ``python -m vmm_memd`` (the venv's interpreter, the venv
not on ``PATH``) starts the service, a program run by the venv's interpreter publishes and
attaches a host region on the default socket, ``vmm-memctl`` lists it, and SIGTERM stops the
service with status 0.

Needs the checkout (pyproject.toml here, the workspace one level up): ``$VMM_PYTHON_SOURCE``,
else the directory above this file's. ``CARGO_TARGET_DIR`` passes through to cargo (the Rust
driver, vmm-memd/tests/python_client.rs, sets it to the workspace's target directory, so the
release build reuses what earlier builds left there). One wheel build: minutes on 2 cores."""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest
import uuid

SOURCE = os.environ.get("VMM_PYTHON_SOURCE") or os.path.dirname(
    os.path.dirname(os.path.abspath(__file__)))

# How long `pip install` (venv, maturin from the index, the release build) may take.
BUILD_TIMEOUT = 1200


def run(args, timeout=300, **kw):
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, **kw)


def run_group(args, timeout, **kw):
    """``run``, in a process group of its own, all of which is killed past ``timeout`` (pip's
    build runs maturin, which runs cargo and rustc: none may outlive the test)."""
    child = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True, **kw)
    try:
        out, err = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        out, err = child.communicate()
        err += f"\nkilled after {timeout} s"
    return subprocess.CompletedProcess(args, child.returncode, out, err)


def clean_env():
    """This process's environment without what would leak this interpreter's setup into the
    venv's (PYTHON*, PIP_*, VIRTUAL_ENV) or a cargo test's own variables into cargo's."""
    cargo_own = ("CARGO_MANIFEST_", "CARGO_PKG_", "CARGO_CRATE_NAME", "CARGO_BIN_EXE_",
                 "CARGO_PRIMARY_PACKAGE", "CARGO_TARGET_TMPDIR")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTHON", "PIP_", "VIRTUAL_ENV") + cargo_own)}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


class PipInstall(unittest.TestCase):
    """One venv and one install for every test (the build takes minutes)."""

    @classmethod
    def setUpClass(cls):
        if not (os.path.exists(os.path.join(SOURCE, "pyproject.toml"))
                and os.path.exists(os.path.join(SOURCE, "..", "vmm-memd", "Cargo.toml"))):
            raise unittest.SkipTest(f"no checkout at {SOURCE} (pyproject.toml, and "
                                    f"../vmm-memd/Cargo.toml): set VMM_PYTHON_SOURCE")
        cls.work = tempfile.mkdtemp(prefix="vmm-memd-venv-")
        cls.venv = os.path.join(cls.work, "venv")
        cls.bin = os.path.join(cls.venv, "bin")
        cls.python = os.path.join(cls.bin, "python")
        cls.env = clean_env()
        made = run([sys.executable, "-m", "venv", cls.venv])
        if made.returncode != 0 or run([cls.python, "-m", "pip", "--version"]).returncode:
            shutil.rmtree(cls.work, True)
            raise unittest.SkipTest(f"cannot make a venv with pip here: "
                                    f"{made.stderr.strip()[-300:]}")
        # pip 21.3+ builds in place (an older one copies python/ away from ../vmm-memd).
        upgraded = run([cls.python, "-m", "pip", "install", "--quiet", "pip>=21.3"],
                       env=cls.env, cwd=cls.work)
        started = time.monotonic()
        cls.installed = run_group([cls.python, "-m", "pip", "install", "--no-cache-dir", SOURCE],
                                  BUILD_TIMEOUT, env=cls.env, cwd=cls.work)
        cls.build_seconds = time.monotonic() - started
        out = upgraded.stdout + upgraded.stderr + cls.installed.stdout + cls.installed.stderr
        if cls.installed.returncode != 0 and "satisfies the requirement maturin" in out:
            shutil.rmtree(cls.work, True)
            raise unittest.SkipTest(f"cannot fetch maturin for the build (no package index "
                                    f"reachable?): {out.strip()[-300:]}")
        print(f"pip install {SOURCE}: {cls.build_seconds:.0f} s", file=sys.stderr)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.work, True)

    def setUp(self):
        self.assertEqual(self.installed.returncode, 0,
                         self.installed.stdout[-6000:] + self.installed.stderr[-6000:])

    def test_the_venv_has_the_packages_and_the_programs(self):
        # (vmm_ipc_cuda imports cuda.bindings: `pip show` below finds it installed.)
        code = ("import vmm_ipc_peer, vmm_memd, sys\n"
                "print(vmm_memd.__file__)\n"
                "print(vmm_ipc_peer.__file__)\n"
                "print('numpy' in sys.modules)\n")
        done = run([self.python, "-I", "-c", code], env=self.env, cwd=self.work)
        self.assertEqual(done.returncode, 0, done.stderr)
        *paths, numpy_loaded = done.stdout.split()
        for path in paths:
            self.assertTrue(path.startswith(os.path.join(self.venv, "lib")), path)
        self.assertEqual(numpy_loaded, "False", "importing the packages needs no numpy")
        for program in ("vmm-memd", "vmm-memctl"):
            path = os.path.join(self.bin, program)
            self.assertTrue(os.access(path, os.X_OK), f"{path} is not executable")
            helped = run([path, "--help"], env=self.env)
            self.assertEqual(helped.returncode, 0, helped.stderr)
            self.assertIn(f"usage: {program}", helped.stdout + helped.stderr)
        shown = run([self.python, "-m", "pip", "show", "-f", "vmm-ipc"], env=self.env)
        for file in ("vmm_memd/__main__.py", "vmm_memd/client.py", "vmm_ipc_peer/endpoint.py",
                     "vmm_ipc_cuda.py", "bin/vmm-memd", "bin/vmm-memctl"):
            self.assertIn(file, shown.stdout)

    def test_python_m_vmm_memd_serves_what_the_venv_publishes_and_attaches(self):
        socket = f"@vmm-memd-venv-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        env = dict(self.env, VMM_MEMD_SOCKET=socket)
        # The venv is not on PATH: the service is found beside the venv's interpreter.
        env["PATH"] = os.pathsep.join(
            d for d in env.get("PATH", os.defpath).split(os.pathsep)
            if os.path.realpath(d) != os.path.realpath(self.bin))
        log_path = os.path.join(self.work, "service.log")
        with open(log_path, "w") as log:
            service = subprocess.Popen(
                [self.python, "-m", "vmm_memd", "--lease-ttl-ms", "20000"], env=env,
                cwd=self.work, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        try:
            client = (
                "import array, vmm_memd\n"
                "client = vmm_memd.Client.reconnect(within=30)  # $VMM_MEMD_SOCKET\n"
                "data = array.array('f', [i / 4 for i in range(1024)])\n"
                "generation = vmm_memd.publish(client, 'venv', {'x': data})\n"
                "attached = client.attach('venv')\n"
                "assert attached['x'].tobytes() == data.tobytes()\n"
                "assert attached.generation == generation, (attached.generation, generation)\n"
                "client.detach(attached)\n"
                "print('attached', generation)\n")
            used = run([self.python, "-I", "-c", client], env=env, cwd=self.work)
            self.assertEqual(used.returncode, 0, used.stdout + used.stderr + self.log(log_path))
            self.assertIn("attached 1", used.stdout)
            listed = run([os.path.join(self.bin, "vmm-memctl"), "list"], env=env)
            self.assertEqual(listed.returncode, 0, listed.stderr + self.log(log_path))
            self.assertIn("venv", listed.stdout)
        finally:
            service.send_signal(signal.SIGTERM)
            try:
                status = service.wait(30)
            except subprocess.TimeoutExpired:
                service.kill()
                status = service.wait()
        log = self.log(log_path)
        self.assertEqual(status, 0, log)
        # `python -m vmm_memd` said what it ran: the venv's vmm-memd, the defaults added, the
        # extra argument passed on; the service said it served there and stopped.
        self.assertIn(f"python -m vmm_memd: {os.path.join(self.bin, 'vmm-memd')} --socket "
                      f"{socket} --quota-bytes ", log)
        self.assertIn("--lease-ttl-ms 20000", log)
        self.assertIn(f"vmm-memd: serving on {socket}", log)
        self.assertIn("vmm-memd: stopped", log)

    @staticmethod
    def log(path):
        with open(path) as f:
            return "\n--- service log ---\n" + f.read()


if __name__ == "__main__":
    unittest.main()
