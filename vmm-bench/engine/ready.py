#!/usr/bin/env python3
"""Restart to ready for a 1B torch model (issue 32, item 3): process start to the first forward
pass, with the weights from vmm-memd (attached zero-copy), from a safetensors file in the page
cache, and from pinned host memory. The target: CUDA init plus at most 10 ms for the weights.

One process per role, driven by the runner (``run``):

- the service: the ``vmm-memd`` binary on a path socket in a private temporary directory
  (``--no-keeper``: nothing outlives the run);
- the publisher (``publish``, untimed setup): builds the model on the device with seeded random
  weights (transformers' LlamaConfig in Llama 3.2 1B's shape, bfloat16, tied embeddings;
  nothing is downloaded: python/tests/test_memd_torch_engine.py's CONFIG), publishes
  ``model_state(model)`` with ``publish_state_dict``, waits for the service's digests
  (``verify``), saves the same tensors as a safetensors file on a disk path (``--data-dir``,
  /tmp by default) and reads it once (page cache), writes the raw bytes of every tensor into
  one file in /dev/shm with an index (name, dtype, shape, offset), and saves the logits of a
  fixed input (the reference). Tied tensors (``lm_head.weight`` is ``model.embed_tokens.
  weight``) are stored once everywhere and tied again by each engine;
- engines, each sample a fresh process, in two start modes: ``fork`` (a long-lived
  ``forkserver`` that imported torch, transformers, safetensors and the service's client but
  never touched CUDA forks one child per sample: everything from CUDA init on) and ``exec``
  (``python3 ready.py engine ...``: the interpreter and the imports too). The variants
  alternate round by round (each round in a rotated order), so drift hits all alike.

What an engine does, in order, with a timestamp after each step (CLOCK_BOOTTIME, the same
clock in every process; the origin is the runner's clock just before the exec, or the
forkserver's just before the fork; the kernel's start time, ``since_exec``, is reported too):
imports (torch, transformers, the variant's loader), CUDA init (``torch.cuda.init()``, a
tiny allocation, a synchronize), the model built on the meta device, the weights (the step
compared), the first forward pass (synchronized). Then, untimed, its logits are compared
with the reference bit for bit (a difference fails the sample) and the weights are checked
to be where they should be (memd: every tensor inside the attached mapping).

The weights step, per variant:
- ``memd``: ``Client.connect``; ``vmm_memd.torch.attach_state_dict`` (``Client.attach``:
  the request, the descriptors, the import and map; then ``torch.from_dlpack`` per tensor);
  ``vmm_memd.torch.bind``. The parts are timed from outside: ``client.attach`` (and, for the
  "import/map" part, the client's private ``_import_gpu`` / ``_host_chunks``) are wrapped on
  the instance; "tensors" is attach_state_dict less its attach.
- ``safetensors``: the index (tied names), ``safetensors.torch.load_file(path,
  device="cuda")``, ``bind`` (``load_state_dict(strict=True, assign=True)`` and the
  non-persistent buffers, the same call as memd's).
- ``pinned``: the index, open and mmap the /dev/shm file (MAP_SHARED), register it as pinned
  host memory (``torch.cuda.cudart().cudaHostRegister``), one GPU buffer, one non_blocking
  copy per tensor into it and one synchronize, views, ``bind``. The copy alone is the floor
  ANCHORS.md quotes ("reloading the same bytes from pinned host memory").

    bash vmm-bench/engine/run.sh                        # on the GPU machine: results in $OUT
    python3 vmm-bench/engine/ready.py run --cpu --memd target/debug/vmm-memd   # a dry run

``--cpu`` runs every step on the CPU with a model of a few MB: a host region in the service,
no CUDA init, no pinned registration (the copy only). Its numbers mean nothing; the flows are
the real ones.
"""

import argparse
import ctypes
import importlib
import json
import mmap
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

PC = time.perf_counter
GIB = 1 << 30
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
VARIANTS = ("memd", "safetensors", "pinned")
MODES = ("fork", "exec")
REGION = "llama-1b-ready"
ALIGN = 256  # offsets in the /dev/shm file (vmm_memd.ALIGNMENT: what cuBLAS likes)

#: Llama 3.2 1B's shape (python/tests/test_memd_torch_engine.py): 1.24 G parameters, 2.47 GB
#: in bfloat16, the embedding tied to the output layer.
CONFIG = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
              num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
              max_position_embeddings=4096, tie_word_embeddings=True)
#: The dry run's model (a few MB).
SMALL = dict(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)
SEED = 32
TOKENS = 32


def config(cpu):
    return dict(CONFIG, **SMALL) if cpu else dict(CONFIG)


def model_bytes_estimate(c):
    """The model's bytes in bfloat16 (tied embedding once), plus the rotary buffer: how much
    room the /dev/shm file and the safetensors file need."""
    h, i, v, n = c["hidden_size"], c["intermediate_size"], c["vocab_size"], \
        c["num_hidden_layers"]
    kv = c["num_key_value_heads"] * (h // c["num_attention_heads"])
    layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
    params = v * h + n * layer + h + (0 if c["tie_word_embeddings"] else v * h)
    return params * 2 + (n * 9 + 8) * ALIGN + 4096


# ---- clocks and small helpers ----------------------------------------------------------------


def boottime():
    """Seconds on CLOCK_BOOTTIME: one clock for every process of the run."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def exec_start():
    """When the kernel started this process, on CLOCK_BOOTTIME (10 ms ticks): field 22 of
    /proc/self/stat (test_memd_torch_engine.py's since_exec())."""
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[19]) / os.sysconf("SC_CLK_TCK")


def ms(seconds):
    return round(seconds * 1000, 3)


def die_with_parent(sig=signal.SIGKILL):
    """This process gets ``sig`` when the thread that started it dies (PR_SET_PDEATHSIG)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, int(sig), 0, 0, 0)


def write_all(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def report(fd, obj):
    """One JSON line on the report channel (a pipe the runner or the forkserver reads)."""
    write_all(fd, (json.dumps(obj) + "\n").encode())


class Lines:
    """JSON lines read from a pipe, each within a timeout."""

    def __init__(self, fd):
        self.fd, self.buf, self.eof = fd, b"", False

    def next(self, timeout):
        """The next object; None at EOF; TimeoutError past ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            if self.eof:
                return None
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no report within {timeout:.0f} s")
            ready, _, _ = select.select([self.fd], [], [], left)
            if ready:
                data = os.read(self.fd, 1 << 16)
                if not data:
                    self.eof = True
                self.buf += data
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)


def wait_pid(pid, timeout):
    """waitpid within ``timeout`` seconds (SIGKILL past it): the exit status, as
    subprocess's returncode (negative for a signal)."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.002)


# ---- the engine (one sample: a fresh process) -------------------------------------------------


def imports(stamps):
    """Everything an engine imports, stamped: torch, transformers (the Llama modules
    themselves, not transformers' lazy shell), the loaders (the service's client and, for a
    GPU, its CUDA helper; safetensors)."""
    import torch
    stamps["torch"] = boottime()
    import transformers
    transformers.LlamaConfig, transformers.LlamaForCausalLM  # noqa: B018 (loads the modules)
    stamps["transformers"] = boottime()
    loaders = ["safetensors.torch", "vmm_memd", "vmm_memd.torch"]
    if os.environ.get("VMM_READY_DEVICE", "cuda") == "cuda":
        loaders.append("vmm_ipc_cuda")  # cuda.bindings: imported, CUDA not initialised
    for name in loaders:
        importlib.import_module(name)
    stamps["imports"] = boottime()
    return torch


class Engine:
    """One engine start with one variant; ``run()`` gives the sample's report."""

    def __init__(self, a, variant, stamps):
        import torch
        self.torch, self.a, self.variant, self.stamps = torch, a, variant, stamps
        self.cuda = not a.cpu
        self.device = "cuda" if self.cuda else "cpu"
        self.parts = {}
        self.extra = {}  # reported with the checks
        self.keep = []  # what must live as long as the model (mmaps, the client)

    def synchronize(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def build(self):
        """The Llama on the meta device (no memory): test_memd_torch_engine.py's build()."""
        torch = self.torch
        from transformers import LlamaConfig, LlamaForCausalLM
        torch.manual_seed(SEED)
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device("meta"):
                model = LlamaForCausalLM(LlamaConfig(**config(self.a.cpu)))
        finally:
            torch.set_default_dtype(default)
        return model.eval()

    def index(self):
        with open(os.path.join(self.a.dir, "index.json")) as f:
            return json.load(f)

    def tie(self, tensors, index):
        """The tied names (stored once) pointing at their tensor again, as the model wants."""
        for name, target in index["aliases"].items():
            tensors[name] = tensors[target]
        return tensors

    # -- the three ways to get the weights

    def weights_memd(self, model):
        import vmm_memd
        from vmm_memd import torch as memd_torch
        parts = self.parts
        if self.cuda:
            # cuda.bindings loads the driver's entry points on its first call (cuInit here is
            # a no-op after torch's): a cost of this client's first GPU attach in a process,
            # shown apart from the attach.
            import vmm_ipc_cuda
            t = PC()
            vmm_ipc_cuda.check(vmm_ipc_cuda.cu.cuInit(0), "cuInit")
            parts["cuda.bindings init"] = PC() - t
        t0 = PC()
        client = vmm_memd.Client.connect(self.a.socket)
        t1 = PC()
        self.keep.append(client)
        timed = {}

        def timing(key, fn):
            def call(*args, **kwargs):
                started = PC()
                try:
                    return fn(*args, **kwargs)
                finally:
                    timed[key] = timed.get(key, 0.0) + PC() - started
            return call

        # From outside the package: the instance's methods wrapped (no hook in it).
        client.attach = timing("attach", client.attach)
        if self.cuda:
            client._import_gpu = timing("map", client._import_gpu)
        else:
            client._host_chunks = timing("map", client._host_chunks)
        attached, tensors = memd_torch.attach_state_dict(client, self.a.region)
        t2 = PC()
        memd_torch.bind(model, tensors)
        t3 = PC()
        self.keep.append(attached)
        self.attached = attached
        parts["connect"] = t1 - t0
        parts["attach"] = timed["attach"]
        parts["attach: import/map"] = timed.get("map", 0.0)
        parts["tensors"] = (t2 - t1) - timed["attach"]
        parts["bind"] = t3 - t2
        del tensors

    def weights_safetensors(self, model):
        from safetensors.torch import load_file
        from vmm_memd import torch as memd_torch
        t0 = PC()
        index = self.index()
        t1 = PC()
        tensors = load_file(os.path.join(self.a.dir, "model.safetensors"), device=self.device)
        t2 = PC()
        memd_torch.bind(model, self.tie(tensors, index))
        t3 = PC()
        self.parts.update({"index": t1 - t0, "load_file": t2 - t1, "bind": t3 - t2})

    def weights_pinned(self, model):
        torch = self.torch
        from vmm_memd import torch as memd_torch
        t0 = PC()
        index = self.index()
        size = index["size"]
        fd = os.open(index["blob"], os.O_RDWR)
        try:
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        host = torch.frombuffer(mm, dtype=torch.uint8)
        self.keep += [mm, host]  # registered memory is never unmapped while the process lives
        t1 = PC()
        if self.cuda:
            err = torch.cuda.cudart().cudaHostRegister(host.data_ptr(), size, 0)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of {size} bytes: error {int(err)}")
        t2 = PC()
        if self.cuda:  # untimed: torch sees the registered mapping as pinned
            self.extra["host_is_pinned"] = bool(host.is_pinned())
        t2b = PC()
        buffer = torch.empty(size, dtype=torch.uint8, device=self.device)
        t3 = PC()
        for entry in index["tensors"]:
            start, end = entry["offset"], entry["offset"] + entry["nbytes"]
            buffer[start:end].copy_(host[start:end], non_blocking=True)
        self.synchronize()
        t4 = PC()
        tensors = {}
        for entry in index["tensors"]:
            start, end = entry["offset"], entry["offset"] + entry["nbytes"]
            tensors[entry["name"]] = buffer[start:end].view(getattr(torch, entry["dtype"])) \
                .view(entry["shape"])
        t5 = PC()
        memd_torch.bind(model, self.tie(tensors, index))
        t6 = PC()
        self.parts.update({"index + mmap": t1 - t0, "register": t2 - t1,
                           "allocate": t3 - t2b, "copy": t4 - t3, "views": t5 - t4,
                           "bind": t6 - t5})

    # -- the sample

    def run(self):
        torch, stamps = self.torch, self.stamps
        torch.use_deterministic_algorithms(True, warn_only=True)
        if self.cuda:
            torch.cuda.init()
            torch.empty(1, device="cuda")
            torch.cuda.synchronize()
        stamps["cuda"] = boottime()
        model = self.build()
        stamps["built"] = boottime()
        getattr(self, "weights_" + self.variant)(model)
        stamps["weights"] = boottime()
        input_ids = torch.randint(0, config(self.a.cpu)["vocab_size"], (1, TOKENS),
                                  generator=torch.Generator().manual_seed(SEED))
        with torch.inference_mode():
            logits = model(input_ids=input_ids.to(self.device), use_cache=False).logits
        self.synchronize()
        stamps["forward"] = boottime()
        checks = self.checks(model, logits)
        checks.update(self.extra)
        return {"parts_ms": {k: ms(v) for k, v in self.parts.items()}, "checks": checks}

    def checks(self, model, logits):
        """Untimed: the logits bit for bit, the tied tensors one memory, memd's weights in
        the mapping. A failure raises (the sample fails)."""
        torch = self.torch
        want = torch.load(os.path.join(self.a.dir, "reference.pt"))["logits"]
        got = logits.cpu()
        named = list(model.named_parameters(remove_duplicate=False)) + \
            list(model.named_buffers(remove_duplicate=False))
        out = {"tensors": len(named), "devices": sorted({str(t.device) for _, t in named}),
               "tied": model.lm_head.weight.data_ptr()
               == model.model.embed_tokens.weight.data_ptr(),
               "equal": got.shape == want.shape and got.dtype == want.dtype
               and bool(torch.equal(got, want))}
        if self.cuda:
            out["allocated"] = torch.cuda.memory_allocated()
        if self.variant == "memd":
            from vmm_memd import torch as memd_torch
            out["outside_mapping"] = [n for n, t in named
                                      if not memd_torch.mapped(self.attached, t)]
        problems = []
        if not out["equal"]:
            diff = (got.float() - want.float()).abs().max().item() \
                if got.shape == want.shape else f"shape {list(got.shape)}"
            problems.append(f"the logits differ from the reference (max abs diff {diff})")
        if not out["tied"]:
            problems.append("lm_head.weight and model.embed_tokens.weight are not one memory")
        if out.get("outside_mapping"):
            problems.append(f"not in the attached mapping: {out['outside_mapping'][:5]}")
        if out["devices"] != [("cuda:0" if self.cuda else "cpu")]:
            problems.append(f"tensors on {out['devices']}")
        if problems:
            raise AssertionError("; ".join(problems))
        return out


def sample(a, variant, stamps):
    """One engine start in this (fresh) process: its report (never raises)."""
    out = {"variant": variant, "pid": os.getpid()}
    try:
        out.update(Engine(a, variant, stamps).run())
        out["ok"] = True
    except BaseException:  # noqa: BLE001 (the runner shows it and fails the run)
        out["ok"] = False
        out["error"] = traceback.format_exc()
    out["stamps"], out["exec_start"] = stamps, exec_start()
    return out


def engine_main(a):
    """``engine``: one exec-mode sample (``--variant``); reports on ``--report-fd``."""
    die_with_parent()
    stamps = {}
    try:
        imports(stamps)
        out = sample(a, a.variant, stamps)
    except BaseException:  # noqa: BLE001
        out = {"variant": a.variant, "ok": False, "error": traceback.format_exc(),
               "stamps": stamps}
    report(a.report_fd, out)
    sys.stdout.flush()
    sys.stderr.flush()
    # Not the interpreter's teardown: registered host memory and mappings die with the process.
    os._exit(0 if out["ok"] else 1)


def forkserver_main(a):
    """``forkserver``: import everything, never touch CUDA, then fork one child per
    ``{"variant": ...}`` line on stdin; the child's report (with its exit status) on
    ``--report-fd``."""
    die_with_parent()
    stamps = {}
    torch = imports(stamps)
    torch.use_deterministic_algorithms(True, warn_only=True)
    if torch.cuda.is_initialized():
        raise SystemExit("forkserver: CUDA is initialised after the imports; not forking")
    threads = len(os.listdir("/proc/self/task"))
    with open("/proc/self/maps") as f:  # the driver library loaded: someone called CUDA
        libcuda = "libcuda.so" in f.read()
    report(a.report_fd, {"event": "ready", "stamps": stamps, "exec_start": exec_start(),
                         "threads": threads, "libcuda_mapped": libcuda,
                         "torch": torch.__version__})
    for line in sys.stdin:
        command = json.loads(line)
        r, w = os.pipe()
        origin = boottime()
        pid = os.fork()
        if pid == 0:  # the sample: everything from CUDA init on
            code = 1
            try:
                os.close(r)
                die_with_parent()
                child = {"origin": origin, "imports": boottime()}  # "imports": the fork
                out = sample(a, command["variant"], child)
                write_all(w, json.dumps(out).encode())
                code = 0 if out["ok"] else 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        os.close(w)
        data, deadline, eof = b"", time.monotonic() + a.sample_timeout, False
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([r], [], [], left)[0]:
                    break
                chunk = os.read(r, 1 << 16)
                if not chunk:
                    eof = True
                    break
                data += chunk
        finally:
            os.close(r)
        status = wait_pid(pid, 10 if eof else 0)  # past the timeout: SIGKILL now
        try:
            out = json.loads(data) if data else None
        except ValueError:
            out = None
        if out is None:
            out = {"variant": command["variant"], "ok": False,
                   "error": f"the forked child (pid {pid}) gave no report within "
                            f"{a.sample_timeout:.0f} s (exit status {status})"}
        out["exit_status"] = status
        out.setdefault("stamps", {})["origin"] = origin
        report(a.report_fd, out)


# ---- the publisher (setup, untimed) -----------------------------------------------------------


def publish_main(a):
    """``publish``: build on the device, publish to the service, write the safetensors file,
    the /dev/shm file and its index, and the reference logits."""
    die_with_parent()
    started = PC()
    import torch
    from safetensors.torch import save_file
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM
    import vmm_memd
    from vmm_memd import torch as memd_torch
    cuda = not a.cpu
    device = "cuda" if cuda else "cpu"
    torch.use_deterministic_algorithms(True, warn_only=True)
    info = {"torch": torch.__version__, "transformers": transformers.__version__,
            "device": torch.cuda.get_device_name(0) if cuda else "cpu"}
    try:
        import safetensors
        info["safetensors"] = safetensors.__version__
    except AttributeError:
        pass
    times = {"imports": PC() - started}

    t = PC()
    torch.manual_seed(SEED)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(LlamaConfig(**config(a.cpu)))
    finally:
        torch.set_default_dtype(default)
    model.eval()
    state = memd_torch.model_state(model)
    input_ids = torch.randint(0, config(a.cpu)["vocab_size"], (1, TOKENS),
                              generator=torch.Generator().manual_seed(SEED))
    with torch.inference_mode():
        logits = model(input_ids=input_ids.to(device), use_cache=False).logits
    if cuda:
        torch.cuda.synchronize()
    if not torch.isfinite(logits.float()).all():
        raise AssertionError("the reference logits are not finite")
    torch.save({"input_ids": input_ids, "logits": logits.cpu()},
               os.path.join(a.dir, "reference.pt"))
    times["build + reference"] = PC() - t

    t = PC()
    client = vmm_memd.Client.connect(a.socket)
    generation = memd_torch.publish_state_dict(client, a.region, state,
                                               device=0 if cuda else "cpu")
    times["publish_state_dict"] = PC() - t
    t = PC()
    client.verify(a.region)  # the service's digests done: nothing runs behind the samples
    client.close()
    times["verify"] = PC() - t

    # Distinct tensors once (tied names become aliases), in the state dict's order.
    t = PC()
    first, distinct, aliases = {}, {}, {}
    for name, tensor in state.items():
        key = (str(tensor.device), tensor.data_ptr(), str(tensor.dtype),
               tuple(tensor.shape), tuple(tensor.stride()))
        if tensor.numel() and key in first:
            aliases[name] = first[key]
            continue
        first[key] = name
        distinct[name] = tensor.detach().contiguous().cpu()
    entries, offset = [], 0
    for name, tensor in distinct.items():
        nbytes = tensor.numel() * tensor.element_size()
        entries.append({"name": name, "dtype": str(tensor.dtype).split(".", 1)[1],
                        "shape": list(tensor.shape), "offset": offset, "nbytes": nbytes})
        offset = -(-(offset + nbytes) // ALIGN) * ALIGN
    size = max(offset, ALIGN)
    fd = os.open(a.blob, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, size)
        for entry in entries:
            tensor = distinct[entry["name"]]
            if entry["nbytes"]:
                data = (ctypes.c_ubyte * entry["nbytes"]).from_address(tensor.data_ptr())
                written = os.pwrite(fd, data, entry["offset"])
                if written != entry["nbytes"]:
                    raise OSError(f"short write to {a.blob}: {written} of {entry['nbytes']}")
    finally:
        os.close(fd)
    index = {"blob": a.blob, "size": size, "tensors": entries, "aliases": aliases}
    with open(os.path.join(a.dir, "index.json"), "w") as f:
        json.dump(index, f)
    times["shm file"] = PC() - t

    t = PC()
    path = os.path.join(a.dir, "model.safetensors")
    save_file(distinct, path, metadata={"aliases": json.dumps(aliases)})
    times["safetensors save"] = PC() - t
    t = PC()
    fd = os.open(path, os.O_RDONLY)
    try:
        while os.read(fd, 64 << 20):  # once through: in the page cache
            pass
    finally:
        os.close(fd)
    times["safetensors read"] = PC() - t
    report(a.report_fd, {
        "event": "published", "generation": generation, "tensors": len(state),
        "distinct": len(distinct), "aliases": aliases,
        "model_bytes": sum(e["nbytes"] for e in entries), "blob_bytes": size,
        "safetensors_bytes": os.path.getsize(path), "times_ms": {k: ms(v) for k, v in
                                                                 times.items()},
        **info})
    sys.stdout.flush()
    os._exit(0)


# ---- the runner -------------------------------------------------------------------------------


class Failed(RuntimeError):
    pass


def _pdeathsig_term():
    die_with_parent(signal.SIGTERM)


def _pdeathsig_kill():
    die_with_parent(signal.SIGKILL)


class Runner:
    def __init__(self, a):
        self.a = a
        self.t0 = time.monotonic()
        self.memd = None
        self.forkserver = None
        self.fs_lines = None
        self.samples = []
        self.notes = []
        self.temp = tempfile.mkdtemp(prefix="engine-ready-", dir=a.data_dir)
        self.socket_dir = tempfile.mkdtemp(prefix="engine-ready-sock-")
        self.socket = os.path.join(self.socket_dir, "memd.sock")
        self.blob_fd = None
        self.blob = None
        self.env = dict(os.environ)
        paths = [os.path.join(ROOT, "python")]
        if self.env.get("PYTHONPATH"):
            paths.append(self.env["PYTHONPATH"])
        self.env.update(PYTHONPATH=os.pathsep.join(paths), PYTHONUNBUFFERED="1",
                        CUBLAS_WORKSPACE_CONFIG=":4096:8",
                        # torch.cuda.is_available() without cuInit, should anything ask in
                        # the forkserver before it forks.
                        PYTORCH_NVML_BASED_CUDA_CHECK="1",
                        VMM_READY_DEVICE="cpu" if a.cpu else "cuda",
                        TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1")
        self.env.setdefault("VMM_MEMD_LOG", "warn")

    def log(self, text):
        print(f"[{time.monotonic() - self.t0:6.1f} s] {text}", flush=True)

    def left(self):
        return self.a.deadline - (time.monotonic() - self.t0)

    # -- processes

    def role_argv(self, role, *extra):
        argv = [sys.executable, os.path.abspath(__file__), role, "--socket", self.socket,
                "--region", self.a.region, "--dir", self.temp,
                "--sample-timeout", str(self.a.sample_timeout)]
        if self.a.cpu:
            argv.append("--cpu")
        return argv + list(extra)

    def spawn(self, argv, stdin=subprocess.DEVNULL):
        """Start a role with a report pipe (its write end as --report-fd): (Popen, Lines,
        the runner's clock just before the exec)."""
        r, w = os.pipe()
        try:
            origin = boottime()
            p = subprocess.Popen(argv + ["--report-fd", str(w)], stdin=stdin, pass_fds=(w,),
                                 env=self.env, cwd=ROOT, preexec_fn=_pdeathsig_kill)
        except BaseException:
            os.close(r)
            raise
        finally:
            os.close(w)
        return p, Lines(r), origin

    def one_shot(self, argv, timeout):
        """A role that reports once and exits: (its report, the clock before the exec)."""
        p, lines, origin = self.spawn(argv)
        try:
            try:
                out = lines.next(timeout)
            except TimeoutError:
                out = None
            try:
                p.wait(timeout=10 if out is not None else 0.1)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
            os.close(lines.fd)
        return out, origin, p.returncode

    def start_memd(self):
        import vmm_memd
        argv = [self.a.memd, "--socket", self.socket, "--quota-bytes",
                str(self.a.quota_gib * GIB), "--no-keeper"]
        t = PC()
        self.memd = subprocess.Popen(argv, stdin=subprocess.DEVNULL, env=self.env, cwd=ROOT,
                                     preexec_fn=_pdeathsig_term)
        while PC() - t < 30:
            if self.memd.poll() is not None:
                raise Failed(f"vmm-memd exited with {self.memd.returncode}")
            try:
                vmm_memd.Client.connect(self.socket, timeout=2.0).close()
                return (PC() - t) * 1000
            except vmm_memd.MemdError:
                time.sleep(0.01)
        raise Failed("vmm-memd not answering within 30 s")

    def stop_memd(self):
        if self.memd is not None and self.memd.poll() is None:
            self.memd.terminate()
            try:
                self.memd.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.memd.kill()
                self.memd.wait()

    def place_blob(self, need):
        """The /dev/shm file for the pinned variant, or (where /dev/shm is too small: a
        container's 64 MB) a memfd this runner holds, opened by path through /proc."""
        st = os.statvfs(self.a.shm_dir)
        if st.f_bavail * st.f_frsize >= need * 1.05 + (256 << 20):
            self.blob = os.path.join(self.a.shm_dir, f"engine-ready-{os.getpid()}.bin")
            return f"{self.blob} (tmpfs)"
        self.blob_fd = os.memfd_create("engine-ready-pinned", os.MFD_CLOEXEC)
        self.blob = f"/proc/{os.getpid()}/fd/{self.blob_fd}"
        note = (f"{self.a.shm_dir} has {st.f_bavail * st.f_frsize >> 20} MiB free, the file "
                f"needs {need >> 20} MiB: a memfd instead (the same shmem pages)")
        self.notes.append(note)
        return f"{self.blob} ({note})"

    def start_forkserver(self):
        p, lines, origin = self.spawn(self.role_argv("forkserver"), stdin=subprocess.PIPE)
        self.forkserver, self.fs_lines = p, lines
        try:
            ready = lines.next(self.a.sample_timeout)
        except TimeoutError:
            ready = None
        if not ready or ready.get("event") != "ready":
            raise Failed(f"the forkserver did not start (exit {p.poll()}): {ready}")
        return ready, origin

    def stop_forkserver(self):
        p = self.forkserver
        if p is None:
            return
        self.forkserver = None
        try:
            p.stdin.close()
        except OSError:
            pass
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        os.close(self.fs_lines.fd)

    def cleanup(self):
        self.stop_forkserver()
        self.stop_memd()
        if self.blob_fd is not None:
            os.close(self.blob_fd)
        elif self.blob and os.path.exists(self.blob) and not self.a.keep_data:
            os.unlink(self.blob)
        if not self.a.keep_data:
            for name in ("model.safetensors", "index.json", "reference.pt"):
                try:
                    os.unlink(os.path.join(self.temp, name))
                except FileNotFoundError:
                    pass
            os.rmdir(self.temp)
        try:
            os.rmdir(self.socket_dir)
        except OSError:
            pass

    # -- samples

    def record(self, mode, rnd, variant, out, origin, warmup):
        """A sample's report: steps from its stamps; logged; kept."""
        out = dict(out or {"variant": variant, "ok": False, "error": "no report"})
        out.update(mode=mode, round=rnd, warmup=warmup)
        s = out.get("stamps", {})
        if out.get("ok"):
            steps = {
                "imports": s["imports"] - origin,
                "cuda_init": s["cuda"] - s["imports"],
                "build": s["built"] - s["cuda"],
                "weights": s["weights"] - s["built"],
                "forward": s["forward"] - s["weights"],
                "ready": s["weights"] - origin,
                "total": s["forward"] - origin,
            }
            if mode == "exec":
                steps["import_torch"] = s["torch"] - origin  # with the interpreter's start
                steps["import_transformers"] = s["transformers"] - s["torch"]
                steps["import_loaders"] = s["imports"] - s["transformers"]
                steps["total_since_exec"] = s["forward"] - out["exec_start"]
                steps["exec_to_imports"] = s["imports"] - out["exec_start"]
            out["steps_ms"] = {k: ms(v) for k, v in steps.items()}
            parts = ", ".join(f"{k} {v:.2f}" for k, v in out["parts_ms"].items())
            st = out["steps_ms"]
            self.log(f"{mode} {'warmup' if warmup else f'round {rnd}'} {variant}: "
                     f"imports {st['imports']:.0f}, CUDA init {st['cuda_init']:.1f}, build "
                     f"{st['build']:.1f}, weights {st['weights']:.2f} ({parts}), forward "
                     f"{st['forward']:.1f}, total {st['total']:.0f} ms")
        else:
            self.log(f"{mode} {'warmup' if warmup else f'round {rnd}'} {variant}: FAILED\n"
                     f"{out.get('error')}")
        self.samples.append(out)
        return out

    def fork_sample(self, rnd, variant, warmup):
        p = self.forkserver
        if p.poll() is not None:
            raise Failed(f"the forkserver exited ({p.returncode})")
        p.stdin.write((json.dumps({"variant": variant}) + "\n").encode())
        p.stdin.flush()
        try:
            out = self.fs_lines.next(self.a.sample_timeout + 15)
        except TimeoutError:
            raise Failed(f"the forkserver gave no report for {variant} within "
                         f"{self.a.sample_timeout + 15:.0f} s") from None
        if out is None:
            raise Failed(f"the forkserver exited ({p.poll()}) during a {variant} sample")
        return self.record("fork", rnd, variant, out, out["stamps"]["origin"], warmup)

    def exec_sample(self, rnd, variant, warmup):
        out, origin, code = self.one_shot(self.role_argv("engine", "--variant", variant),
                                          self.a.sample_timeout)
        if out is not None:
            out["exit_status"] = code
        return self.record("exec", rnd, variant, out, origin, warmup)

    def rounds(self, mode, count, fn):
        variants = self.a.variants
        for rnd in range(-self.a.warmup if mode == "fork" else 0, count):
            k = rnd % len(variants)
            for variant in variants[k:] + variants[:k]:
                if self.left() < (60 if mode == "exec" else 15):
                    note = (f"{mode}: stopped at round {rnd} ({variant}): the deadline "
                            f"({self.a.deadline:.0f} s) is near")
                    self.notes.append(note)
                    self.log(note)
                    return
                fn(rnd, variant, rnd < 0)

    # -- the run

    def run(self):
        a = self.a
        need = model_bytes_estimate(config(a.cpu))
        for path in (a.data_dir,):
            st = os.statvfs(path)
            if st.f_bavail * st.f_frsize < need * 1.1:
                raise Failed(f"{path} has {st.f_bavail * st.f_frsize >> 20} MiB free, the "
                             f"safetensors file needs {need >> 20} MiB")
        self.log(f"device {'cpu (dry run)' if a.cpu else 'cuda:0'}; model {need / 1e9:.2f} GB;"
                 f" data in {self.temp}; pinned file {self.place_blob(need)}")
        self.log(f"vmm-memd {a.memd} up in {self.start_memd():.0f} ms on {self.socket}")
        self.meta = {"args": {k: v for k, v in vars(a).items() if k != "func"},
                     "config": config(a.cpu), "seed": SEED, "tokens": TOKENS,
                     "python": sys.version.split()[0], "notes": self.notes}
        t = PC()
        published, _, code = self.one_shot(self.role_argv("publish", "--blob", self.blob),
                                           a.publish_timeout)
        if not published or published.get("event") != "published" or code != 0:
            raise Failed(f"the publisher failed (exit {code}): {published}")
        self.meta["published"] = published
        self.log(f"published: {published['model_bytes'] / 1e9:.2f} GB, {published['tensors']}"
                 f" names, {published['distinct']} distinct (tied: {published['aliases']}), "
                 f"generation {published['generation']}, in {PC() - t:.1f} s "
                 f"({published['times_ms']}); {published['device']}, torch "
                 f"{published['torch']}, transformers {published['transformers']}")
        if "fork" in a.modes and a.repeat > 0:
            ready, origin = self.start_forkserver()
            self.meta["forkserver"] = {"imports_ms": ms(ready["stamps"]["imports"] - origin),
                                       "threads_at_fork": ready["threads"],
                                       "libcuda_mapped": ready["libcuda_mapped"]}
            libcuda = "MAPPED (a CUDA call before the fork?)" if ready["libcuda_mapped"] \
                else "not loaded"
            self.log(f"forkserver up: imports {self.meta['forkserver']['imports_ms']:.0f} ms "
                     f"after exec, {ready['threads']} threads, libcuda {libcuda}")
            self.rounds("fork", a.repeat, self.fork_sample)
            self.stop_forkserver()
        if "exec" in a.modes and a.exec_repeat > 0:
            self.rounds("exec", a.exec_repeat, self.exec_sample)

    def results(self):
        os.makedirs(self.a.out, exist_ok=True)
        table = summary(self.samples, self.a)
        if self.notes:
            table += "\n" + "\n".join(f"- note: {n}" for n in self.notes) + "\n"
        head = (f"# Restart to ready: Llama 3.2 1B shape, bf16 "
                f"({'CPU dry run: numbers mean nothing' if self.a.cpu else 'cuda:0'})\n\n")
        pub = getattr(self, "meta", {}).get("published")
        if pub:
            head += (f"{pub['device']}, torch {pub['torch']}, transformers "
                     f"{pub['transformers']}, safetensors {pub.get('safetensors', '?')}; "
                     f"{pub['model_bytes'] / 1e9:.2f} GB in {pub['distinct']} tensors "
                     f"({pub['tensors']} names). Times in ms: median [min-max] over n "
                     f"samples, each a fresh process.\n\n")
        with open(os.path.join(self.a.out, "engine-ready.md"), "w") as f:
            f.write(head + table)
        with open(os.path.join(self.a.out, "engine-ready.json"), "w") as f:
            json.dump({"meta": getattr(self, "meta", {}), "samples": self.samples}, f, indent=1)
        print("\n" + head + table, flush=True)


# ---- the summary ------------------------------------------------------------------------------


def fmt(x):
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}" if x >= 1 else f"{x:.2f}"


def cell(xs):
    if not xs:
        return "-"
    return f"{fmt(statistics.median(xs))} [{fmt(min(xs))}-{fmt(max(xs))}]"


COLUMNS = [("imports", "start (exec: interpreter + imports; fork: the fork)"),
           ("cuda_init", "CUDA init"), ("build", "meta build"), ("weights", "weights"),
           ("forward", "first forward"), ("ready", "start to weights ready"),
           ("total", "start to first forward")]


def summary(samples, a):
    good = [s for s in samples if s.get("ok") and not s.get("warmup")]
    failed = [s for s in samples if not s.get("ok")]
    out = []

    def of(mode, variant):
        return [s for s in good if s["mode"] == mode and s["variant"] == variant]

    out.append("| mode | variant | n | " + " | ".join(c for _, c in COLUMNS) + " |")
    out.append("|---|---|---|" + "---|" * len(COLUMNS))
    for mode in a.modes:
        for variant in a.variants:
            rows = of(mode, variant)
            bad = sum(1 for s in failed if s.get("mode") == mode and s["variant"] == variant)
            n = f"{len(rows)}" + (f" ({bad} FAILED)" if bad else "")
            cells = [cell([s["steps_ms"][k] for s in rows]) for k, _ in COLUMNS]
            out.append(f"| {mode} | {variant} | {n} | " + " | ".join(cells) + " |")
    out.append("")
    out.append("The weights step, part by part (ms, median [min-max]):")
    out.append("")
    out.append("| mode | variant | parts |")
    out.append("|---|---|---|")
    for mode in a.modes:
        for variant in a.variants:
            rows = of(mode, variant)
            if not rows:
                continue
            keys = list(rows[0]["parts_ms"])
            parts = "; ".join(f"{k} {cell([s['parts_ms'][k] for s in rows])}" for k in keys)
            out.append(f"| {mode} | {variant} | {parts} |")
    out.append("")
    for mode in a.modes:
        m = [s["steps_ms"]["weights"] for s in of(mode, "memd")]
        if not m:
            continue

        def ratio(b):
            """median(b) / median(m) [min(b) / max(m) - max(b) / min(m)]"""
            return (f"{fmt(statistics.median(b) / statistics.median(m))}x "
                    f"[{fmt(min(b) / max(m))}-{fmt(max(b) / min(m))}]")

        for base in [v for v in a.variants if v != "memd"]:
            b = [s["steps_ms"]["weights"] for s in of(mode, base)]
            if b:
                out.append(f"- {mode}: {base} weights / memd weights: {ratio(b)}")
        copies = [s["parts_ms"]["copy"] for s in of(mode, "pinned")]
        if copies:
            out.append(f"- {mode}: the pinned copy alone (the floor for reloading the bytes) / "
                       f"memd weights: {ratio(copies)}")
        med = statistics.median(m)
        rest = [s["steps_ms"]["total"] - s["steps_ms"]["imports"] - s["steps_ms"]["cuda_init"]
                for s in of(mode, "memd")]
        out.append(f"- {mode}: **memd: weights step <= 10 ms: "
                   f"{'pass' if med <= 10 else 'miss'}** (median {fmt(med)} ms, max "
                   f"{fmt(max(m))}); start to first forward = imports (or the fork) + CUDA "
                   f"init + {fmt(statistics.median(rest))} ms (meta build, weights, first "
                   f"forward)")
    for s in failed:
        first = (s.get("error") or "?").strip().splitlines()[-1]
        out.append(f"- FAILED: {s.get('mode')} {'warmup' if s.get('warmup') else 'round'} "
                   f"{s.get('round')} {s['variant']}: {first}")
    return "\n".join(out) + "\n"


# ---- the command line -------------------------------------------------------------------------


def default_memd():
    for path in (os.environ.get("VMM_MEMD_BIN"), ".gpu/examples/bin/vmm-memd",
                 "target/release/vmm-memd", "target/debug/vmm-memd"):
        if path and os.path.exists(os.path.join(ROOT, path)):
            return os.path.join(ROOT, path)
    return "vmm-memd"


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="role", required=True)
    run = sub.add_parser("run", help="the benchmark: service, publisher, samples, table")
    run.add_argument("--cpu", action="store_true", help="a dry run on the CPU, small model")
    run.add_argument("--memd", default=default_memd(), help="the vmm-memd binary")
    run.add_argument("--out", default=os.environ.get("OUT") or "/tmp/engine-ready")
    run.add_argument("--repeat", type=int, default=5, help="fork-mode rounds (default 5)")
    run.add_argument("--exec-repeat", type=int, default=1, help="exec-mode rounds (default 1)")
    run.add_argument("--warmup", type=int, default=1,
                     help="fork-mode rounds run first and left out of the table (default 1)")
    run.add_argument("--modes", default="fork,exec")
    run.add_argument("--variants", default=",".join(VARIANTS))
    run.add_argument("--data-dir", default="/tmp",
                     help="where the safetensors file goes (a disk, not tmpfs)")
    run.add_argument("--shm-dir", default="/dev/shm", help="where the pinned variant's file goes")
    run.add_argument("--quota-gib", type=int, default=16)
    run.add_argument("--region", default=REGION)
    run.add_argument("--sample-timeout", type=float, default=180.0)
    run.add_argument("--publish-timeout", type=float, default=420.0)
    run.add_argument("--deadline", type=float, default=540.0,
                     help="seconds: no sample starts that could end past it")
    run.add_argument("--keep-data", action="store_true")
    for name in ("publish", "engine", "forkserver"):
        role = sub.add_parser(name)
        role.add_argument("--socket", required=True)
        role.add_argument("--region", required=True)
        role.add_argument("--dir", required=True)
        role.add_argument("--report-fd", type=int, required=True)
        role.add_argument("--sample-timeout", type=float, default=180.0)
        role.add_argument("--cpu", action="store_true")
        if name == "publish":
            role.add_argument("--blob", required=True)
        if name == "engine":
            role.add_argument("--variant", choices=VARIANTS, required=True)
    a = parser.parse_args(argv)
    if a.role == "run":
        a.modes = [m for m in a.modes.split(",") if m]
        a.variants = [v for v in a.variants.split(",") if v]
        for m in a.modes:
            if m not in MODES:
                parser.error(f"unknown mode {m!r}")
        for v in a.variants:
            if v not in VARIANTS:
                parser.error(f"unknown variant {v!r}")
    return a


def run_main(a):
    def stop(signum, frame):
        raise SystemExit(f"ready.py: signal {signum}")
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGHUP, stop)
    sys.path.insert(0, os.path.join(ROOT, "python"))  # vmm_memd for the runner's own checks
    runner = Runner(a)
    error = None
    try:
        runner.run()
    except (Failed, KeyboardInterrupt, SystemExit) as e:
        error = f"{type(e).__name__}: {e}"
    except BaseException:  # noqa: BLE001 (reported, then the exit status says it)
        error = traceback.format_exc()
    finally:
        runner.cleanup()
    if error:
        runner.notes.append(f"the run stopped early: {error.strip().splitlines()[-1]}")
        runner.log(f"ERROR: {error}")
    runner.results()
    failed = [s for s in runner.samples if not s.get("ok")]
    return 1 if error or failed or not runner.samples else 0


def main(argv):
    a = parse(argv)
    if a.role == "run":
        return run_main(a)
    os.environ["VMM_READY_DEVICE"] = "cpu" if a.cpu else "cuda"
    {"publish": publish_main, "engine": engine_main, "forkserver": forkserver_main}[a.role](a)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
