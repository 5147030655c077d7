#!/usr/bin/env python3
"""vmm-memd and Dynamo's GPU Memory Service (GMS), side by side, with one workload, on one GPU.

One process per role, driven by the runner (``run``): the service under test (GMS's server CLI,
``python3 -m gpu_memory_service``, run unmodified from ``.gms-carry/``; or the ``vmm-memd``
binary), a writer and up to eight readers (long-lived workers: torch imported, CUDA
initialised, then JSON commands on stdin and replies on a private copy of stdout), and fresh
engine processes for the restart row. The runner prints a markdown table and writes it, with
every sample, as JSON.

    python3 vmm-bench/gms/compare.py run --memd .gpu/examples/bin/vmm-memd --out "$OUT"
    python3 vmm-bench/gms/compare.py run --cpu --memd target/debug/vmm-memd   # a dry run
    python3 vmm-bench/gms/compare.py shapes                                   # the workload

The workload: Llama-3-8B's tensor shapes in bf16, random bytes. ``model.embed_tokens.weight``
(128256 x 4096) first, then decoder layers in Hugging Face's order (q 4096x4096, k and v
1024x4096, o 4096x4096, gate and up 14336x4096, down 4096x14336, the two norms 4096), layer
after layer without stopping at 32, and the longest prefix that fits the size: "2 GiB" is 24
tensors (2.12 GB), "16 GiB" is 331 tensors (17.07 GB), the counts ANCHORS.md's GMS
measurements give. ``--workload model`` takes the real model instead (291 tensors, 16.06 GB:
32 layers, the final norm and an untied lm_head) for the 16 GiB rows.

How each service is driven (its own public API, nothing patched):
- GMS writer: ``GMSClientMemoryManager(socket, device)``, ``connect(RW)``, ``create_mapping(size)``
  per tensor (or once, for the one-allocation row), the fill, ``metadata_put(name,
  allocation_id, offset, TensorMetadata.from_tensor(t).to_bytes())`` per tensor, ``commit()``.
  GMS reader: ``connect(RO)``, ``GMSTensorSpec.load_all``, ``spec.materialize`` per tensor.
- vmm-memd writer: ``vmm_memd.torch.plan``, ``Client.begin_gpu``, the fill,
  ``Writer.put`` per tensor and ``Writer.commit``; reader: ``Client.connect`` and
  ``vmm_memd.torch.attach_state_dict``. The publish_state_dict row times that call whole.
- The fill is the same for both: one cuMemcpyDtoD per tensor from a source tensor on the same
  GPU, then a synchronize. "Own cost" is the publish without the fill: connect, allocate (and
  map for the writer), metadata, commit.
- "Attach" is connect to tensors ready (each a torch CUDA tensor over the service's memory), in
  a warm process; the mapping is released after each sample (GMS: ``close()``; ours: the
  tensors dropped, ``detach``, the client closed).

``--cpu`` runs every step without a GPU: vmm-memd on host regions, GMS on the fake
``cuda.bindings`` of ``cpu_fake/`` (memfd allocations), the shapes shrunk. Its numbers mean
nothing; the flows and the fault behaviours are real.
"""

import argparse
import gc
import json
import math
import os
import select
import signal
import statistics
import subprocess
import sys
import time
import traceback

PC = time.perf_counter
GIB = 1 << 30
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
GMS_COMMIT_DEFAULT = "df888f6860e247b5a16039d659db61cd64a9d2d7"

# ---- the workload ---------------------------------------------------------------------------

EMBED = ("model.embed_tokens.weight", (128256, 4096))
LAYER = (
    ("self_attn.q_proj.weight", (4096, 4096)),
    ("self_attn.k_proj.weight", (1024, 4096)),
    ("self_attn.v_proj.weight", (1024, 4096)),
    ("self_attn.o_proj.weight", (4096, 4096)),
    ("mlp.gate_proj.weight", (14336, 4096)),
    ("mlp.up_proj.weight", (14336, 4096)),
    ("mlp.down_proj.weight", (4096, 14336)),
    ("input_layernorm.weight", (4096,)),
    ("post_attention_layernorm.weight", (4096,)),
)
BF16 = 2


def _shrunk(shape, shrink):
    return tuple(max(1, d // shrink) for d in shape)


def nbytes(shape):
    return math.prod(shape) * BF16


def prefix_workload(target_bytes, shrink=1):
    """The longest prefix of (embed, layer 0, layer 1, ...) of at most ``target_bytes``:
    [(name, shape)]."""
    out, total, layer = [], 0, 0
    name, shape = EMBED[0], _shrunk(EMBED[1], shrink)
    if nbytes(shape) > target_bytes:
        return out
    out.append((name, shape))
    total += nbytes(shape)
    while True:
        for leaf, full in LAYER:
            shape = _shrunk(full, shrink)
            if total + nbytes(shape) > target_bytes:
                return out
            out.append((f"model.layers.{layer}.{leaf}", shape))
            total += nbytes(shape)
        layer += 1


def model_workload(shrink=1, layers=32):
    """Llama-3-8B itself: embed, 32 layers, the final norm, lm_head (not tied)."""
    out = [(EMBED[0], _shrunk(EMBED[1], shrink))]
    for layer in range(layers):
        out += [(f"model.layers.{layer}.{leaf}", _shrunk(s, shrink)) for leaf, s in LAYER]
    out.append(("model.norm.weight", _shrunk((4096,), shrink)))
    out.append(("lm_head.weight", _shrunk((128256, 4096), shrink)))
    return out


def workloads(kind, shrink):
    """(small, large): the "2 GiB" and "16 GiB" workloads; the small one is a prefix of the
    large one (one set of source tensors serves both)."""
    scale = shrink * shrink
    small = prefix_workload(2 * GIB // scale, shrink)
    large = prefix_workload(16 * GIB // scale, shrink) if kind == "prefix" else \
        model_workload(shrink)
    assert large[:len(small)] == small
    return small, large


def describe(shapes):
    return {"tensors": len(shapes), "bytes": sum(nbytes(s) for _, s in shapes)}


# ---- statistics and the table ---------------------------------------------------------------


def stats(samples):
    xs = sorted(samples)
    return {"n": len(xs), "median_ms": statistics.median(xs), "min_ms": xs[0], "max_ms": xs[-1],
            "samples_ms": [round(x, 3) for x in samples]}


def fmt_ms(x):
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}" if x >= 1 else f"{x:.2f}"


def fmt_cell(cell):
    if cell is None:
        return "-"
    parts = []
    if "median_ms" in cell:
        parts.append(f"{fmt_ms(cell['median_ms'])} ms [{fmt_ms(cell['min_ms'])}-"
                     f"{fmt_ms(cell['max_ms'])}] n={cell['n']}")
    if cell.get("behaviour"):
        parts.append(cell["behaviour"])
    if cell.get("error"):
        parts.append(f"FAILED: {cell['error']}")
    return "; ".join(parts) or "-"


ROWS = [
    ("publish_2g_own", "publish 2 GiB: own cost (no fill)"),
    ("publish_2g_fill", "publish 2 GiB: the fill (device copies, same for both)"),
    ("publish_16g_own", "publish 16 GiB: own cost (no fill)"),
    ("publish_16g_fill", "publish 16 GiB: the fill"),
    ("publish_16g_total", "publish 16 GiB: total (own cost + fill)"),
    ("publish_16g_sd", "publish 16 GiB: vmm_memd.torch.publish_state_dict, whole call"),
    ("publish_16g_one_own", "publish 16 GiB in one allocation (GMS) / one chunk (ours): own cost"),
    ("attach_2g", "attach alone, warm: 2 GiB"),
    ("attach_16g", "attach alone, warm: 16 GiB"),
    ("attach_16g_one", "attach alone, warm: 16 GiB in one allocation / one chunk"),
    ("attach_16g_xN", "16 GiB attached by N readers at once (each reader's time)"),
    ("restart_ready", "engine restart: kill -9 a reader, exec of a new one to tensors ready"),
    ("restart_import_torch", "engine restart, of which: import torch"),
    ("restart_cuda_init", "engine restart, of which: CUDA init (torch)"),
    ("restart_import_client", "engine restart, of which: import the service's client"),
    ("restart_attach", "engine restart, of which: attach (connect to tensors ready)"),
    ("restart_rest", "engine restart, of which: interpreter start and the rest"),
    ("fault_service_kill", "service SIGKILL: restart it; a new reader"),
    ("fault_service_kill_holder", "service SIGKILL: a reader holding the weights"),
    ("fault_writer_kill", "writer SIGKILLed mid-publish: what a new reader gets"),
    ("fault_sigstop", "a SIGSTOPped reader: is a writer (or a new reader) blocked?"),
]


def rows_for(readers):
    """ROWS with the many-readers row once per reader count."""
    out = []
    for key, label in ROWS:
        if key == "attach_16g_xN":
            out += [(f"attach_16g_x{k}", label.replace("N", str(k))) for k in readers]
        else:
            out.append((key, label))
    return out


class Results:
    def __init__(self, meta, readers):
        self.meta = meta
        self.order = rows_for(readers)
        self.rows = {key: {"label": label} for key, label in self.order}

    def cell(self, key, side):
        return self.rows[key].setdefault(side, {})

    def samples(self, key, side, values, **extra):
        cell = self.cell(key, side)
        cell.update(stats(values))
        cell.update(extra)

    def behaviour(self, key, side, text, **extra):
        cell = self.cell(key, side)
        cell["behaviour"] = text
        cell.update(extra)

    def error(self, key, side, text):
        self.cell(key, side)["error"] = text

    def table(self):
        commit = (self.meta.get("gms") or "commit ?").split()[1][:7]
        lines = [f"| row | GMS (Dynamo {commit}) | vmm-memd |", "|---|---|---|"]
        for key, label in self.order:
            row = self.rows[key]
            if "gms" not in row and "ours" not in row:
                continue
            lines.append(f"| {label} | {fmt_cell(row.get('gms'))} | {fmt_cell(row.get('ours'))} |")
        return "\n".join(lines)

    def json(self):
        return {"meta": self.meta, "rows": self.rows}


# ---- the runner's side of a child -----------------------------------------------------------


def since(t0, reply):
    """Milliseconds from the runner's ``t0`` to the moment a role said it was ready: the role's
    own ``ready_at`` (perf_counter is CLOCK_MONOTONIC, one clock for every process of the
    machine), unless that is not plausible; then until the reply arrived."""
    now = PC()
    at = reply.get("ready_at")
    if at is not None and t0 <= at <= now:
        return (at - t0) * 1000
    return (now - t0) * 1000


class ChildError(RuntimeError):
    pass


class Child:
    """A role process: JSON commands to its stdin, JSON replies from its stdout (its stderr is
    the runner's)."""

    def __init__(self, name, argv, env):
        self.name = name
        self.started = PC()
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                                  bufsize=0, cwd=ROOT)
        self.buf = b""

    @property
    def pid(self):
        return self.p.pid

    def send(self, obj):
        self.p.stdin.write(json.dumps(obj).encode() + b"\n")

    def recv(self, timeout=120.0):
        deadline = PC() + timeout
        fd = self.p.stdout.fileno()
        while b"\n" not in self.buf:
            left = deadline - PC()
            if left <= 0:
                raise ChildError(f"{self.name}: no reply within {timeout:.0f} s")
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            data = os.read(fd, 1 << 16)
            if not data:
                rc = self.p.wait(timeout=5)
                raise ChildError(f"{self.name} (pid {self.pid}) exited with {rc}")
            self.buf += data
        line, self.buf = self.buf.split(b"\n", 1)
        reply = json.loads(line)
        if "error" in reply:
            sys.stderr.write(f"[{self.name}] {reply.get('trace', '')}\n")
            raise ChildError(f"{self.name}: {reply['error']}")
        return reply

    def call(self, obj, timeout=120.0):
        self.send(obj)
        return self.recv(timeout)

    def signal(self, sig):
        if self.p.poll() is None:
            os.kill(self.p.pid, sig)

    def kill9(self):
        self.signal(signal.SIGKILL)
        self.p.wait()

    def close(self):
        if self.p.poll() is None:
            try:
                self.p.stdin.close()  # EOF: a worker exits
                self.p.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.kill9()


# ---- the services ---------------------------------------------------------------------------


class GmsServer:
    """GMS's own server CLI: ``python3 -m gpu_memory_service --device N --socket-path P``."""

    side = "gms"

    def __init__(self, args, env):
        self.args, self.env = args, env
        self.path = os.path.join(args.tmp, f"gms-bench-{os.getpid()}.sock")
        self.p = None

    def start(self, timeout=60.0):
        argv = [sys.executable, "-m", "gpu_memory_service", "--device", str(self.args.device),
                "--socket-path", self.path]
        t0 = PC()
        self.p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=sys.stderr.fileno(),
                                  env=self.env, cwd=ROOT)
        while PC() - t0 < timeout:
            if self.p.poll() is not None:
                raise ChildError(f"GMS server exited with {self.p.returncode}")
            if self.state() is not None:
                return (PC() - t0) * 1000
            time.sleep(0.005)
        raise ChildError("GMS server not up in time")

    def state(self):
        """GMS's runtime-state probe (outside its lock FSM): a dict, or None if nobody
        answers at the socket."""
        import socket as so
        from gpu_memory_service.common.protocol.messages import GetRuntimeStateRequest
        from gpu_memory_service.common.protocol.wire import recv_message_sync, send_message_sync
        s = so.socket(so.AF_UNIX, so.SOCK_STREAM)
        s.settimeout(2.0)
        try:
            s.connect(self.path)
            send_message_sync(s, GetRuntimeStateRequest())
            msg, _, _ = recv_message_sync(s, bytearray())
            return {"state": msg.state, "committed": msg.committed,
                    "allocations": msg.allocation_count, "readers": msg.ro_session_count,
                    "writer": msg.has_rw_session, "waiting_writers": msg.waiting_writers}
        except OSError:
            return None
        finally:
            s.close()

    def kill9(self):
        os.kill(self.p.pid, signal.SIGKILL)
        self.p.wait()

    def stop(self):
        if self.p is not None and self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.kill9()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class MemdServer:
    """The vmm-memd binary, on an abstract socket, with its keeper."""

    side = "ours"

    def __init__(self, args, env):
        self.args, self.env = args, env
        self.name = f"@memd-bench-{os.getpid()}"
        self.p = None

    def start(self, timeout=60.0):
        import vmm_memd
        argv = [self.args.memd, "--socket", self.name, "--quota-bytes", str(self.args.quota_gib * GIB),
                "--keeper-linger-ms", "120000"]
        t0 = PC()
        self.p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=sys.stderr.fileno(),
                                  env=self.env, cwd=ROOT)
        while PC() - t0 < timeout:
            if self.p.poll() is not None:
                raise ChildError(f"vmm-memd exited with {self.p.returncode}")
            try:
                vmm_memd.Client.connect(self.name, timeout=2.0).close()
                return (PC() - t0) * 1000
            except vmm_memd.MemdError:
                time.sleep(0.005)
        raise ChildError("vmm-memd not up in time")

    def kill9(self):
        os.kill(self.p.pid, signal.SIGKILL)
        self.p.wait()

    def _keepers(self):
        """Pids of this service's keeper (``vmm-memd --keeper NAME``, started by the service in
        its own session), by its exact command line."""
        exe = os.path.realpath(self.args.memd)
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
            except OSError:
                continue
            if b"--keeper" in argv and any(a.endswith(self.name[1:].encode()) for a in argv):
                try:
                    if os.path.realpath(f"/proc/{entry}/exe") != exe:
                        continue
                except OSError:
                    continue
                found.append(int(entry))
        return found

    def stop(self):
        if self.p is not None and self.p.poll() is None:
            self.p.terminate()  # tells the keeper to let everything go
            try:
                self.p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.kill9()
        deadline = PC() + 3
        while self._keepers() and PC() < deadline:
            time.sleep(0.05)
        for pid in self._keepers():
            sys.stderr.write(f"compare: keeper {pid} still there; SIGKILL\n")
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


# ---- the role processes ---------------------------------------------------------------------


def role_env(args):
    env = dict(os.environ)
    paths = [os.path.join(ROOT, "python"), args.gms_carry]
    if args.cpu:
        paths.insert(0, os.path.join(HERE, "cpu_fake"))
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("VMM_MEMD_LOG", "warn")
    return env


def role_argv(args, role, *extra):
    argv = [sys.executable, os.path.abspath(__file__), role, "--device", str(args.device),
            "--shrink", str(args.shrink), "--workload", args.workload]
    if args.cpu:
        argv.append("--cpu")
    return argv + list(extra)


class Phase:
    """Everything one service's rows need: the service, a writer, readers."""

    def __init__(self, runner, server):
        self.r, self.s = runner, server
        self.side = server.side
        self.writer, self.readers = None, []
        self.marker = 0

    def next_marker(self):
        self.marker += 1
        return self.marker + (100 if self.side == "ours" else 0)

    def target(self, **kw):
        if self.side == "gms":
            return dict(service="gms", socket=self.s.path, **kw)
        return dict(service="ours", socket=self.s.name, **kw)


class Runner:
    def __init__(self, args):
        self.args = args
        self.env = role_env(args)
        self.t0 = PC()
        small, large = workloads(args.workload, args.shrink)
        self.n_small, self.n_large = len(small), len(large)
        self.results = Results(self.meta(small, large), args.readers)

    def left(self):
        return self.args.deadline - (PC() - self.t0)

    def log(self, text):
        sys.stderr.write(f"[compare {PC() - self.t0:7.1f}s] {text}\n")
        sys.stderr.flush()

    def meta(self, small, large):
        meta = {"mode": "cpu dry run (numbers mean nothing)" if self.args.cpu else "gpu",
                "device": self.args.device, "repeat": self.args.repeat,
                "restart_repeat": self.args.restart_repeat,
                "rounds": self.args.rounds, "wait_s": self.args.wait_s,
                "workload": {"kind": self.args.workload, "shrink": self.args.shrink,
                             "2GiB": describe(small), "16GiB": describe(large),
                             "dtype": "bfloat16"},
                "python": sys.version.split()[0], "memd": self.args.memd}
        commit_file = os.path.join(self.args.gms_carry, "COMMIT")
        if os.path.exists(commit_file):
            with open(commit_file) as f:
                meta["gms"] = f.read().strip()
        for name in (os.path.join(ROOT, ".gpu", "COMMIT"),):
            if os.path.exists(name):
                with open(name) as f:
                    meta["vmm_ipc_commit"] = f.read().strip()
        try:
            meta["gpu"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                 "--format=csv,noheader"], capture_output=True, text=True,
                timeout=20).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            meta["gpu"] = None
        return meta

    # -- orchestration --

    def run(self):
        sides = ["gms", "ours"] if self.args.only is None else [self.args.only]
        for side in sides:
            if self.left() < 30:
                self.log(f"deadline: {side} not run")
                continue
            server = GmsServer(self.args, self.env) if side == "gms" else \
                MemdServer(self.args, self.env)
            phase = Phase(self, server)
            try:
                self.run_phase(phase)
            except Exception as e:  # noqa: BLE001 (the other service still runs)
                traceback.print_exc()
                self.results.meta.setdefault("phase_errors", {})[side] = repr(e)
            finally:
                self.teardown(phase)
        self.results.meta["elapsed_s"] = round(PC() - self.t0, 1)
        return self.results

    def start_pool(self, phase, readers):
        t0 = PC()
        children = [Child(f"{phase.side}-writer", role_argv(self.args, "worker"), self.env)]
        children += [Child(f"{phase.side}-reader{i}", role_argv(self.args, "worker"), self.env)
                     for i in range(readers)]
        started = [c.recv(timeout=300) for c in children]
        phase.writer, phase.readers = children[0], children[1:]
        self.log(f"{phase.side}: {len(children)} workers ready in {PC() - t0:.1f} s "
                 f"(import torch {started[0]['import_torch_ms']:.0f} ms, "
                 f"CUDA init {started[0]['cuda_init_ms']:.0f} ms)")
        self.results.meta.setdefault("pool", {})[phase.side] = {
            "workers": len(children), "ready_s": round(PC() - t0, 2), "first": started[0]}

    def teardown(self, phase):
        for c in ([phase.writer] if phase.writer else []) + phase.readers:
            try:
                c.close()
            except Exception:  # noqa: BLE001
                c.kill9()
        phase.s.stop()

    def row(self, key, phase, fn):
        """Run one row's function; a failure is recorded in the row and the run goes on."""
        if self.left() < 15:
            self.results.error(key, phase.side, "not run: deadline")
            return None
        self.log(f"{phase.side}: {key}")
        try:
            return fn()
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            self.results.error(key, phase.side, repr(e)[:300])
            self.recover(phase)
            return None

    def recover(self, phase):
        """After a failed row: every reader holds nothing, and a role that died (GMS's client
        exits the process on a CUDA error) is replaced, so the rows after still run."""
        for c in phase.readers:
            if c.p.poll() is None:
                try:
                    c.signal(signal.SIGCONT)
                    c.call({"op": "release"}, timeout=60)
                except Exception:  # noqa: BLE001
                    c.kill9()
        for i, c in enumerate([phase.writer] + phase.readers):
            if c.p.poll() is None:
                continue
            self.log(f"{c.name} died ({c.p.returncode}): replacing it")
            fresh = Child(c.name, role_argv(self.args, "worker"), self.env)
            try:
                fresh.recv(timeout=300)
                if i == 0:
                    fresh.call({"op": "sources", "count": self.n_large}, timeout=300)
            except ChildError as e:
                self.log(f"{c.name}: no replacement: {e}")
                continue
            if i == 0:
                phase.writer = fresh
            else:
                phase.readers[i - 1] = fresh

    def run_phase(self, phase):
        a = self.args
        started = PC()
        up_ms = phase.s.start()
        self.results.meta.setdefault("service_start_ms", {})[phase.side] = round(up_ms, 1)
        self.start_pool(phase, max(max(a.readers), 3))  # the fault rows use three
        w = phase.writer
        src = w.call({"op": "sources", "count": self.n_large}, timeout=300)
        self.log(f"{phase.side}: sources {src['tensors']} tensors, {src['bytes'] / 1e9:.2f} GB "
                 f"in {src['ms']:.0f} ms")
        region2, region16, region1 = "bench-2g", "bench-16g", "bench-16g-one"

        # publish and attach, 2 GiB
        self.row("publish_2g_own", phase, lambda: self.publish_rows(
            phase, "2g", self.n_small, region2, "tensor"))
        self.settle(phase, region2)
        self.row("attach_2g", phase, lambda: self.attach_row(phase, "attach_2g", region2))
        if phase.side == "ours":
            self.row("publish_2g_own", phase, lambda: self.delete(phase, region2))
        # publish and attach, 16 GiB
        self.row("publish_16g_own", phase, lambda: self.publish_rows(
            phase, "16g", self.n_large, region16, "tensor"))
        if phase.side == "ours":
            self.row("publish_16g_sd", phase, lambda: self.publish_sd_row(phase, region16))
        self.settle(phase, region16)
        self.row("attach_16g", phase, lambda: self.attach_row(phase, "attach_16g", region16))
        for k in a.readers:
            self.row(f"attach_16g_x{k}", phase, lambda k=k: self.concurrent_row(phase, k, region16))
        # one allocation / one chunk
        self.row("publish_16g_one_own", phase, lambda: self.publish_rows(
            phase, "16g_one", self.n_large, region1, "one"))
        self.settle(phase, region1)
        self.row("attach_16g_one", phase, lambda: self.attach_row(phase, "attach_16g_one", region1))
        if phase.side == "ours":
            self.row("publish_16g_one_own", phase, lambda: self.delete(phase, region1))
        else:  # GMS has one layout: the per-tensor one again for the rows that follow
            self.row("publish_16g_own", phase, lambda: self.publish(phase, self.n_large, region16))
        # faults
        if not a.skip_restart:
            self.row("restart_ready", phase, lambda: self.restart_row(phase, region16))
        if not a.skip_faults:
            self.row("fault_sigstop", phase, lambda: self.sigstop_row(phase, region16))
            self.row("fault_service_kill", phase, lambda: self.service_kill_row(phase, region16))
            self.row("fault_writer_kill", phase, lambda: self.writer_kill_row(phase, region16))
        self.results.meta.setdefault("phase_s", {})[phase.side] = round(PC() - started, 1)

    # -- rows --

    def publish(self, phase, count, region, layout="tensor", **kw):
        marker = phase.next_marker()
        reply = phase.writer.call({"op": "publish", **phase.target(region=region), "count": count,
                                   "layout": layout, "marker": marker, **kw}, timeout=600)
        reply["marker"] = marker
        return reply

    def publish_rows(self, phase, size, count, region, layout):
        replies = [self.publish(phase, count, region, layout) for _ in range(self.args.repeat)]
        parts = ("connect_ms", "alloc_ms", "unmap_ms", "meta_ms", "commit_ms")
        detail = {p: stats([r[p] for r in replies]) for p in parts if p in replies[0]}
        self.results.samples(f"publish_{size}_own", phase.side, [r["own_ms"] for r in replies],
                             parts=detail, tensors=replies[0]["count"],
                             bytes=replies[0]["bytes"], allocations=replies[0]["allocations"])
        if layout == "tensor":
            self.results.samples(f"publish_{size}_fill", phase.side,
                                 [r["fill_ms"] for r in replies])
        if size == "16g" and layout == "tensor":
            self.results.samples("publish_16g_total", phase.side,
                                 [r["total_ms"] for r in replies])
        return replies[-1]

    def publish_sd_row(self, phase, region):
        samples = []
        for _ in range(self.args.repeat):
            reply = phase.writer.call({"op": "publish_sd", **phase.target(region=region),
                                       "count": self.n_large, "marker": phase.next_marker()},
                                      timeout=600)
            samples.append(reply["total_ms"])
        self.results.samples("publish_16g_sd", phase.side, samples,
                             note="connect + publish_state_dict (plan, begin_gpu, copies, "
                                  "metadata, commit)")

    def settle(self, phase, region):
        """vmm-memd digests a GPU generation in a background pass after its commit (about
        1.2 GB/s); the attach rows measure a service that is done with it: a Verify waits for
        the digests (it takes them itself if the pass has not)."""
        if phase.side != "ours" or not self.args.settle or self.left() < 60:
            return
        try:
            reply = phase.writer.call({"op": "verify", **phase.target(region=region)},
                                      timeout=600)
        except ChildError as e:
            self.log(f"ours: verify {region}: {e}")
            return
        self.log(f"ours: {region} verified (digests) in {reply['ms']:.0f} ms")
        self.results.meta.setdefault("ours_verify_before_attach_ms", {})[region] = \
            round(reply["ms"], 1)

    def delete(self, phase, region):
        phase.writer.call({"op": "delete", **phase.target(region=region)})

    def attach_row(self, phase, key, region):
        reader = phase.readers[0]
        cmd = {"op": "attach", **phase.target(region=region), "wait_ms": 60000}
        warm = reader.call({**cmd, "breakdown": phase.side == "ours"})  # not counted
        replies = [reader.call(cmd) for _ in range(self.args.repeat)]
        self.results.samples(key, phase.side, [r["attach_ms"] for r in replies],
                             parts={p: stats([r[p] for r in replies])
                                    for p in ("connect_ms", "map_ms")},
                             breakdown=warm.get("breakdown"),
                             tensors=replies[0]["count"], mappings=replies[0]["mappings"],
                             markers=sorted({r["marker"] for r in replies}))

    def concurrent_row(self, phase, k, region):
        readers = phase.readers[:k]
        if len(readers) < k:
            raise ChildError(f"{k} readers wanted, {len(readers)} started")
        samples, slowest, walls, skews = [], [], [], []
        cmd = {"op": "attach", **phase.target(region=region), "wait_ms": 60000, "hold": True}
        for c in readers:  # each reader warm for this region
            c.call({**cmd, "hold": False})
        for _ in range(self.args.rounds):
            t0 = PC()
            for c in readers:
                c.send({**cmd, "start_at": t0 + 0.05})
            replies = [c.recv() for c in readers]
            walls.append((PC() - t0) * 1000 - 50)
            samples += [r["attach_ms"] for r in replies]
            slowest.append(max(r["attach_ms"] for r in replies))
            skews += [r.get("start_skew_ms") for r in replies]
            for c in readers:
                c.call({"op": "release"})
        self.results.samples(f"attach_16g_x{k}", phase.side, samples,
                             slowest_reader=stats(slowest), wall_from_start=stats(walls),
                             start_skew_ms=skews)

    def restart_row(self, phase, region):
        a = self.args
        argv = role_argv(a, "engine", "--service", phase.side, "--socket",
                         phase.s.path if phase.side == "gms" else phase.s.name,
                         "--region", region)
        engine = Child(f"{phase.side}-engine0", argv, self.env)
        first = engine.recv(timeout=300)
        first["exec_to_ready_ms"] = since(engine.started, first)
        runs = []
        try:
            for i in range(a.restart_repeat):
                engine.kill9()
                engine = Child(f"{phase.side}-engine{i + 1}", argv, self.env)
                ready = engine.recv(timeout=300)
                ready["exec_to_ready_ms"] = since(engine.started, ready)
                runs.append(ready)
        finally:
            engine.kill9()
        side = phase.side
        self.results.samples("restart_ready", side, [r["exec_to_ready_ms"] for r in runs],
                             first_start=first, markers=sorted({r["marker"] for r in runs}))
        for key, part in (("restart_import_torch", "import_torch_ms"),
                          ("restart_cuda_init", "cuda_init_ms"),
                          ("restart_import_client", "import_client_ms"),
                          ("restart_attach", "attach_ms")):
            self.results.samples(key, side, [r[part] for r in runs])
        self.results.samples("restart_rest", side, [
            r["exec_to_ready_ms"] - r["import_torch_ms"] - r["cuda_init_ms"]
            - r["import_client_ms"] - r["attach_ms"] for r in runs])

    def sigstop_row(self, phase, region):
        a = self.args
        holder, other = phase.readers[0], phase.readers[1]
        held = holder.call({"op": "attach", **phase.target(region=region), "wait_ms": 60000,
                            "hold": True})
        holder.signal(signal.SIGSTOP)
        try:
            marker = phase.next_marker()
            t0 = PC()
            phase.writer.send({"op": "publish", **phase.target(region=region),
                               "count": self.n_large, "layout": "tensor", "marker": marker,
                               "wait_ms": int(a.wait_s * 1000)})
            time.sleep(0.2)  # the writer is connected or waiting: now a new reader
            newcomer = other.call({"op": "attach", **phase.target(region=region),
                                   "wait_ms": int(a.wait_s * 1000 / 2), "hold": False})
            writer = phase.writer.recv(timeout=a.wait_s + 600)
            writer_ms = (PC() - t0) * 1000
        finally:
            holder.signal(signal.SIGCONT)
        holder.call({"op": "release"})
        if writer.get("blocked"):
            text = (f"writer blocked: its connect(RW) timed out after {writer['waited_ms']:.0f} ms "
                    f"(the stopped reader holds the RO lock)")
        else:
            text = (f"writer not blocked: committed the next generation "
                    f"({writer.get('generation', 'marker ' + str(marker))}) in "
                    f"{writer_ms:.0f} ms while the reader was stopped")
        if newcomer.get("ready"):
            text += (f"; a new reader meanwhile attached in {newcomer['attach_ms']:.1f} ms "
                     f"(marker {newcomer['marker']})")
        else:
            text += (f"; a new reader meanwhile was blocked too (timed out after "
                     f"{newcomer['waited_ms']:.0f} ms)")
        self.results.behaviour("fault_sigstop", phase.side, text, writer=writer,
                               new_reader=newcomer, held_marker=held["marker"])

    def service_kill_row(self, phase, region):
        a = self.args
        holder, newcomer = phase.readers[0], phase.readers[1]
        held = holder.call({"op": "attach", **phase.target(region=region), "wait_ms": 60000,
                            "hold": True})
        phase.s.kill9()
        after_kill = holder.call({"op": "read_markers"})
        t0 = PC()
        phase.s.p = None
        phase.s.start()
        up_ms = (PC() - t0) * 1000
        state = phase.s.state() if phase.side == "gms" else None
        ready = newcomer.call({"op": "attach_until_ready", **phase.target(region=region),
                               "wait_ms": int(a.wait_s * 1000), "hold": False},
                              timeout=a.wait_s + 120)
        ready_ms = since(t0, ready)
        after_restart = holder.call({"op": "read_markers"})
        holder.call({"op": "release"})
        kept = after_kill["markers"] == [held["marker"]] == after_restart["markers"]
        self.results.behaviour(
            "fault_service_kill_holder", phase.side,
            f"keeps reading: marker {held['marker']} after the kill and after the restart"
            if kept else f"marker {held['marker']} held; read {after_kill['markers']} after the "
                         f"kill, {after_restart['markers']} after the restart",
            held=held["marker"], after_kill=after_kill, after_restart=after_restart)
        if ready.get("ready"):
            text = (f"served again: a new reader had the weights (marker {ready['marker']}, "
                    f"generation {ready.get('generation', '-')}) {ready_ms:.0f} ms after the "
                    f"service's exec (service up in {up_ms:.0f} ms; attach "
                    f"{ready['attach_ms']:.1f} ms)")
            self.results.samples("fault_service_kill", phase.side, [ready_ms],
                                 behaviour=text, detail=ready, restarted_state=state)
        else:
            text = (f"restarts empty (state {state['state'] if state else '?'}): a new reader "
                    f"got nothing; its connect(RO) timed out after {ready['waited_ms']:.0f} ms "
                    f"(GMS's default is to wait for ever); service up in {up_ms:.0f} ms")
            self.results.behaviour("fault_service_kill", phase.side, text, detail=ready,
                                   restarted_state=state)

    def writer_kill_row(self, phase, region):
        a = self.args
        victim = phase.readers[-1]  # not readers[0] or [1], which the other rows use
        reader = phase.readers[1]
        good = self.publish(phase, self.n_large, region)  # the last good generation
        victim.call({"op": "sources", "count": self.n_large}, timeout=300)
        paused = victim.call({"op": "publish", **phase.target(region=region), "count": self.n_large,
                              "layout": "tensor", "marker": phase.next_marker(),
                              "pause_after": self.n_large // 2, "wait_ms": 60000}, timeout=600)
        during = phase.s.state() if phase.side == "gms" else None
        victim.kill9()
        phase.readers.remove(victim)
        time.sleep(0.05)
        after = phase.s.state() if phase.side == "gms" else None
        got = reader.call({"op": "attach", **phase.target(region=region),
                           "wait_ms": int(a.wait_s * 1000), "hold": False},
                          timeout=a.wait_s + 120)
        if got.get("ready") and got["marker"] == good["marker"]:
            text = (f"alive: a new reader got the last good generation "
                    f"({got.get('generation', 'marker ' + str(got['marker']))}) in "
                    f"{got['attach_ms']:.1f} ms")
        elif got.get("ready"):
            text = f"served marker {got['marker']}, not the last good one ({good['marker']})"
        else:
            text = (f"lost: no committed layout (state "
                    f"{during['state'] if during else '?'} while the writer filled, committed="
                    f"{during['committed'] if during else '?'}; after its death "
                    f"{after['state'] if after else '?'}); a new reader's connect(RO) timed out "
                    f"after {got['waited_ms']:.0f} ms")
        self.results.behaviour("fault_writer_kill", phase.side, text, good=good["marker"],
                               paused=paused, state_during=during, state_after=after,
                               new_reader=got)


# ---- the worker and the engine (role processes) ---------------------------------------------


class Proto:
    """A role's replies go to a private copy of its stdout; fd 1 becomes stderr, so nothing a
    library prints can break the protocol."""

    def __init__(self):
        self.out = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)
        sys.stdout = sys.stderr

    def reply(self, obj):
        self.out.write(json.dumps(obj) + "\n")
        self.out.flush()


def ms(seconds):
    return seconds * 1000.0


class Role:
    """What a worker or an engine does: sources, publish, attach, for either service."""

    def __init__(self, args, proto):
        self.args, self.proto = args, proto
        self.cpu, self.device = args.cpu, args.device
        t0 = PC()
        import torch
        self.torch = torch
        t1 = PC()
        if not self.cpu:
            torch.cuda.set_device(self.device)
            torch.zeros(1, device=f"cuda:{self.device}")
            torch.cuda.synchronize()
        t2 = PC()
        self.timing = {"import_torch_ms": ms(t1 - t0), "cuda_init_ms": ms(t2 - t1)}
        self.sources = []
        self.held = []
        self._gms = self._memd = None
        small, large = workloads(args.workload, args.shrink)
        self.shapes = large

    # -- clients, imported when first used --

    def gms(self):
        if self._gms is None:
            from types import SimpleNamespace
            from gpu_memory_service.client.memory_manager import GMSClientMemoryManager
            from gpu_memory_service.client.torch.tensor import GMSTensorSpec, TensorMetadata
            from gpu_memory_service.common.locks import GrantedLockType, RequestedLockType
            from cuda.bindings import driver
            self._gms = SimpleNamespace(Manager=GMSClientMemoryManager, Spec=GMSTensorSpec,
                                        Meta=TensorMetadata, RO=RequestedLockType.RO,
                                        RW=RequestedLockType.RW, GRANTED_RW=GrantedLockType.RW,
                                        cu=driver)
        return self._gms

    def memd(self):
        if self._memd is None:
            import vmm_memd
            from vmm_memd import torch as memd_torch
            if not self.cpu:
                import vmm_ipc_cuda  # noqa: F401 (cuda.bindings: imported once, here)
            self._memd = (vmm_memd, memd_torch)
        return self._memd

    def sync(self):
        if not self.cpu:
            self.torch.cuda.synchronize()

    # -- commands --

    def op_sources(self, c):
        torch = self.torch
        self.sources = []
        gc.collect()
        t0 = PC()
        device = "cpu" if self.cpu else f"cuda:{self.device}"
        for name, shape in self.shapes[:c["count"]]:
            t = torch.empty(shape, dtype=torch.bfloat16, device=device)
            t.view(torch.int16).random_(-32768, 32767)
            self.sources.append((name, t))
        self.sync()
        return {"tensors": len(self.sources), "ms": ms(PC() - t0),
                "bytes": sum(t.numel() * t.element_size() for _, t in self.sources)}

    def set_marker(self, marker):
        self.sources[0][1].view(self.torch.int16).view(-1)[0] = marker
        self.sync()

    def pause(self, info):
        """Tell the runner the publish is half done, then wait to be killed."""
        self.proto.reply({"paused": True, **info})
        while sys.stdin.readline():
            pass
        os._exit(3)

    def op_publish(self, c):
        self.set_marker(c["marker"])
        items = self.sources[:c["count"]]
        if c["service"] == "gms":
            return self.gms_publish(c, items)
        return self.ours_publish(c, items)

    def gms_publish(self, c, items):
        g = self.gms()
        t0 = PC()
        mgr = g.Manager(c["socket"], device=self.device)
        try:
            mgr.connect(g.RW, timeout_ms=c.get("wait_ms"))
        except TimeoutError as e:
            return {"blocked": True, "waited_ms": ms(PC() - t0), "why": str(e)}
        if mgr.granted_lock_type != g.GRANTED_RW:
            raise RuntimeError(f"asked for RW, granted {mgr.granted_lock_type}")
        t1 = PC()
        places = []  # (address, allocation id, offset)
        if c["layout"] == "one":
            offsets, total = [], 0
            for _, t in items:
                total = -(-total // 256) * 256
                offsets.append(total)
                total += t.numel() * t.element_size()
            va = mgr.create_mapping(size=total, tag="weights")
            aid = mgr.mappings[va].allocation_id
            places = [(va + off, aid, off) for off in offsets]
        else:
            for _, t in items:
                va = mgr.create_mapping(size=t.numel() * t.element_size(), tag="weights")
                places.append((va, mgr.mappings[va].allocation_id, 0))
        t2 = PC()
        for i, ((_, t), (address, _, _)) in enumerate(zip(items, places)):
            if c.get("pause_after") == i:
                self.sync()
                self.pause({"filled": i, "of": len(items)})
            self.copy_to(address, t)
        self.sync()
        t3 = PC()
        for (name, t), (_, aid, off) in zip(items, places):
            mgr.metadata_put(name, aid, off, g.Meta.from_tensor(t).to_bytes())
        t4 = PC()
        mgr.commit()
        t5 = PC()
        mgr.close()  # frees the writer's address reservations (not timed)
        return {"connect_ms": ms(t1 - t0), "alloc_ms": ms(t2 - t1), "fill_ms": ms(t3 - t2),
                "meta_ms": ms(t4 - t3), "commit_ms": ms(t5 - t4),
                "own_ms": ms((t2 - t0) + (t5 - t3)), "total_ms": ms(t5 - t0),
                "count": len(items), "allocations": len(places if c["layout"] != "one" else [1]),
                "bytes": sum(t.numel() * t.element_size() for _, t in items)}

    def copy_to(self, address, t):
        """The fill, for GMS: one driver copy per tensor (the fake's host-to-"device" copy on
        --cpu)."""
        cu = self.gms().cu
        n = t.numel() * t.element_size()
        if self.cpu:
            result = cu.cuMemcpyHtoD(address, t.data_ptr(), n)[0]
        else:
            result = cu.cuMemcpyDtoD(address, t.data_ptr(), n)[0]
        if result != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuMemcpy: {result}")

    def ours_publish(self, c, items):
        import ctypes
        m, mt = self.memd()
        entries = [mt.Item(name, t.numel() * t.element_size(), mt.dtype_of(name, t.dtype),
                           tuple(t.shape)) for name, t in items]
        chunk_bytes = 1 << 40 if c["layout"] == "one" else mt.DEFAULT_CHUNK_BYTES
        wait = c.get("wait_ms", 0) / 1000.0
        t0 = PC()
        client = m.Client.connect(c["socket"])
        try:
            tc = PC()
            layout = mt.plan(entries, chunk_bytes=chunk_bytes)
            try:
                if self.cpu:
                    writer = client.begin(c["region"], layout.chunks, wait=wait)
                else:
                    writer = client.begin_gpu(c["region"], layout.chunks, device=self.device,
                                              wait=wait)
            except m.WriterBusy as e:
                return {"blocked": True, "waited_ms": ms(PC() - t0), "why": str(e)}
            t1 = PC()
            for k, (index, meta) in enumerate(layout.copies):
                if c.get("pause_after") == k:
                    self.sync()
                    self.pause({"filled": k, "of": len(layout.copies),
                                "generation": writer.generation})
                t = items[index][1]
                if self.cpu:
                    data = (ctypes.c_ubyte * meta.len).from_address(t.data_ptr())
                    writer.chunk(meta.chunk)[meta.offset:meta.offset + meta.len] = data
                    del data
                else:
                    writer.copy_from_device(meta.chunk, meta.offset, t.data_ptr(), meta.len)
            self.sync()
            t2 = PC()
            # Writer.commit's three steps, timed apart: the writer's unmap, the metadata
            # requests, the commit's round trip.
            writer._unmap()
            tu = PC()
            client.put_meta(layout.meta)
            writer._meta_sent = True
            tm = PC()
            generation = client.commit_pending(mt.commit_timeout_for(sum(layout.chunks)))
            writer.finished = True
            t3 = PC()
        finally:
            client.close()
        return {"connect_ms": ms(tc - t0), "alloc_ms": ms(t1 - tc), "fill_ms": ms(t2 - t1),
                "unmap_ms": ms(tu - t2), "meta_ms": ms(tm - tu), "commit_ms": ms(t3 - tm),
                "own_ms": ms((t1 - t0) + (t3 - t2)),
                "total_ms": ms(t3 - t0), "count": len(items), "allocations": len(layout.chunks),
                "generation": generation,
                "bytes": sum(t.numel() * t.element_size() for _, t in items)}

    def op_publish_sd(self, c):
        m, mt = self.memd()
        self.set_marker(c["marker"])
        state = dict(self.sources[:c["count"]])
        t0 = PC()
        with m.Client.connect(c["socket"]) as client:
            generation = mt.publish_state_dict(client, c["region"], state,
                                               device="cpu" if self.cpu else self.device)
        return {"total_ms": ms(PC() - t0), "generation": generation}

    def op_verify(self, c):
        m, _ = self.memd()
        t0 = PC()
        with m.Client.connect(c["socket"], timeout=600.0) as client:
            client.verify(c["region"])
        return {"ms": ms(PC() - t0)}

    def op_delete(self, c):
        m, _ = self.memd()
        with m.Client.connect(c["socket"]) as client:
            client.delete(c["region"])
        return {}

    def op_attach(self, c):
        start_at = c.get("start_at")
        skew = None
        if start_at is not None:
            delay = start_at - PC()
            if 0 < delay < 2:  # the runner's clock is this one (CLOCK_MONOTONIC)
                time.sleep(delay)
            skew = ms(PC() - start_at)
        if c["service"] == "gms":
            reply = self.gms_attach(c)
        else:
            reply = self.ours_attach(c)
        reply["start_skew_ms"] = skew
        return reply

    def gms_attach(self, c):
        g = self.gms()
        t0 = PC()
        mgr = g.Manager(c["socket"], device=self.device)
        try:
            mgr.connect(g.RO, timeout_ms=c.get("wait_ms"))
        except TimeoutError as e:
            return {"ready": False, "waited_ms": ms(PC() - t0), "why": str(e)}
        t1 = PC()
        specs = g.Spec.load_all(mgr)
        t2 = PC()
        if self.cpu:  # materialize without the CUDA tensor: the same mapping, an address
            tensors = {name: mgr.create_mapping(allocation_id=spec.allocation_id)
                       + spec.offset_bytes for name, spec in specs.items()}
        else:
            tensors = {name: spec.materialize(mgr, self.device) for name, spec in specs.items()}
        t3 = PC()
        marker = self.gms_marker(tensors)
        reply = {"ready": True, "ready_at": t3, "connect_ms": ms(t1 - t0), "metadata_ms": ms(t2 - t1),
                 "map_ms": ms(t3 - t1), "attach_ms": ms(t3 - t0), "count": len(tensors),
                 "mappings": len(mgr.mappings), "marker": marker}
        self.hold_or_release(c, ("gms", mgr, tensors))
        return reply

    def gms_marker(self, tensors):
        first = tensors[self.shapes[0][0]]
        if self.cpu:
            import ctypes
            value = ctypes.c_int16()
            self.gms().cu.cuMemcpyDtoH(ctypes.addressof(value), first, 2)
            return value.value
        return int(first.view(self.torch.int16).reshape(-1)[0].item())

    def ours_attach(self, c):
        m, mt = self.memd()
        t0 = PC()
        client = m.Client.connect(c["socket"])
        t1 = PC()
        try:
            attached, tensors = mt.attach_state_dict(client, c["region"])
        except BaseException:
            client.close()
            raise
        t2 = PC()
        marker = int(tensors[self.shapes[0][0]].view(self.torch.int16).reshape(-1)[0].item())
        reply = {"ready": True, "ready_at": t2, "connect_ms": ms(t1 - t0), "map_ms": ms(t2 - t1),
                 "attach_ms": ms(t2 - t0), "count": len(tensors),
                 "mappings": len(attached.chunks), "marker": marker,
                 "generation": attached.generation}
        if c.get("breakdown"):
            reply["breakdown"] = self.ours_attach_breakdown(client, c["region"], attached)
        self.hold_or_release(c, ("ours", client, attached, tensors))
        return reply

    def ours_attach_breakdown(self, client, region, attached, repeat=20):
        """Where a Python attach's time goes, measured after the timed attach (medians of
        ``repeat``, in ms): ``attach_call`` is ``Client.attach`` (the request, the metadata
        pages, the descriptors, the import and map); ``decode`` the decoding of the same
        metadata (re-encoded here as MetaPage replies of at most one DATA message each);
        ``views`` making the torch tensors over the mapping (``attach_state_dict``'s second
        step); ``as_strided_floor`` torch's own cost for as many views, one
        ``Tensor.as_strided`` each over the same chunks with its arguments ready: what any
        Python client that hands out torch tensors pays."""
        m, mt = self.memd()
        from vmm_memd import protocol as p
        from vmm_memd.postcard import Writer
        torch = self.torch

        def median_ms(fn):
            times = []
            for _ in range(repeat):
                t = PC()
                fn()
                times.append(PC() - t)
            return round(statistics.median(times) * 1000, 3)

        def attach_call():
            client.detach(client.attach(region, attached.generation))
        pages, page, size = [], [], 0
        for key, meta in attached.meta.items():
            w = Writer()
            w.str(key)
            p._tensor_meta(w, meta)
            entry = w.bytes()
            if page and size + len(entry) + 16 > p.MAX_DATA:
                pages.append(page)
                page, size = [], 0
            page.append(entry)
            size += len(entry)
        pages.append(page)
        encoded = []
        for entries in pages:
            w = Writer()
            w.variant(p._REPLIES.index("MetaPage"))
            w.usize(len(entries))
            encoded.append(w.bytes() + b"".join(entries))
        wholes, bases, views = {}, {}, []
        for meta in attached.meta.values():
            key = (meta.chunk, meta.dtype)
            if key not in bases:
                bases[key] = mt._typed_chunk(torch, wholes, attached.chunks, *key)
            if bases[key] is not None and meta.len:
                size = meta.dtype.itemsize
                views.append((bases[key], tuple(meta.shape), mt._strides(tuple(meta.shape)),
                              meta.offset // size))
        return {"attach_call": median_ms(attach_call),
                "decode": median_ms(lambda: [p.decode_response(e) for e in encoded]),
                "views": median_ms(lambda: mt._views(torch, attached)),
                "as_strided_floor": median_ms(lambda: [b.as_strided(*v) for b, *v in views]),
                "as_strided_count": len(views), "tensors": len(attached.meta),
                "meta_pages": len(encoded)}

    def hold_or_release(self, c, held):
        self.held.append(held)
        if not c.get("hold"):
            self.op_release({})

    def op_attach_until_ready(self, c):
        """Attach as soon as the service answers (a service being restarted): tries until
        ``wait_ms`` passes."""
        t0 = PC()
        deadline = t0 + c["wait_ms"] / 1000.0
        tries, last = 0, None
        while True:
            tries += 1
            left = max(1, int((deadline - PC()) * 1000))
            try:
                reply = self.op_attach({**c, "wait_ms": left})
                if reply.get("ready"):
                    reply["tries"] = tries
                    return reply
                last = reply.get("why")
            except Exception as e:  # noqa: BLE001 (not up yet: refused, gone, no region yet)
                last = repr(e)
            if PC() >= deadline:
                return {"ready": False, "waited_ms": ms(PC() - t0), "tries": tries, "why": last}
            time.sleep(0.002)

    def op_read_markers(self, c):
        markers = []
        for held in self.held:
            if held[0] == "gms":
                markers.append(self.gms_marker(held[2]))
            else:
                first = held[3][self.shapes[0][0]]
                markers.append(int(first.view(self.torch.int16).reshape(-1)[0].item()))
        return {"markers": markers}

    def op_release(self, c):
        released = 0
        while self.held:
            held = self.held.pop()
            released += 1
            if held[0] == "gms":
                _, mgr, tensors = held
                tensors.clear()
                del tensors
                try:
                    mgr.close()
                except Exception as e:  # noqa: BLE001 (a dead server: the socket is gone)
                    sys.stderr.write(f"release: GMS close: {e!r}\n")
            else:
                m, _ = self.memd()
                _, client, attached, tensors = held
                tensors.clear()
                del tensors
                try:
                    client.detach(attached)
                except m.MemdError:
                    pass
                del attached
                client.close()
            del held
            gc.collect()
        self.sync()
        return {"released": released}

    def op_ping(self, c):
        return {"pid": os.getpid(), **self.timing}


def worker_main(args):
    proto = Proto()
    role = Role(args, proto)
    proto.reply({"pid": os.getpid(), **role.timing})
    for line in sys.stdin:
        c = json.loads(line)
        if c["op"] == "exit":
            break
        try:
            reply = getattr(role, "op_" + c["op"])(c)
        except Exception as e:  # noqa: BLE001 (the runner records it)
            reply = {"error": repr(e)[:500], "trace": traceback.format_exc()}
        proto.reply(reply)
    role.op_release({})


def engine_main(args):
    """A fresh engine process: imports, CUDA, the client, attach; then "ready", and it holds
    the weights until it is killed."""
    proto = Proto()
    t0 = PC()
    role = Role(args, proto)
    t1 = PC()
    if args.service == "gms":
        role.gms()
    else:
        role.memd()
    t2 = PC()
    target = {"service": args.service, "socket": args.socket, "region": args.region,
              "wait_ms": 60000, "hold": True}
    reply = role.op_attach(target)
    t3 = PC()
    proto.reply({"ready": True, "pid": os.getpid(), **role.timing,
                 "ready_at": reply["ready_at"],
                 "import_client_ms": ms(t2 - t1), "attach_ms": reply["attach_ms"],
                 "since_main_ms": ms(t3 - t0), "marker": reply["marker"],
                 "count": reply["count"], "generation": reply.get("generation")})
    for _ in sys.stdin:
        pass


# ---- the command line -----------------------------------------------------------------------


def common(parser):
    parser.add_argument("--device", type=int, default=0, help="the CUDA device (default 0)")
    parser.add_argument("--cpu", action="store_true",
                        help="a dry run without a GPU: host regions, GMS on cpu_fake/")
    parser.add_argument("--shrink", type=int, default=None,
                        help="divide every dimension by this (default 1; 16 with --cpu)")
    parser.add_argument("--workload", choices=["prefix", "model"], default="prefix",
                        help="16 GiB rows: the 331-tensor prefix (default) or the 291-tensor "
                             "model")


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="measure both services, print the table")
    common(run)
    run.add_argument("--memd", default=os.environ.get("VMM_MEMD_BIN"),
                     help="the vmm-memd binary (or $VMM_MEMD_BIN)")
    run.add_argument("--gms-carry", default=os.path.join(ROOT, ".gms-carry"),
                     help="the folder holding gpu_memory_service/ (default .gms-carry)")
    run.add_argument("--only", choices=["gms", "ours"], help="measure one service only")
    run.add_argument("--repeat", type=int, default=5, help="samples per timed row (default 5)")
    run.add_argument("--restart-repeat", type=int, default=3,
                     help="engine restarts measured (default 3; each imports torch afresh)")
    run.add_argument("--rounds", type=int, default=3,
                     help="rounds of the many-readers rows (default 3)")
    run.add_argument("--readers", default="4,8",
                     help="reader counts of the many-readers rows (default 4,8)")
    run.add_argument("--wait-s", type=float, default=3.0,
                     help="how long a blocked writer or reader waits in the fault rows (3)")
    run.add_argument("--deadline", type=float, default=450.0,
                     help="seconds after which rows are skipped (default 450)")
    run.add_argument("--quota-gib", type=int, default=100, help="vmm-memd's --quota-bytes, GiB")
    run.add_argument("--skip-faults", action="store_true", help="no fault rows")
    run.add_argument("--no-settle", dest="settle", action="store_false",
                     help="ours: attach without waiting for the commit's background digests "
                          "(by default a Verify waits for them first)")
    run.add_argument("--skip-restart", action="store_true", help="no engine restart rows")
    run.add_argument("--tmp", default="/tmp", help="where GMS's socket goes")
    run.add_argument("--out", help="a folder for gms-compare.json and gms-compare.md")
    for role in ("worker", "engine"):
        p = sub.add_parser(role, help=f"(internal) a {role} process")
        common(p)
        if role == "engine":
            p.add_argument("--service", choices=["gms", "ours"], required=True)
            p.add_argument("--socket", required=True)
            p.add_argument("--region", required=True)
    shapes = sub.add_parser("shapes", help="print the workload")
    common(shapes)
    args = parser.parse_args(argv)
    if args.shrink is None:
        args.shrink = 16 if args.cpu else 1
    if args.cmd == "run":
        args.readers = sorted({int(x) for x in args.readers.split(",") if x})
        if not args.memd and args.only != "gms":
            parser.error("--memd PATH (or VMM_MEMD_BIN) is needed to measure vmm-memd")
        if args.memd:
            args.memd = os.path.abspath(args.memd)
            if not os.access(args.memd, os.X_OK):
                parser.error(f"--memd {args.memd}: not an executable")
        args.gms_carry = os.path.abspath(args.gms_carry)
        if args.only != "ours" and not os.path.isdir(os.path.join(args.gms_carry,
                                                                  "gpu_memory_service")):
            parser.error(f"no gpu_memory_service/ in {args.gms_carry}: run "
                         f"vmm-bench/gms/carry.sh, or --only ours")
        if min(args.repeat, args.rounds, args.restart_repeat) < 1 or not args.readers \
                or min(args.readers) < 2:
            parser.error("--repeat, --rounds and --restart-repeat must be at least 1, "
                         "--readers at least 2 each")
    return args


def main(argv=None):
    args = parse(argv)
    if args.cmd == "worker":
        return worker_main(args)
    if args.cmd == "engine":
        return engine_main(args)
    small, large = workloads(args.workload, args.shrink)
    if args.cmd == "shapes":
        print(json.dumps({"2GiB": describe(small), "16GiB": describe(large),
                          "first": small[:3], "last": large[-3:]}, indent=1))
        return 0
    sys.path[:0] = [p for p in role_env(args)["PYTHONPATH"].split(os.pathsep) if p]
    runner = Runner(args)
    results = runner.run()
    table = results.table()
    meta = results.meta
    head = (f"GMS ({meta.get('gms', '?').splitlines()[0]}) vs vmm-memd ({args.memd}); "
            f"{meta['mode']}; GPU {meta.get('gpu')}; workload 2 GiB = "
            f"{meta['workload']['2GiB']['tensors']} tensors "
            f"({meta['workload']['2GiB']['bytes'] / 1e9:.2f} GB), 16 GiB = "
            f"{meta['workload']['16GiB']['tensors']} tensors "
            f"({meta['workload']['16GiB']['bytes'] / 1e9:.2f} GB), bf16; medians [min-max] "
            f"of n samples; {meta['elapsed_s']} s in all")
    if not args.out:  # else the JSON goes to its file only: the table stays the output's end
        print(json.dumps(results.json(), indent=1, default=str))
        print()
    print(head)
    print()
    print(table)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gms-compare.json"), "w") as f:
            json.dump(results.json(), f, indent=1, default=str)
        with open(os.path.join(args.out, "gms-compare.md"), "w") as f:
            f.write(head + "\n\n" + table + "\n")
    failed = any("error" in row.get(side, {}) for row in results.rows.values()
                 for side in ("gms", "ours")) or meta.get("phase_errors")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
