"""vmm_memd.torch: the packing plan (pure: offsets, alignment, chunk splitting, tied weights,
the dtype and device names, the typed errors), which needs neither torch nor a service; and,
where torch is installed and a service runs (VMM_MEMD_SOCKET), a state dict published to a host
region and bound to a model built on the meta device: zero-copy, the same outputs, tied
weights stored once, and every mismatch typed. The GPU path runs in
test_memd_torch_engine.py (vmm-memd's torch_engine test, on a GPU machine)."""

import os
import random
import unittest

try:
    import torch
except ImportError:  # the plan tests need no torch
    torch = None

import vmm_memd
from vmm_memd import MemdError
from vmm_memd import torch as memd_torch
from vmm_memd.protocol import MAX_CHUNKS, MAX_KEY_LEN, Dtype, TensorMeta, meta_pages
from vmm_memd.torch import Item, plan

F32, BF16 = Dtype.F32, Dtype.BF16


def item(name, elements, dtype=F32, share=None, shape=None):
    shape = (elements,) if shape is None else shape
    return Item(name, elements * Dtype(dtype).itemsize, Dtype(dtype), shape, share)


class Plan(unittest.TestCase):
    def test_tensors_go_in_order_at_aligned_offsets_of_one_chunk(self):
        layout = plan([item("a", 3), item("b", 100, BF16), item("c", 1, Dtype.U8),
                       item("d", 64)])
        self.assertEqual(layout.meta, (
            ("a", TensorMeta(0, 0, 12, F32, (3,))),
            ("b", TensorMeta(0, 256, 200, BF16, (100,))),
            ("c", TensorMeta(0, 512, 1, Dtype.U8, (1,))),
            ("d", TensorMeta(0, 768, 256, F32, (64,))),
        ))
        self.assertEqual(layout.chunks, (1024,))
        self.assertEqual(layout.copies, tuple((i, m) for i, (_, m) in enumerate(layout.meta)))

    def test_offsets_are_aligned_and_chunks_hold_their_tensors(self):
        layout = plan([item("a", 3), item("b", 100, BF16), item("c", 1, Dtype.U8),
                       item("d", 64)])
        self.assertEqual([m.offset for _, m in layout.meta], [0, 256, 512, 768])
        self.assertEqual(layout.chunks, (1024,))
        self.assertEqual([i for i, _ in layout.copies], [0, 1, 2, 3])
        layout = plan([item("a", 3), item("b", 3)], alignment=4096)
        self.assertEqual([m.offset for _, m in layout.meta], [0, 4096])
        self.assertEqual(layout.chunks, (8192,))

    def test_a_new_chunk_starts_when_the_next_tensor_would_pass_chunk_bytes(self):
        layout = plan([item(n, 75) for n in "abcd"], chunk_bytes=1024)  # 300 bytes each
        self.assertEqual([(m.chunk, m.offset) for _, m in layout.meta],
                         [(0, 0), (0, 512), (1, 0), (1, 512)])
        self.assertEqual(layout.chunks, (1024, 1024))
        # Exactly filling a chunk is allowed.
        layout = plan([item("a", 64), item("b", 192)], chunk_bytes=1024)
        self.assertEqual([(m.chunk, m.offset) for _, m in layout.meta], [(0, 0), (0, 256)])
        self.assertEqual(layout.chunks, (1024,))

    def test_a_tensor_larger_than_chunk_bytes_gets_a_chunk_of_its_own_size(self):
        layout = plan([item("big", 1250), item("a", 25), item("huge", 2500), item("b", 25)],
                      chunk_bytes=1024)
        self.assertEqual([(m.chunk, m.offset) for _, m in layout.meta],
                         [(0, 0), (1, 0), (2, 0), (3, 0)])
        self.assertEqual(layout.chunks, (5120, 256, 10240, 256))

    def test_every_tensor_lies_inside_its_chunk_for_random_state_dicts(self):
        rng = random.Random(32)
        for _ in range(200):
            items = [item(f"t{i}", rng.choice([0, 1, 3, 64, 1000, 5000]),
                          rng.choice(list(Dtype))) for i in range(rng.randint(1, 40))]
            chunk_bytes = rng.choice([512, 4096, 1 << 16, 1 << 34])
            try:
                layout = plan(items, chunk_bytes=chunk_bytes)
            except vmm_memd.TooManyChunks:
                continue
            self.assertLessEqual(len(layout.chunks), MAX_CHUNKS)
            spans = {}
            for (name, meta), it in zip(layout.meta, items):
                self.assertEqual(name, it.name)
                self.assertEqual((meta.len, meta.dtype, meta.shape), (it.nbytes, it.dtype, it.shape))
                self.assertEqual(meta.offset % 256, 0)
                self.assertLessEqual(meta.offset + meta.len, layout.chunks[meta.chunk])
                if meta.len:
                    spans.setdefault(meta.chunk, []).append((meta.offset, meta.offset + meta.len))
                    # Only a tensor alone in its chunk may pass chunk_bytes.
                    if meta.offset + meta.len > chunk_bytes:
                        self.assertEqual(meta.offset, 0)
            for chunk_spans in spans.values():
                chunk_spans.sort()
                for (_, end), (start, _) in zip(chunk_spans, chunk_spans[1:]):
                    self.assertLessEqual(end, start, "tensors overlap")
            self.assertEqual(len(layout.copies), sum(1 for it in items if it.nbytes))

    def test_tied_weights_are_stored_once_under_both_names(self):
        embed = ("cuda:0", 0x7000, "torch.bfloat16", (32000, 2048), (2048, 1))
        layout = plan([item("model.embed_tokens.weight", 32000 * 2048, BF16, embed,
                            (32000, 2048)),
                       item("model.norm.weight", 2048, BF16),
                       item("lm_head.weight", 32000 * 2048, BF16, embed, (32000, 2048))])
        meta = dict(layout.meta)
        self.assertEqual(meta["lm_head.weight"], meta["model.embed_tokens.weight"])
        self.assertEqual([i for i, _ in layout.copies], [0, 1])
        self.assertEqual(layout.chunks, (32000 * 2048 * 2 + 4096,))
        # The same memory with another shape is refused, not silently aliased.
        with self.assertRaises(vmm_memd.StateDictError):
            plan([item("a", 4, share="x"), item("b", 4, share="x", shape=(2, 2))])

    def test_tensors_without_bytes_take_no_room(self):
        layout = plan([item("empty", 0, shape=(0, 3)), item("a", 4), item("none", 0)])
        self.assertEqual(dict(layout.meta)["empty"], TensorMeta(0, 0, 0, F32, (0, 3)))
        self.assertEqual(dict(layout.meta)["a"], TensorMeta(0, 0, 16, F32, (4,)))
        self.assertEqual([i for i, _ in layout.copies], [1])
        self.assertEqual(plan([item("empty", 0)]).chunks, (256,))
        scalar = plan([Item("step", 8, Dtype.I64, ())])
        self.assertEqual(scalar.meta[0][1], TensorMeta(0, 0, 8, Dtype.I64, ()))

    def test_more_chunks_than_a_generation_holds_is_too_many_chunks(self):
        items = [item(f"t{i}", 256) for i in range(MAX_CHUNKS + 1)]
        with self.assertRaises(vmm_memd.TooManyChunks) as caught:
            plan(items, chunk_bytes=1024)
        self.assertEqual((caught.exception.needed, caught.exception.cap,
                          caught.exception.chunk_bytes), (MAX_CHUNKS + 1, MAX_CHUNKS, 1024))
        self.assertIsInstance(caught.exception, MemdError)
        self.assertIsInstance(caught.exception, ValueError)
        self.assertEqual(len(plan(items[:-1], chunk_bytes=1024).chunks), MAX_CHUNKS)

    def test_the_default_packs_a_llama_into_few_chunks(self):
        def llama(layers, hidden, intermediate, kv, vocab, tied):
            items = [item("model.embed_tokens.weight", vocab * hidden, BF16, "embed" if tied
                          else None, (vocab, hidden))]
            for i in range(layers):
                p = f"model.layers.{i}."
                for name, rows, cols in (("self_attn.q_proj", hidden, hidden),
                                         ("self_attn.k_proj", kv, hidden),
                                         ("self_attn.v_proj", kv, hidden),
                                         ("self_attn.o_proj", hidden, hidden),
                                         ("mlp.gate_proj", intermediate, hidden),
                                         ("mlp.up_proj", intermediate, hidden),
                                         ("mlp.down_proj", hidden, intermediate)):
                    items.append(item(p + name + ".weight", rows * cols, BF16,
                                      shape=(rows, cols)))
                items.append(item(p + "input_layernorm.weight", hidden, BF16))
                items.append(item(p + "post_attention_layernorm.weight", hidden, BF16))
            items.append(item("model.norm.weight", hidden, BF16))
            items.append(item("lm_head.weight", vocab * hidden, BF16, "embed" if tied else None,
                              (vocab, hidden)))
            return items

        small = plan(llama(16, 2048, 8192, 512, 128256, True))  # Llama 3.2 1B: 2.5 GB
        self.assertEqual(len(small.chunks), 1)
        self.assertEqual(len(small.meta), 16 * 9 + 3)
        self.assertEqual(len(small.copies), 16 * 9 + 2)
        self.assertLess(small.chunks[0], 2.48e9)
        big = plan(llama(80, 8192, 28672, 1024, 128256, False))  # Llama 3 70B: 141 GB
        self.assertEqual(len(big.chunks), 9)
        self.assertTrue(all(c <= memd_torch.DEFAULT_CHUNK_BYTES for c in big.chunks))
        # The metadata travels in requests under the service's cap.
        self.assertGreater(len(meta_pages(list(big.meta))), 1)

    def test_bad_names_and_sizes_are_refused(self):
        for items in ([item("", 1)], [item("x" * (MAX_KEY_LEN + 1), 1)],
                      [item("é" * (MAX_KEY_LEN // 2 + 1), 1)], [item("a", 1), item("a", 2)],
                      [Item("a", 5, F32, (1,))], [Item("a", 4, F32, (-1,))]):
            with self.assertRaises(vmm_memd.StateDictError):
                plan(items)
        plan([item("x" * MAX_KEY_LEN, 1)])
        with self.assertRaises(ValueError):
            plan([item("a", 1)], chunk_bytes=0)


class Names(unittest.TestCase):
    def test_every_dtype_vmm_memd_names_maps_from_torch_and_back_by_name(self):
        names = {"uint8": Dtype.U8, "int8": Dtype.I8, "uint16": Dtype.U16, "int16": Dtype.I16,
                 "uint32": Dtype.U32, "int32": Dtype.I32, "uint64": Dtype.U64,
                 "int64": Dtype.I64, "float16": Dtype.F16, "bfloat16": Dtype.BF16,
                 "float32": Dtype.F32, "float64": Dtype.F64, "bool": Dtype.Bool}
        for name, dtype in names.items():
            self.assertEqual(memd_torch.dtype_of("w", name), dtype)
            self.assertEqual(memd_torch.dtype_of("w", "torch." + name), dtype)
        self.assertEqual(set(names.values()), set(Dtype))

    def test_a_dtype_vmm_memd_cannot_name_is_unsupported_dtype(self):
        for name in ("torch.float8_e4m3fn", "float8_e5m2", "complex64", "qint8", "float4"):
            with self.assertRaises(vmm_memd.UnsupportedDtype) as caught:
                memd_torch.dtype_of("w", name)
            self.assertEqual(caught.exception.name, "w")
            self.assertEqual(caught.exception.dtype, name.replace("torch.", ""))
            self.assertIsInstance(caught.exception, vmm_memd.StateDictError)

    def test_devices(self):
        class Device:  # what a torch.device offers
            def __init__(self, type, index=None):
                self.type, self.index = type, index

            def __str__(self):
                return self.type if self.index is None else f"{self.type}:{self.index}"

        parse = memd_torch.parse_device
        self.assertEqual(parse(0), ("cuda", 0))
        self.assertEqual(parse(3), ("cuda", 3))
        self.assertEqual(parse("cuda"), ("cuda", None))
        self.assertEqual(parse("cuda:1"), ("cuda", 1))
        self.assertEqual(parse("cpu"), ("cpu", None))
        self.assertEqual(parse(Device("cuda", 2)), ("cuda", 2))
        self.assertEqual(parse(Device("cuda")), ("cuda", None))
        self.assertEqual(parse(Device("cpu")), ("cpu", None))
        for bad in ("mps", "meta", "cuda:x", "cuda:-1", -1, True, None, 1.5, Device("meta"),
                    "cpu:1"):
            with self.assertRaises(vmm_memd.UnsupportedDevice, msg=repr(bad)):
                parse(bad)


# ---- torch, on the CPU, against a host region ----------------------------------------------

if torch is not None:
    class Tiny(torch.nn.Module):
        """Tied weights, float32 and bfloat16 parameters, a persistent scalar buffer and a
        non-persistent one: what a transformer has."""

        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(50, 16)
            self.proj = torch.nn.Linear(16, 16)
            self.gate = torch.nn.Parameter(torch.linspace(0.5, 1.5, 16).to(torch.bfloat16))
            self.head = torch.nn.Linear(16, 50, bias=False)
            self.head.weight = self.embed.weight
            self.register_buffer("scale", torch.arange(16, dtype=torch.float32) / 16 + 1,
                                 persistent=False)
            self.register_buffer("steps", torch.tensor(7, dtype=torch.int64))

        def forward(self, ids):
            h = self.embed(ids) * self.scale * self.gate.float()
            return self.head(torch.relu(self.proj(h)) + self.steps)


@unittest.skipUnless(torch is not None and "VMM_MEMD_SOCKET" in os.environ,
                     "needs torch and a service (VMM_MEMD_SOCKET)")
class HostRegion(unittest.TestCase):
    def setUp(self):
        self.client = vmm_memd.Client.connect(os.environ["VMM_MEMD_SOCKET"])
        self.region = f"torch-{os.getpid()}-{self.id().rsplit('.', 1)[-1][:40]}"

    def tearDown(self):
        self.client.close()

    def test_a_model_built_on_meta_runs_on_the_published_state_zero_copy(self):
        torch.manual_seed(5)
        model = Tiny()
        generation = memd_torch.publish_state_dict(self.client, self.region,
                                                   memd_torch.model_state(model), device="cpu")
        attached, tensors = memd_torch.attach_state_dict(self.client, self.region)
        self.assertEqual(attached.generation, generation)
        self.assertEqual(set(tensors), {"embed.weight", "proj.weight", "proj.bias", "gate",
                                        "head.weight", "scale", "steps"})
        # Tied: one place, one tensor, under both names.
        self.assertEqual(attached.meta["head.weight"], attached.meta["embed.weight"])
        self.assertIs(tensors["head.weight"], tensors["embed.weight"])
        with torch.device("meta"):
            skeleton = Tiny()
        self.assertTrue(skeleton.scale.is_meta)
        self.assertIs(memd_torch.bind(skeleton, tensors), skeleton)
        named = list(skeleton.named_parameters(remove_duplicate=False)) + \
            list(skeleton.named_buffers(remove_duplicate=False))
        self.assertEqual(len(named), 7)
        for name, t in named:
            self.assertTrue(memd_torch.mapped(attached, t), f"{name} is not the mapping")
            self.assertFalse(t.requires_grad)
        self.assertEqual(skeleton.head.weight.data_ptr(), skeleton.embed.weight.data_ptr())
        self.assertEqual(skeleton.gate.dtype, torch.bfloat16)
        ids = torch.tensor([[1, 4, 9, 16, 25, 36, 49]])
        with torch.inference_mode():
            self.assertTrue(torch.equal(skeleton(ids), model(ids)))
        # The lease ends; the model keeps its mapping.
        attached.detach()
        del attached, tensors
        with torch.inference_mode():
            self.assertTrue(torch.equal(skeleton(ids), model(ids)))

    def test_views_scalars_empty_tensors_and_several_chunks_round_trip(self):
        base = torch.arange(24, dtype=torch.float64).reshape(4, 6)
        state = {"base": base, "transposed": base.t(), "row": base[1], "column": base[:, 2],
                 "scalar": torch.tensor(2.5, dtype=torch.float16), "empty": torch.empty(0, 5),
                 "flags": torch.tensor([True, False, True]),
                 "big": torch.arange(3000, dtype=torch.int32),
                 "u16": torch.arange(7, dtype=torch.int16)}
        memd_torch.publish_state_dict(self.client, self.region, state, device="cpu",
                                      chunk_bytes=8192)
        attached, tensors = memd_torch.attach_state_dict(self.client, self.region)
        # "big" (12000 bytes) passes chunk_bytes: alone in chunk 1; "u16", after it, in 2.
        self.assertEqual(len(attached.chunks), 3)
        self.assertEqual((attached.meta["flags"].chunk, attached.meta["big"].chunk,
                          attached.meta["u16"].chunk), (0, 1, 2))
        for name, t in state.items():
            got = tensors[name]
            self.assertEqual((got.dtype, got.shape), (t.dtype, t.shape), name)
            self.assertTrue(got.is_contiguous(), name)
            self.assertTrue(torch.equal(got, t), name)
            if t.numel():
                self.assertTrue(memd_torch.mapped(attached, got), name)
        # A view is stored as its own contiguous copy (only the same memory, shape and
        # strides is stored once).
        self.assertNotEqual(attached.meta["transposed"].offset, attached.meta["base"].offset)

    def test_what_cannot_be_published_is_refused_typed_before_anything_is_sent(self):
        cases = [({"w": torch.zeros(2, dtype=torch.complex64)}, vmm_memd.UnsupportedDtype),
                 ({"w": torch.zeros(2, device="meta")}, vmm_memd.UnsupportedDevice),
                 ({"w": [1, 2]}, vmm_memd.StateDictError),
                 ({"w": torch.zeros(2).to_sparse()}, vmm_memd.StateDictError)]
        if hasattr(torch, "float8_e4m3fn"):
            cases.append(({"w": torch.zeros(2).to(torch.float8_e4m3fn)},
                          vmm_memd.UnsupportedDtype))
        for state, error in cases:
            with self.assertRaises(error):
                memd_torch.publish_state_dict(None, self.region, state, device="cpu")
        with self.assertRaises(vmm_memd.UnsupportedDevice):
            memd_torch.publish_state_dict(None, self.region, {"w": torch.zeros(2)},
                                          device="mps")
        self.assertNotIn(self.region, [r.region for r in self.client.list()])

    def test_tensors_that_do_not_fit_the_model_are_state_dict_mismatch(self):
        torch.manual_seed(5)
        model = Tiny()
        memd_torch.publish_state_dict(self.client, self.region, memd_torch.model_state(model),
                                      device="cpu")
        _, tensors = memd_torch.attach_state_dict(self.client, self.region)

        def skeleton():
            with torch.device("meta"):
                return Tiny()

        fewer = dict(tensors)
        del fewer["proj.bias"]
        more = dict(tensors, extra=tensors["steps"])
        other = dict(tensors, gate=tensors["scale"])  # float32, not bfloat16
        for given, field, expected in ((fewer, "missing", ["proj.bias"]),
                                       (more, "unexpected", ["extra"])):
            target = skeleton()
            with self.assertRaises(vmm_memd.StateDictMismatch) as caught:
                memd_torch.bind(target, given)
            self.assertEqual(getattr(caught.exception, field), expected)
            self.assertTrue(target.proj.weight.is_meta, "checked before the model changed")
        with self.assertRaises(vmm_memd.StateDictMismatch) as caught:
            memd_torch.bind(skeleton(), other)
        self.assertEqual(len(caught.exception.mismatched), 1)
        self.assertIn("gate", caught.exception.mismatched[0])
        # The state dict alone leaves the non-persistent buffer on the meta device.
        persistent = {k: v for k, v in tensors.items() if k != "scale"}
        with self.assertRaises(vmm_memd.StateDictMismatch) as caught:
            memd_torch.bind(skeleton(), persistent)
        self.assertEqual(caught.exception.unbound, ["scale"])

    def test_tensors_are_views_of_one_import_per_chunk_and_odd_offsets_still_work(self):
        torch.manual_seed(5)
        model = Tiny()
        memd_torch.publish_state_dict(self.client, self.region, memd_torch.model_state(model),
                                      device="cpu")
        attached, tensors = memd_torch.attach_state_dict(self.client, self.region)
        chunk = attached.chunks[0]
        for name, t in tensors.items():
            # One storage, the whole chunk, for every tensor with bytes.
            self.assertEqual(t.untyped_storage().data_ptr(), chunk.address, name)
            self.assertEqual(t.data_ptr(), chunk.address + attached.meta[name].offset, name)
        # A writer that placed a float32 at an offset that is no multiple of 4 (plan never
        # does; the protocol allows it): imported on its own, same values.
        values = torch.arange(5, dtype=torch.float32)
        region = self.region + "-odd"
        with self.client.begin(region, [64]) as writer:
            writer.write(0, 2, values.numpy().tobytes())
            writer.put("odd", vmm_memd.TensorMeta(0, 2, 20, Dtype.F32, (5,)))
            writer.put("even", vmm_memd.TensorMeta(0, 24, 8, Dtype.F32, (2,)))
            writer.commit()
        attached, tensors = memd_torch.attach_state_dict(self.client, region)
        self.assertTrue(torch.equal(tensors["odd"], values))
        self.assertEqual(tensors["odd"].data_ptr(), attached.chunks[0].address + 2)
        self.assertEqual(tensors["even"].data_ptr(), attached.chunks[0].address + 24)

    def test_a_model_with_load_state_dict_hooks_is_bound_through_load_state_dict(self):
        torch.manual_seed(5)
        model = Tiny()
        memd_torch.publish_state_dict(self.client, self.region, memd_torch.model_state(model),
                                      device="cpu")
        _, tensors = memd_torch.attach_state_dict(self.client, self.region)
        seen = []
        with torch.device("meta"):
            hooked = Tiny()
        hooked.proj._register_load_state_dict_pre_hook(
            lambda state_dict, prefix, *rest: seen.append(prefix))
        memd_torch.bind(hooked, tensors)
        self.assertEqual(seen, ["proj."], "the hook ran: bind went through load_state_dict")
        with torch.device("meta"):
            plain = Tiny()
        memd_torch.bind(plain, tensors)
        ids = torch.tensor([[1, 4, 9]])
        with torch.inference_mode():
            self.assertTrue(torch.equal(hooked(ids), model(ids)))
            self.assertTrue(torch.equal(plain(ids), model(ids)))
        for (name, a), (_, b) in zip(hooked.state_dict(keep_vars=True).items(),
                                     plain.state_dict(keep_vars=True).items()):
            self.assertEqual((type(a), a.data_ptr(), a.requires_grad),
                             (type(b), b.data_ptr(), b.requires_grad), name)


if __name__ == "__main__":
    unittest.main()
