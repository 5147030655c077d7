"""Starting the vmm-memd service from Python (``python -m vmm_memd``) with defaults for one
user, and the socket a client connects to by default.

``pip install`` of this package puts the service's programs, ``vmm-memd`` and ``vmm-memctl``
(Rust, built by maturin), in the environment's scripts directory (a venv's ``bin/``), beside
``python``. ``python -m vmm_memd [ARGS]`` finds ``vmm-memd`` there and replaces itself with
it (``exec``: signals and the exit status are the service's), adding only what ARGS leave out:

- ``--socket``: :func:`default_socket`, ``$VMM_MEMD_SOCKET`` or else ``@vmm-memd``, the
  name ``Client.connect()`` and ``vmm-memctl`` use when given none;
- ``--quota-bytes``: this machine's physical memory (:func:`default_quota_bytes`), so that
  the quota of the one user the service admits (its own uid) stops nothing memory would allow.

Everything else (``--allow-uid``, ``--lease-ttl-ms``, ``--no-keeper``, ``--help``...) goes to
``vmm-memd`` as it is.
"""

import os
import shutil
import sys
import sysconfig

from .errors import ExecutableNotFound

#: The service's socket when neither an argument nor ``$VMM_MEMD_SOCKET`` names one: an
#: abstract name (no file; the client checks the service's uid through the kernel), the one
#: ``vmm-memctl`` and vmm-memd's systemd unit use.
DEFAULT_SOCKET = "@vmm-memd"

#: The program that serves.
SERVICE = "vmm-memd"


def default_socket():
    """``$VMM_MEMD_SOCKET`` if set and not empty, else :data:`DEFAULT_SOCKET`: the socket
    ``python -m vmm_memd`` serves on and ``Client.connect()`` connects to when given none."""
    return os.environ.get("VMM_MEMD_SOCKET") or DEFAULT_SOCKET


def default_quota_bytes():
    """This machine's physical memory in bytes (the default ``--quota-bytes``)."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def scripts_dirs():
    """Where ``pip install`` puts this package's programs for this interpreter, in order: the
    environment's scripts directory (a venv's ``bin/``), the directory of the interpreter
    itself (the same, unless the interpreter is a link), and the user scheme's (``pip install
    --user``); then ``PATH``'s directories."""
    dirs = [sysconfig.get_path("scripts"), os.path.dirname(sys.executable)]
    try:
        dirs.append(sysconfig.get_path("scripts", f"{os.name}_user"))
    except KeyError:
        pass
    dirs += os.environ.get("PATH", os.defpath).split(os.pathsep)
    seen, out = set(), []
    for d in dirs:
        if d and d not in seen:
            seen.add(d)
            out.append(d)
    return out


def find_executable(name=SERVICE, dirs=None):
    """The path of program ``name``: ``$VMM_MEMD_BIN`` for ``vmm-memd`` when set (a service
    built from a checkout), else the first executable ``name`` in ``dirs`` (default:
    :func:`scripts_dirs`). :class:`ExecutableNotFound` (a ``FileNotFoundError``) if none."""
    if name == SERVICE and os.environ.get("VMM_MEMD_BIN"):
        path = os.environ["VMM_MEMD_BIN"]
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
        raise ExecutableNotFound(name, [], f"VMM_MEMD_BIN={path} is not an executable file")
    dirs = scripts_dirs() if dirs is None else list(dirs)
    found = shutil.which(name, path=os.pathsep.join(dirs)) if dirs else None
    if found is None:
        raise ExecutableNotFound(name, dirs)
    return found


def command(args=(), executable=None):
    """The service's command line: ``[executable, *args]`` with ``--socket`` and
    ``--quota-bytes`` added where ``args`` has none (see the module's text)."""
    args = list(args)
    argv = [executable or find_executable()]
    if args[:1] == ["--keeper"]:  # the keeper's own command line (vmm-memd starts it)
        return argv + args
    given = set(args)
    if "--socket" not in given:
        argv += ["--socket", default_socket()]
    if "--quota-bytes" not in given:
        argv += ["--quota-bytes", str(default_quota_bytes())]
    return argv + args


def main(args=None):
    """``python -m vmm_memd [ARGS]``: exec the service (see the module's text); returns only
    when it cannot: 127 when no ``vmm-memd`` is found, 126 when it cannot be run."""
    args = sys.argv[1:] if args is None else args
    try:
        argv = command(args)
    except ExecutableNotFound as e:
        print(f"python -m vmm_memd: {e}", file=sys.stderr)
        return 127
    print(f"python -m vmm_memd: {' '.join(argv)}", file=sys.stderr, flush=True)
    try:
        os.execv(argv[0], argv)
    except OSError as e:
        print(f"python -m vmm_memd: cannot run {argv[0]}: {e}", file=sys.stderr)
        return 126
