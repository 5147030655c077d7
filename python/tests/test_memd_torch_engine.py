"""A torch engine restarts without reloading (issue 32, item 2), on a GPU: a Llama of about 1B
parameters (transformers' LlamaConfig, the shape of Llama 3.2 1B with tied embeddings, random
weights, bfloat16, seeded: nothing is downloaded) is published once by one process and served
by engine processes that attach it zero-copy.

- The publisher builds the model on the GPU, publishes ``model_state(model)`` with
  ``publish_state_dict``, runs a forward pass on a fixed input, saves the logits (torch.save)
  and exits: the service holds the weights from then on.
- An engine (a long-running process, driven line by line on stdin, answering ``ENGINE {json}``
  lines on stdout) builds the same model on the meta device, attaches, binds, checks that every
  parameter and buffer lies inside the attached mapping and that torch allocated far less than
  the model (no copy), and runs the forward pass: the logits equal the publisher's bit for bit
  (same kernels, same GPU, same inputs; cuBLAS is asked to be deterministic).
- The engine is SIGKILLed and a new one starts: ready again, the same checks, equal logits.
- The service is SIGKILLed and restarted (by the Rust test: this file asks through the control
  directory) while an engine runs: it keeps serving (its mapping does not depend on the
  service), reconnects and attaches the same generation; a new engine attaches it too.
- Every process reports its timings (start to ready, attach, bind, publish, forward), written
  to ``timings.txt`` in the control directory at the end (the Rust test prints it).

And ``publish_state_dict`` on the GPU with every kind of tensor (views, scalars, empty tensors,
host tensors, tied ones, two chunks) comes back equal, read-only and zero-copy.

Run by vmm-memd's ``torch_engine`` test (VMM_MEMD_SOCKET, VMM_MEMD_RESTART_DIR); skipped
anywhere else. ``python3 test_memd_torch_engine.py publish|engine ...`` are the roles.

A dry run of the same steps on the CPU, against a host region (no GPU; what was run where this
was written): VMM_ENGINE_DEVICE=cpu, and VMM_ENGINE_SMALL=1 for a model of a few MB.
"""

import ctypes
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import traceback
import unittest

#: Where the roles run the model and publish it: "cuda" (device 0: the test), or "cpu" (a dry
#: run against a host region).
DEVICE = os.environ.get("VMM_ENGINE_DEVICE", "cuda")

try:
    import torch
    import transformers  # noqa: F401
    if DEVICE == "cuda":
        from cuda.bindings import driver as cu
    RUNS = DEVICE == "cpu" or torch.cuda.is_available()
except ImportError:  # the Rust test checks all three are there before it runs this module
    torch = cu = None
    RUNS = False

import vmm_memd
from vmm_memd import torch as memd_torch

#: Llama 3.2 1B's shape: 1.24 G parameters, 2.47 GB in bfloat16 (the embedding, tied to the
#: output layer, is 0.53 GB of it).
CONFIG = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
              num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
              max_position_embeddings=4096, tie_word_embeddings=True)
if os.environ.get("VMM_ENGINE_SMALL") == "1":  # dry runs only
    CONFIG.update(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2)
SEED = 32
TOKENS = 32
#: How long one step of a role may take (a cold start imports torch and transformers).
STEP = 240.0


# ---- the roles (each a process of its own) ------------------------------------------------


def since_exec():
    """Seconds since this process was started (the kernel's start time, 10 ms ticks)."""
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime
    return time.clock_gettime(time.CLOCK_BOOTTIME) - started


def say(**report):
    sys.stdout.write("ENGINE " + json.dumps(report) + "\n")
    sys.stdout.flush()


def die_with_parent():
    """SIGKILL this role when the test that started it dies (PR_SET_PDEATHSIG), so no engine
    outlives a test killed past its deadline."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != int(os.environ.get("VMM_ENGINE_PARENT", os.getppid())):
        sys.exit(1)


def synchronize():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def allocated():
    """Bytes torch's allocator holds for tensors on the device (0 on the CPU: not tracked)."""
    return torch.cuda.memory_allocated() if DEVICE == "cuda" else 0


def reset_peak():
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()


def peak():
    return torch.cuda.max_memory_allocated() if DEVICE == "cuda" else 0


def deterministic():
    """The same kernels, the same results: cuBLAS's deterministic workspace (the variable is
    set by the test for every role, before CUDA starts), deterministic algorithms."""
    torch.use_deterministic_algorithms(True, warn_only=True)


def build(device):
    """The Llama on ``device``: ``DEVICE`` gives random weights (seeded; transformers'
    initialisation), ``"meta"`` a skeleton that holds no memory. bfloat16 parameters; the rotary
    embedding's buffers are float32, as transformers makes them."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(**CONFIG)
    torch.manual_seed(SEED)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def forward(model, input_ids):
    with torch.inference_mode():
        logits = model(input_ids=input_ids, use_cache=False).logits
    synchronize()
    return logits


def distinct_bytes(tensors):
    """Bytes of ``tensors`` counting shared memory once."""
    return sum({t.data_ptr(): t.numel() * t.element_size() for t in tensors}.values())


def role_publish(socket, region, out):
    """Build on the GPU, publish, run the forward pass, save inputs and logits, exit."""
    deterministic()
    imported = since_exec()
    model = build(DEVICE)
    built = since_exec()
    state = memd_torch.model_state(model)
    input_ids = torch.randint(0, CONFIG["vocab_size"], (1, TOKENS),
                              generator=torch.Generator().manual_seed(SEED))
    logits = forward(model, input_ids.to(DEVICE))
    if not torch.isfinite(logits.float()).all():
        raise AssertionError("the publisher's logits are not finite")
    client = vmm_memd.Client.connect(socket)
    started = time.perf_counter()
    generation = memd_torch.publish_state_dict(client, region, state,
                                               device=0 if DEVICE == "cuda" else "cpu")
    publish_ms = (time.perf_counter() - started) * 1000
    torch.save({"input_ids": input_ids, "logits": logits.cpu(), "generation": generation}, out)
    say(event="published", generation=generation, publish_ms=round(publish_ms, 1),
        tensors=len(state), model_bytes=distinct_bytes(state.values()),
        imported_s=round(imported, 2), built_s=round(built, 2),
        since_exec_s=round(since_exec(), 2))
    client.close()


class Engine:
    """The engine's state: the model bound to an attached generation, and A's result."""

    def __init__(self, socket, region, expected):
        self.socket, self.region = socket, region
        deterministic()
        self.imported = since_exec()
        torch.empty(1, device=DEVICE)  # CUDA up before the attach is timed
        self.baseline = allocated()
        self.expected = torch.load(expected)
        self.input_ids = self.expected["input_ids"].to(DEVICE)
        self.model = build("meta")
        self.client = vmm_memd.Client.reconnect(socket, within=30.0)
        started = time.perf_counter()
        self.attached, tensors = memd_torch.attach_state_dict(self.client, region)
        self.attach_ms = (time.perf_counter() - started) * 1000
        started = time.perf_counter()
        memd_torch.bind(self.model, tensors)
        self.bind_ms = (time.perf_counter() - started) * 1000
        del tensors

    def checks(self):
        """Where the model's memory is: every parameter and buffer inside the mapping, on the
        GPU; torch's own allocations."""
        named = list(self.model.named_parameters(remove_duplicate=False)) + \
            list(self.model.named_buffers(remove_duplicate=False))
        outside = [name for name, t in named if not memd_torch.mapped(self.attached, t)]
        devices = sorted({str(t.device) for _, t in named})
        return dict(tensors=len(named), outside=outside, devices=devices,
                    model_bytes=distinct_bytes(t for _, t in named),
                    mapped_bytes=sum(c.length for c in self.attached.chunks),
                    allocated=allocated() - self.baseline,
                    tied=self.model.lm_head.weight.data_ptr()
                    == self.model.model.embed_tokens.weight.data_ptr())

    def forward(self):
        reset_peak()
        before = allocated()
        started = time.perf_counter()
        logits = forward(self.model, self.input_ids)
        ms = (time.perf_counter() - started) * 1000
        used = peak() - before
        got, want = logits.cpu(), self.expected["logits"]
        equal = got.shape == want.shape and got.dtype == want.dtype and torch.equal(got, want)
        diff = (got.float() - want.float()).abs().max().item() if got.shape == want.shape \
            else None
        return dict(equal=equal, max_abs_diff=diff, forward_ms=round(ms, 1), peak=used)

    def reattach(self):
        """After a restart of the service: reconnect and attach the current generation again
        (the lease the dead service held is gone); the model keeps its own mapping."""
        self.client = vmm_memd.Client.reconnect(self.socket, within=30.0)
        started = time.perf_counter()
        again = self.client.attach(self.region)
        ms = (time.perf_counter() - started) * 1000
        self.client.detach(again)
        return dict(generation=again.generation, attach_ms=round(ms, 1),
                    same_layout=again.meta == self.attached.meta)


def role_engine(socket, region, expected):
    """Attach, bind, check, forward; then serve ``forward``, ``reattach`` and ``quit`` lines
    until stdin ends."""
    engine = Engine(socket, region, expected)
    bound = since_exec()
    report = dict(event="ready", pid=os.getpid(), generation=engine.attached.generation,
                  attach_ms=round(engine.attach_ms, 1), bind_ms=round(engine.bind_ms, 1),
                  imported_s=round(engine.imported, 2), bound_s=round(bound, 2))
    report.update(engine.checks())
    report.update(engine.forward())
    report["since_exec_s"] = round(since_exec(), 2)
    say(**report)
    for line in sys.stdin:
        command = line.strip()
        if command == "forward":
            report = dict(event="forward")
            report.update(engine.forward())
            report.update(engine.checks())
        elif command == "reattach":
            report = dict(event="reattach")
            report.update(engine.reattach())
        elif command == "quit":
            say(event="quit")
            return
        else:
            report = dict(event="error", error=f"unknown command {command!r}")
        say(**report)


def role_main(argv):
    die_with_parent()
    role, args = argv[0], argv[1:]
    try:
        {"publish": role_publish, "engine": role_engine}[role](*args)
    except BaseException:  # noqa: BLE001 (told to the test, which fails with it)
        say(event="error", error=traceback.format_exc())
        sys.exit(1)


# ---- the test (runs the roles) --------------------------------------------------------------


class Role:
    """A role process; its ``ENGINE`` lines read by a thread into a queue."""

    def __init__(self, stderr, *args):
        env = dict(os.environ, VMM_ENGINE_PARENT=str(os.getpid()),
                   CUBLAS_WORKSPACE_CONFIG=":4096:8")
        self.spawned = time.monotonic()
        self.stderr = stderr
        with open(stderr, "w") as err:  # its warnings stay out of unittest's report lines
            self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), *args],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=err, env=env, text=True, bufsize=1)
        self.lines = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            if line.startswith("ENGINE "):
                self.lines.put(json.loads(line[len("ENGINE "):]))
        self.lines.put(None)

    def expect(self, event, timeout=STEP):
        """The next report, which must be ``event``; AssertionError otherwise."""
        try:
            report = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no {event!r} report within {timeout} s"
                                 f"{self.stderr_tail()}") from None
        if report is None:
            raise AssertionError(f"the role exited ({self.proc.wait()}) before {event!r}"
                                 f"{self.stderr_tail()}")
        if report.get("event") != event:
            raise AssertionError(f"expected {event!r}, got {report}{self.stderr_tail()}")
        report["wall_s"] = round(time.monotonic() - self.spawned, 2)
        return report

    def stderr_tail(self, limit=6000):
        try:
            with open(self.stderr, errors="replace") as f:
                text = f.read()
        except OSError:
            return ""
        return f"\n--- the role's stderr (last {limit} characters) ---\n{text[-limit:]}"

    def ask(self, command, event):
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.expect(event)

    def kill(self):
        self.proc.kill()
        self.proc.wait()

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass


def restart_service(control):
    """Ask the Rust test to SIGKILL the service and start it again; wait until it has."""
    open(os.path.join(control, "kill-service"), "w").close()
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(control, "restarted")):
        if time.monotonic() > deadline:
            raise AssertionError("the service was not restarted within 60 s")
        time.sleep(0.01)


@unittest.skipUnless(RUNS and "VMM_MEMD_RESTART_DIR" in os.environ,
                     "needs torch with CUDA, transformers, cuda.bindings, a GPU and the Rust "
                     "test (vmm-memd's torch_engine)")
class EngineRestart(unittest.TestCase):
    def setUp(self):
        self.socket = os.environ["VMM_MEMD_SOCKET"]
        self.control = os.environ["VMM_MEMD_RESTART_DIR"]
        self.roles = []

    def tearDown(self):
        for role in self.roles:
            role.close()

    def role(self, *args):
        stderr = os.path.join(self.control, f"role-{len(self.roles)}-{args[0]}.stderr")
        role = Role(stderr, *args)
        self.roles.append(role)
        return role

    def assert_serving(self, report, published, label):
        """An engine's ready or forward report: the logits equal, every tensor in the mapping
        on GPU 0, torch's allocations far below the model's size."""
        model_bytes = published["model_bytes"]
        self.assertTrue(report["equal"], f"{label}: logits differ from the publisher's by up "
                                         f"to {report['max_abs_diff']}: {report}")
        self.assertEqual(report["outside"], [], f"{label}: not in the mapping")
        self.assertEqual(report["devices"], ["cuda:0" if DEVICE == "cuda" else "cpu"], label)
        self.assertTrue(report["tied"], f"{label}: lm_head and the embedding are one tensor")
        self.assertEqual(report["model_bytes"], model_bytes, label)
        self.assertGreaterEqual(report["mapped_bytes"], model_bytes, label)
        # A copy of the weights would be the model's size; what torch holds is its input, the
        # logits and cuBLAS's workspaces (tens of MB).
        self.assertLess(report["allocated"], model_bytes // 10, f"{label}: a copy? {report}")
        self.assertLess(report["peak"], model_bytes // 5, f"{label}: a copy? {report}")

    def test_an_engine_restarts_without_reloading(self):
        region = f"llama-1b-{os.getpid()}"
        expected = os.path.join(self.control, "expected.pt")
        timings = []

        publisher = self.role("publish", self.socket, region, expected)
        published = publisher.expect("published")
        self.assertEqual(publisher.proc.wait(timeout=STEP), 0)
        if "VMM_ENGINE_SMALL" not in os.environ:
            self.assertGreater(published["model_bytes"], 2_400_000_000)
        timings.append(f"publisher: published {published['model_bytes'] / 1e9:.2f} GB "
                       f"({published['tensors']} tensors) in {published['publish_ms']} ms; "
                       f"imports {published['imported_s']} s, model built at "
                       f"{published['built_s']} s, done {published['since_exec_s']} s after "
                       f"exec ({published['wall_s']} s after spawn)")

        def engine(label):
            role = self.role("engine", self.socket, region, expected)
            ready = role.expect("ready")
            self.assertEqual(ready["generation"], published["generation"], label)
            self.assert_serving(ready, published, label)
            timings.append(
                f"{label}: ready {ready['since_exec_s']} s after exec ({ready['wall_s']} s "
                f"after spawn; imports {ready['imported_s']} s, bound at {ready['bound_s']} s): "
                f"attach {ready['attach_ms']} ms, bind {ready['bind_ms']} ms, first forward "
                f"{ready['forward_ms']} ms; torch allocated {ready['allocated']} bytes, peak "
                f"{ready['peak']} in the forward")
            return role

        first = engine("engine 1")
        again = first.ask("forward", "forward")
        self.assert_serving(again, published, "engine 1, forward again")
        timings.append(f"engine 1: forward {again['forward_ms']} ms")

        first.kill()
        second = engine("engine 2 (after engine 1 was SIGKILLed)")

        started = time.monotonic()
        restart_service(self.control)
        timings.append(f"service SIGKILLed and restarted in "
                       f"{(time.monotonic() - started) * 1000:.0f} ms (as seen here)")
        after = second.ask("forward", "forward")
        self.assert_serving(after, published, "engine 2, after the service's restart")
        reattached = second.ask("reattach", "reattach")
        self.assertEqual(reattached["generation"], published["generation"])
        self.assertTrue(reattached["same_layout"])
        timings.append(f"engine 2: served through the restart (forward {after['forward_ms']} "
                       f"ms); reconnected and attached generation {reattached['generation']} "
                       f"again in {reattached['attach_ms']} ms")
        third = engine("engine 3 (after the service's restart)")
        self.assertEqual(second.ask("quit", "quit")["event"], "quit")
        self.assertEqual(third.ask("quit", "quit")["event"], "quit")
        self.assertEqual(second.proc.wait(timeout=30), 0)
        self.assertEqual(third.proc.wait(timeout=30), 0)

        client = vmm_memd.Client.connect(self.socket)
        client.delete(region)
        client.close()
        # For the Rust test to print (printed here, it would split unittest's report line).
        with open(os.path.join(self.control, "timings.txt"), "w") as f:
            f.write("TIMINGS (torch engine, Llama 1.24 B parameters, bfloat16)\n")
            f.writelines(f"  {line}\n" for line in timings)

    @unittest.skipUnless(DEVICE == "cuda", "a GPU test")
    def test_publish_state_dict_round_trips_every_kind_of_tensor_on_the_gpu(self):
        region = f"torch-kinds-{os.getpid()}"
        client = vmm_memd.Client.connect(self.socket)
        base = torch.arange(24, dtype=torch.float32, device="cuda").reshape(4, 6)
        embed = torch.randn(1000, 64, device="cuda").to(torch.bfloat16)
        state = {
            "base": base, "transposed": base.t(), "column": base[:, 2],
            "embed": embed, "tied": embed,
            "host_i64": torch.arange(5, dtype=torch.int64),
            "flags": torch.tensor([True, False, True], device="cuda"),
            "scalar": torch.tensor(1.5, dtype=torch.float16, device="cuda"),
            "empty": torch.empty(0, 3, device="cuda"),
            "big": torch.randint(0, 255, (3 << 20,), dtype=torch.uint8, device="cuda"),
        }
        torch.cuda.synchronize()
        generation = memd_torch.publish_state_dict(client, region, state, device=0,
                                                   chunk_bytes=2 << 20)
        attached, tensors = memd_torch.attach_state_dict(client, region)
        self.assertEqual(attached.generation, generation)
        self.assertEqual(len(attached.chunks), 2)  # "big" (3 MiB) in a chunk of its own
        self.assertEqual(attached.meta["big"].chunk, 1)
        self.assertEqual(attached.meta["tied"], attached.meta["embed"])
        self.assertIs(tensors["tied"], tensors["embed"])
        for name, t in state.items():
            got = tensors[name]
            self.assertEqual(got.device, torch.device("cuda", 0), name)
            self.assertEqual((got.dtype, got.shape), (t.dtype, t.shape), name)
            self.assertTrue(got.is_contiguous(), name)
            self.assertTrue(torch.equal(got.cpu(), t.cpu()), name)
            if t.numel():
                self.assertTrue(memd_torch.mapped(attached, got), name)
        # Read-only for the device.
        location = cu.CUmemLocation()
        location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        location.id = 0
        err, flags = cu.cuMemGetAccess(location, tensors["embed"].data_ptr())
        self.assertEqual(err, cu.CUresult.CUDA_SUCCESS)
        self.assertEqual(int(flags), int(cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ))
        client.verify(region)
        client.detach(attached)
        client.delete(region)
        client.close()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in ("publish", "engine"):
        role_main(sys.argv[1:])
    else:
        unittest.main()
