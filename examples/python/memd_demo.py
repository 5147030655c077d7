"""A short demo of vmm-memd from Python (the counterpart of ``memd-demo``, the Rust program in
examples/src): weights loaded once, attached by every engine.

    python3 memd_demo.py [--socket NAME|PATH] [--service-uid UID] [--region NAME] [--seed N] \
        publish|attach

``publish`` loads the demo's four tensors into the next generation of the region (begin, fill
the chunk through this process's writable mapping, describe each tensor, commit) and exits: the
service holds them from then on, sealed read-only. ``attach`` attaches the current generation
(a lease, and the same pages mapped read-only here, zero copy), checks every byte against the
seed, and prints what came: the generation, each tensor, the addresses. Either language checks
what the other published: the table and the contents below are those of examples/src/model.rs.

Needs the ``vmm_memd`` and ``vmm_ipc_peer`` packages (``PYTHONPATH=python`` in a checkout, or
``pip install ./python``), the standard library only; with numpy installed, ``attach`` also
shows a float32 tensor as a read-only numpy array over the mapping. The service runs
separately: ``vmm-memd --socket @vmm-memd --quota-bytes 1073741824``.
"""

import argparse
import os
import sys

import vmm_memd
from vmm_memd import Dtype, TensorMeta

ALIGNMENT = 256
TENSORS = [("embed", Dtype.F32, (64, 32)), ("layers.0.attn.wq", Dtype.BF16, (32, 32)),
           ("layers.0.attn.wk", Dtype.BF16, (32, 32)), ("norm", Dtype.F32, (32,))]
NAMES = {Dtype.F32: "f32", Dtype.BF16: "bf16"}


def layout():
    """[(name, TensorMeta)] in chunk 0, each at an ALIGNMENT multiple; the chunk's size."""
    metas, offset = [], 0
    for name, dtype, shape in TENSORS:
        offset = -(-offset // ALIGNMENT) * ALIGNMENT
        length = dtype.itemsize
        for d in shape:
            length *= d
        metas.append((name, TensorMeta(0, offset, length, dtype, shape)))
        offset += length
    return metas, -(-offset // 4096) * 4096


def contents(seed, index, length):
    """Byte j of tensor ``index``: seed + 16 * index + j % 251 (mod 256)."""
    base = (seed + 16 * index) % 256
    return bytes((base + j % 251) % 256 for j in range(length))


def publish(client, region, seed):
    metas, size = layout()
    with client.begin(region, [size]) as writer:  # aborted unless committed
        chunk = writer.chunk(0)
        for index, (name, meta) in enumerate(metas):
            chunk[meta.offset:meta.offset + meta.len] = contents(seed, index, meta.len)
            writer.put(name, meta)
        generation = writer.commit()
    return f"published {region} generation {generation}: {len(TENSORS)} tensors (seed {seed})"


def attach(client, region, seed):
    attached = client.attach(region)
    g = attached.generation
    lines = [f"attached {region} generation {g} (lease {attached.lease}), mapped read-only at "
             f"{attached.chunks[0].address:#x}"]
    metas, _ = layout()
    for index, (name, meta) in enumerate(metas):
        got = attached.meta.get(name)
        if got is None or (got.chunk, got.offset, got.len, Dtype(got.dtype), tuple(got.shape)) \
                != (meta.chunk, meta.offset, meta.len, meta.dtype, meta.shape):
            sys.exit(f"memd_demo: generation {g} has no tensor {name} as the demo lays it out")
        tensor = attached[name]
        if bytes(tensor.memoryview()) != contents(seed, index, meta.len):
            sys.exit(f"memd_demo: tensor {name} of generation {g} is not seed {seed}'s")
        lines.append(f"  {name} {NAMES[meta.dtype]} {list(meta.shape)}: {meta.len} bytes at "
                     f"{tensor.address:#x}")
    try:
        import numpy
    except ImportError:
        numpy = None
    if numpy is not None and hasattr(numpy, "from_dlpack"):
        embed = numpy.from_dlpack(attached["embed"])  # zero copy: the service's pages
        lines.append(f"  numpy: embed {embed.dtype} {embed.shape}, writeable="
                     f"{embed.flags.writeable}, at {embed.__array_interface__['data'][0]:#x}")
        del embed
    client.detach(attached)  # the mapping would stay valid
    lines.append(f"OK {region} generation {g}: {len(TENSORS)} tensors, every byte as published "
                 f"with seed {seed}")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--socket", default=os.environ.get("VMM_MEMD_SOCKET", "@vmm-memd"))
    parser.add_argument("--service-uid", type=int)
    parser.add_argument("--region", default="demo-weights")
    parser.add_argument("--seed", type=int, choices=range(256), default=7, metavar="0..255")
    parser.add_argument("mode", choices=["publish", "attach"])
    args = parser.parse_args()
    uids = None if args.service_uid is None else [args.service_uid]
    try:
        with vmm_memd.Client.connect(args.socket, expect_uids=uids) as client:
            run = publish if args.mode == "publish" else attach
            print(run(client, args.region, args.seed))
    except vmm_memd.MemdError as e:
        sys.exit(f"memd_demo: {type(e).__name__}: {e}")


if __name__ == "__main__":
    main()
