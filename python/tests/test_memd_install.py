"""``pip install`` of this directory into a fresh venv, offline (``--no-index``): the in-tree
build backend needs no package, and both packages import with the standard library only."""

import os
import shutil
import subprocess
import sys
import tempfile
import unittest

import vmm_memd

SOURCE = os.path.dirname(os.path.dirname(os.path.abspath(vmm_memd.__file__)))


def run(args, **kw):
    return subprocess.run(args, capture_output=True, text=True, timeout=300, **kw)


class Backend(unittest.TestCase):
    def test_the_backend_says_what_pyproject_says(self):
        # The backend reads name and version from pyproject.toml; its summary and extras are
        # its own copies (Python 3.9 and 3.10 have no TOML parser): they must agree.
        try:
            import tomllib
        except ImportError:
            self.skipTest("no tomllib (Python < 3.11)")
        path = os.path.join(SOURCE, "pyproject.toml")
        if not os.path.exists(path):
            self.skipTest(f"no pyproject.toml in {SOURCE}")
        with open(path, "rb") as f:
            project = tomllib.load(f)["project"]
        sys.path.insert(0, os.path.join(SOURCE, "build_backend"))
        try:
            import vmm_ipc_wheel
        finally:
            sys.path.pop(0)
        self.assertEqual(vmm_ipc_wheel.SUMMARY, project["description"])
        self.assertEqual(vmm_ipc_wheel.EXTRAS, project["optional-dependencies"])
        self.assertEqual(vmm_ipc_wheel._project(), (project["name"], project["version"]))


class FreshVenv(unittest.TestCase):
    """One venv (making one takes seconds) for both tests; each uninstalls what it installed."""

    @classmethod
    def setUpClass(cls):
        if not os.path.exists(os.path.join(SOURCE, "pyproject.toml")):
            raise unittest.SkipTest(f"no pyproject.toml beside the packages in {SOURCE}")
        cls.work = tempfile.mkdtemp(prefix="vmm-memd-venv-")
        cls.venv = os.path.join(cls.work, "venv")
        made = run([sys.executable, "-m", "venv", cls.venv])
        cls.python = os.path.join(cls.venv, "bin", "python")
        if made.returncode != 0 or run([cls.python, "-m", "pip", "--version"]).returncode:
            shutil.rmtree(cls.work, True)
            raise unittest.SkipTest(f"cannot make a venv with pip here: "
                                    f"{made.stderr.strip()[-300:]}")
        # A copy of the sources, so that the build writes nothing beside the originals.
        cls.source = os.path.join(cls.work, "src")
        shutil.copytree(SOURCE, cls.source, ignore=shutil.ignore_patterns(
            "__pycache__", "tests", "*.rs", "*.egg-info", "build", "dist"))
        # Nothing of this interpreter's environment leaks into the venv's.
        cls.env = {k: v for k, v in os.environ.items()
                   if not k.startswith(("PYTHON", "PIP_", "VIRTUAL_ENV"))}
        cls.env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.work, True)

    def tearDown(self):
        run([self.python, "-m", "pip", "uninstall", "-y", "vmm-ipc"], env=self.env)

    def pip_install(self, *args):
        done = run([self.python, "-m", "pip", "install", "--no-index", "--no-cache-dir", *args],
                   env=self.env, cwd=self.work)
        self.assertEqual(done.returncode, 0, done.stdout + done.stderr)

    def check_imports(self, expect_inside):
        code = ("import vmm_ipc_peer, vmm_memd, sys\n"
                "print(vmm_memd.__file__)\n"
                "print(vmm_ipc_peer.__file__)\n"
                "print('numpy' in sys.modules)\n")
        done = run([self.python, "-I", "-c", code], env=self.env, cwd=self.work)
        self.assertEqual(done.returncode, 0, done.stderr)
        memd, peer_file, numpy_loaded = done.stdout.split()
        for path in (memd, peer_file):
            self.assertTrue(path.startswith(expect_inside), (path, expect_inside))
        self.assertEqual(numpy_loaded, "False", "importing the packages needs no numpy")

    def test_an_offline_install_with_build_isolation(self):
        self.pip_install(self.source)
        self.check_imports(os.path.join(self.venv, "lib"))
        shown = run([self.python, "-m", "pip", "show", "-f", "vmm-ipc"], env=self.env)
        self.assertIn("vmm_memd/client.py", shown.stdout)
        self.assertIn("vmm_ipc_peer/endpoint.py", shown.stdout)
        self.assertIn("vmm_ipc_cuda.py", shown.stdout)

    def test_an_editable_install(self):
        self.pip_install("-e", self.source)
        self.check_imports(self.source)


if __name__ == "__main__":
    unittest.main()
