"""A minimal PEP 517 (and PEP 660) build backend, standard library only, for this directory's
packages: it builds a pure-Python wheel of ``PACKAGES`` and ``MODULES`` and an sdist, with no build
requirement, so ``pip install ./python`` works offline on any Python 3.9+.

The name and version come from pyproject.toml's ``[project]`` table (``tomllib`` where there is
one, else the two lines read directly); the optional dependencies are listed here."""

import base64
import hashlib
import io
import os
import re
import tarfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("vmm_ipc_peer", "vmm_memd")
# Top-level modules: the CUDA helper (it imports cuda.bindings, so only the GPU path of
# vmm_memd imports it, when a GPU region is attached).
MODULES = ("vmm_ipc_cuda",)
SUMMARY = "vmm-ipc peer protocol and vmm-memd client: shared memory by name, zero-copy"
EXTRAS = {"numpy": ["numpy>=2.1"], "cuda": ["cuda-python>=12"]}
_EPOCH = (1980, 1, 1, 0, 0, 0)  # fixed timestamps: the same sources give the same wheel


def _project():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        text = f.read()
    try:
        import tomllib
        project = tomllib.loads(text.decode())["project"]
        return project["name"], project["version"]
    except ImportError:
        section = text.decode().split("[project]", 1)[1]
        name = re.search(r'^name\s*=\s*"([^"]+)"', section, re.M).group(1)
        version = re.search(r'^version\s*=\s*"([^"]+)"', section, re.M).group(1)
        return name, version


def _dist():
    name, version = _project()
    return re.sub(r"[-_.]+", "_", name).lower(), name, version


def _sources():
    """(path relative to ROOT, bytes) of every module of PACKAGES, and of MODULES, sorted."""
    out = []
    for module in MODULES:
        with open(os.path.join(ROOT, module + ".py"), "rb") as f:
            out.append((module + ".py", f.read()))
    for package in PACKAGES:
        for directory, dirs, files in os.walk(os.path.join(ROOT, package)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for file in sorted(files):
                if file.endswith(".py"):
                    path = os.path.join(directory, file)
                    with open(path, "rb") as f:
                        out.append((os.path.relpath(path, ROOT).replace(os.sep, "/"), f.read()))
    return out


def _metadata():
    _, name, version = _dist()
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}",
             f"Summary: {SUMMARY}", "License: MIT OR Apache-2.0", "Requires-Python: >=3.9"]
    for extra, requirements in EXTRAS.items():
        lines.append(f"Provides-Extra: {extra}")
        lines += [f'Requires-Dist: {r}; extra == "{extra}"' for r in requirements]
    readme = os.path.join(ROOT, "README.md")
    body = ""
    if os.path.exists(readme):
        lines.append("Description-Content-Type: text/markdown")
        with open(readme, encoding="utf-8") as f:
            body = "\n" + f.read()
    return ("\n".join(lines) + "\n" + body).encode()


def _dist_info_files(dist_info):
    wheel = ("Wheel-Version: 1.0\nGenerator: vmm_ipc_wheel\nRoot-Is-Purelib: true\n"
             "Tag: py3-none-any\n").encode()
    return [(f"{dist_info}/METADATA", _metadata()), (f"{dist_info}/WHEEL", wheel),
            (f"{dist_info}/top_level.txt", "".join(p + "\n" for p in PACKAGES + MODULES).encode())]


def _write_wheel(wheel_directory, files):
    module, _, version = _dist()
    dist_info = f"{module}-{version}.dist-info"
    files = list(files) + _dist_info_files(dist_info)
    record = []
    for path, data in files:
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{dist_info}/RECORD,,")
    files.append((f"{dist_info}/RECORD", ("\n".join(record) + "\n").encode()))
    name = f"{module}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(os.path.join(wheel_directory, name), "w", zipfile.ZIP_DEFLATED) as z:
        for path, data in files:
            info = zipfile.ZipInfo(path, _EPOCH)
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, data)
    return name


def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def get_requires_for_build_editable(config_settings=None):
    return []


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    module, _, version = _dist()
    dist_info = f"{module}-{version}.dist-info"
    os.makedirs(os.path.join(metadata_directory, dist_info), exist_ok=True)
    for path, data in _dist_info_files(dist_info):
        with open(os.path.join(metadata_directory, path), "wb") as f:
            f.write(data)
    return dist_info


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    return _write_wheel(wheel_directory, _sources())


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    """PEP 660: a wheel whose .pth file puts this directory on sys.path."""
    module, _, _ = _dist()
    return _write_wheel(wheel_directory, [(f"_{module}_editable.pth", (ROOT + "\n").encode())])


def build_sdist(sdist_directory, config_settings=None):
    module, _, version = _dist()
    base = f"{module}-{version}"
    name = f"{base}.tar.gz"
    files = [("pyproject.toml", None), ("README.md", None),
             ("build_backend/vmm_ipc_wheel.py", None)] + _sources()
    with tarfile.open(os.path.join(sdist_directory, name), "w:gz", format=tarfile.PAX_FORMAT) as t:
        entries = [("PKG-INFO", _metadata())]
        for path, data in files:
            full = os.path.join(ROOT, path)
            if data is None:
                if not os.path.exists(full):
                    continue
                with open(full, "rb") as f:
                    data = f.read()
            entries.append((path, data))
        for path, data in entries:
            info = tarfile.TarInfo(f"{base}/{path}")
            info.size, info.mode, info.mtime = len(data), 0o644, 315532800
            t.addfile(info, io.BytesIO(data))
    return name
