"""Roles the Rust tests (tests/tests/peer_python/) run as separate Python processes.

    python3 peer_roles.py ROLE ARGS...

Each prints ``OK ...`` on success as its last line and exits 0; anything else is a failure the
Rust side reports with this process's output. The patterns are ``vmm_ipc_peer.pattern(seed, n)``,
the same bytes as the Rust tests' ``pattern(seed, n)``.
"""

import os
import socket
import sys

import vmm_ipc_peer as peer


def host_client(name, expect_uid, check_seed, write_seed):
    """Connect, receive a host descriptor, check the owner's pattern, write ours, say done."""
    with peer.connect(name, expect_uids=[int(expect_uid)]) as conn:
        with conn.recv_descriptor() as desc:
            assert isinstance(desc, peer.HostDescriptor), desc
            view = desc.map()
        # The mapping outlives the descriptor's fd, as an import does.
        size = len(view)
        got = view[:]
        assert got == peer.pattern(int(check_seed), size), "the owner's pattern is not there"
        view[:] = peer.pattern(int(write_seed), size)
        view.close()
        conn.send_data(b"done")
        print(f"OK mapped {size} bytes from pid {conn.peer.pid} uid {conn.peer.uid}")


def host_exporter(name, expect_uid, size, seed):
    """Make a sealed memfd with our pattern, send it, wait for the importer's reply, check the
    importer's pattern in our own mapping."""
    size, seed = int(size), int(seed)
    fd = peer.sealed_memfd(size)
    import mmap
    view = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    view[:] = peer.pattern(seed, size)
    with peer.connect(name, expect_uids=[int(expect_uid)]) as conn:
        with peer.HostDescriptor(fd, size) as desc:
            conn.send_descriptor(desc)
        reply = conn.recv_data()
        assert reply == b"written", reply
        assert view[:] == peer.pattern(seed + 1, size), "the importer's pattern is not here"
        view.close()
        print(f"OK exported {size} bytes; the importer wrote them")


def host_listener(name, size, seed):
    """A Python listener serving a memfd to one (Rust) client."""
    size, seed = int(size), int(seed)
    import mmap
    fd = peer.sealed_memfd(size)
    view = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    view[:] = peer.pattern(seed, size)
    with peer.Listener(name) as listener:
        print("READY", flush=True)
        with listener.accept(timeout=20) as conn:
            with peer.HostDescriptor(fd, size) as desc:
                conn.send_descriptor(desc)
            assert conn.recv_data() == b"done"
            assert view[:] == peer.pattern(seed + 1, size), "the client's pattern is not here"
            print(f"OK served pid {conn.peer.pid}")


def cuda_exporter(name, expect_uid, seed, chunks):
    """cuda.bindings: allocate `chunks` granules, fill our pattern, export one fd per chunk,
    send; the Rust importer checks it, writes seed+1 over it and replies; check that here."""
    import vmm_ipc_cuda as vc
    seed, chunks = int(seed), int(chunks)
    ctx = vc.Context(0)
    owned = vc.Allocation(ctx, chunks=chunks)
    owned.write(0, peer.pattern(seed, owned.size))
    with peer.connect(name, expect_uids=[int(expect_uid)]) as conn:
        with owned.export() as desc:
            conn.send_descriptor(desc)
        reply = conn.recv_data()
        assert reply == b"written", reply
        ctx.make_current()
        assert owned.read(0, owned.size) == peer.pattern(seed + 1, owned.size), \
            "the Rust importer's pattern is not in the exporter's memory"
    owned.close()
    print(f"OK exported {chunks} chunk(s) of {ctx.granularity} bytes")


def cuda_importer(name, expect_uid, seed):
    """cuda.bindings: receive a Rust export, import and map it, check its pattern, write
    seed+1 over it, unmap, reply."""
    import vmm_ipc_cuda as vc
    seed = int(seed)
    ctx = vc.Context(0)
    with peer.connect(name, expect_uids=[int(expect_uid)]) as conn:
        with conn.recv_descriptor() as desc:
            assert isinstance(desc, peer.VmmDescriptor), desc
            assert desc.device_uuid == ctx.uuid, (desc.device_uuid, ctx.uuid)
            mapping = vc.import_descriptor(ctx, desc)
        chunks = len(mapping.chunk_sizes)
        assert mapping.read(0, mapping.size) == peer.pattern(seed, mapping.size), \
            "the Rust exporter's pattern is not there"
        mapping.write(0, peer.pattern(seed + 1, mapping.size))
        mapping.close()
        conn.send_data(b"written")
        print(f"OK imported {chunks} chunk(s), {desc.size} bytes")


def _fabric_connection(transport, address, expect_uid):
    """An endpoint connection (``address`` a name; the listener's uid checked), or a TCP
    stream (``address`` HOST:PORT; loopback, so only this machine's processes reach it)."""
    if transport == "endpoint":
        return peer.connect(address, expect_uids=[int(expect_uid)])
    assert transport == "tcp", transport
    host, port = address.rsplit(":", 1)
    return peer.StreamConnection(socket.create_connection((host, int(port)), timeout=60),
                                 timeout=60)


def fabric_exporter(transport, address, expect_uid, seed, chunks):
    """cuda.bindings: allocate `chunks` granules with fabric handles requested, fill our
    pattern, send the fabric descriptor (version 2) over `transport`; keep the allocation until
    the Rust importer replies (a handle keeps nothing alive), then check its mark here."""
    import vmm_ipc_cuda as vc
    seed, chunks = int(seed), int(chunks)
    ctx = vc.Context(0)
    owned = vc.Allocation(ctx, chunks=chunks, fabric=True)
    owned.write(0, peer.pattern(seed, owned.size))
    with _fabric_connection(transport, address, expect_uid) as conn:
        desc = owned.export_fabric()
        assert "redacted" in repr(desc), "a fabric descriptor's repr shows its handles"
        conn.send_descriptor(desc)
        reply = conn.recv_data()
        assert reply == b"written", reply
        ctx.make_current()
        assert owned.read(0, owned.size) == peer.pattern(seed + 1, owned.size), \
            "the Rust importer's mark is not in the exporter's memory"
    owned.close()
    print(f"OK exported {chunks} fabric chunk(s) of {ctx.granularity} bytes over {transport}")


def fabric_importer(transport, address, expect_uid, seed):
    """cuda.bindings: receive a Rust fabric export over `transport`, import and map it, check
    its pattern, write seed+1 over it, unmap, reply."""
    import vmm_ipc_cuda as vc
    seed = int(seed)
    ctx = vc.Context(0)
    with _fabric_connection(transport, address, expect_uid) as conn:
        desc = conn.recv_descriptor()
        assert isinstance(desc, peer.FabricDescriptor), type(desc).__name__
        assert desc.owner_uuid == ctx.uuid, "the owner is this machine's device 0"
        mapping = vc.import_fabric(ctx, desc)
        chunks = len(mapping.chunk_sizes)
        assert mapping.read(0, mapping.size) == peer.pattern(seed, mapping.size), \
            "the Rust exporter's pattern is not there"
        mapping.write(0, peer.pattern(seed + 1, mapping.size))
        mapping.close()
        conn.send_data(b"written")
        print(f"OK imported {chunks} fabric chunk(s), {desc.size} bytes over {transport}")


ROLES = {
    "host-client": host_client,
    "host-exporter": host_exporter,
    "host-listener": host_listener,
    "cuda-exporter": cuda_exporter,
    "cuda-importer": cuda_importer,
    "fabric-exporter": fabric_exporter,
    "fabric-importer": fabric_importer,
}

if __name__ == "__main__":
    ROLES[sys.argv[1]](*sys.argv[2:])
    sys.stdout.flush()
    os._exit(0)
