"""Roles the Rust tests (tests/tests/peer_python/) run as separate Python processes.

    python3 peer_roles.py ROLE ARGS...

Each prints ``OK ...`` on success as its last line and exits 0; anything else is a failure the
Rust side reports with this process's output. The patterns are ``vmm_ipc_peer.pattern(seed, n)``,
the same bytes as the Rust tests' ``pattern(seed, n)``.

Mutual TLS (for driving Python as either end of a TLS descriptor stream from Rust):

    tls-export ADDR CERTDIR OWN PEER [HANDLES [CHUNK_SIZE [OWNER_UUID]]]
    tls-import ADDR CERTDIR OWN PEER

- ``ADDR``: ``HOST:PORT`` (``[v6]:PORT``). The exporter listens there (port 0: any; it prints
  ``LISTENING HOST:PORT`` first, then waits); the importer connects to it.
- ``CERTDIR``: a directory with ``ca.pem`` (the CA the other side's certificate must chain
  to), ``OWN.pem`` and ``OWN.key`` (this side's certificate and PKCS#8 key, PEM), and
  ``crl.pem`` if there is a CRL (then it is checked; ``VMM_TLS_CRL=FILE`` names another file
  of CERTDIR instead).
- ``PEER``: whom to accept: a DNS name the other side's certificate must carry (its SAN), or
  ``sha256:HEX`` for a pin of its key (SHA-256 of its DER SubjectPublicKeyInfo). The importer
  sends it as the SNI when it is a name.
- ``HANDLES``: the fabric handles to send, comma-separated, 128 hex digits (64 bytes) each,
  or ``fake`` (the default: one made-up handle); ``CHUNK_SIZE`` each chunk's size (default
  2 MiB); ``OWNER_UUID`` the owner device's UUID, 32 hex digits (default ``11`` * 16).

``tls-export`` accepts one importer (clients it refuses are logged on stderr and skipped, for
up to 60 s, and each printed as ``REFUSED KIND``, its TlsReason's value, once one is
accepted), sends one CUDA_FABRIC descriptor, waits for a DATA reply and prints
``OK exported N fabric handle(s) over mutual TLS to NAMES; reply REPLY``. ``tls-import``
receives one descriptor, prints ``DESCRIPTOR chunks=[...] size=N owner=HEX`` and
``HANDLES HEX,...`` (a test role prints the bearer tokens so that a test can compare them;
never do that outside a test), replies DATA ``imported``, and prints ``OK imported N fabric
handle(s) over mutual TLS from NAMES``. Any refusal or error exits non-zero with a traceback
naming its typed exception (TlsRefused, TlsError, PeerClosed, TimeoutError, ProtocolError).

The CUDA fabric roles take ``tls`` as a transport too, with the TLS settings in place of the
uid (the Python side connects as the TLS client):

    fabric-exporter tls HOST:PORT CERTDIR,OWN,PEER SEED CHUNKS
    fabric-importer tls HOST:PORT CERTDIR,OWN,PEER SEED
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


def _tls_config(certdir, own, who):
    """The TlsConfig of the TLS roles: ``certdir``'s ``ca.pem``, ``own``'s certificate and key,
    ``crl.pem`` (or ``$VMM_TLS_CRL``) if there; accepting ``who`` (a DNS name, or
    ``sha256:HEX``)."""
    crl = os.path.join(certdir, os.environ.get("VMM_TLS_CRL", "crl.pem"))
    accept = ({"spki_sha256": [who[len("sha256:"):]]} if who.startswith("sha256:")
              else {"allow_names": [who]})
    return peer.TlsConfig(os.path.join(certdir, f"{own}.pem"), os.path.join(certdir, f"{own}.key"),
                          os.path.join(certdir, "ca.pem"), crl=crl if os.path.exists(crl) else None,
                          timeout=60, **accept)


def tls_export(address, certdir, own, who, handles="fake", chunk_size=str(2 << 20),
               owner_uuid="11" * 16):
    """Listen, accept one importer that passes the checks, send a fabric descriptor, wait for
    its DATA reply."""
    if handles == "fake":
        handle_list = [peer.pattern(0xF0, peer.FABRIC_HANDLE_LEN)]
    else:
        handle_list = [bytes.fromhex(h) for h in handles.split(",")]
    desc = peer.FabricDescriptor(handle_list, [int(chunk_size)] * len(handle_list),
                                 owner_uuid=bytes.fromhex(owner_uuid))
    with peer.tls_listen(address, _tls_config(certdir, own, who)) as listener:
        host, port = listener.address
        print(f"LISTENING {host}:{port}", flush=True)
        with listener.accept(timeout=60) as conn:
            for refusal in listener.refused:
                print(f"REFUSED {refusal.kind.value if refusal.kind else None}", flush=True)
            conn.send_descriptor(desc)
            reply = conn.recv_data()
            print(f"OK exported {len(handle_list)} fabric handle(s) over mutual TLS to "
                  f"{','.join(conn.peer_names) or conn.peer_spki_sha256}; reply "
                  f"{reply.decode(errors='replace')} (refused {listener.refusals} before)")


def tls_import(address, certdir, own, who):
    """Connect, receive a fabric descriptor, print it (handles included: a test role), reply."""
    server_name = None if who.startswith("sha256:") else who
    with peer.tls_connect(address, _tls_config(certdir, own, who), server_name) as conn:
        desc = conn.recv_descriptor()
        assert isinstance(desc, peer.FabricDescriptor), type(desc).__name__
        print(f"DESCRIPTOR chunks={desc.chunk_sizes} size={desc.size} "
              f"owner={desc.owner_uuid.hex()}", flush=True)
        print("HANDLES " + ",".join(h.hex() for h in desc.handles), flush=True)
        conn.send_data(b"imported")
        print(f"OK imported {len(desc.handles)} fabric handle(s) over mutual TLS from "
              f"{','.join(conn.peer_names) or conn.peer_spki_sha256}")


def _fabric_connection(transport, address, expect_uid):
    """An endpoint connection (``address`` a name; the listener's uid checked), a TCP stream
    (``address`` HOST:PORT; loopback, so only this machine's processes reach it), or a mutual
    TLS stream (``tls``: ``expect_uid`` is ``CERTDIR,OWN,PEER`` as for the TLS roles)."""
    if transport == "endpoint":
        return peer.connect(address, expect_uids=[int(expect_uid)])
    if transport == "tls":
        certdir, own, who = expect_uid.split(",")
        server_name = None if who.startswith("sha256:") else who
        return peer.tls_connect(address, _tls_config(certdir, own, who), server_name)
    assert transport == "tcp", transport
    host, port = address.rsplit(":", 1)
    return peer.StreamConnection(socket.create_connection((host, int(port)), timeout=60),
                                 caller_authenticated=True,
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
    "tls-export": tls_export,
    "tls-import": tls_import,
}

if __name__ == "__main__":
    ROLES[sys.argv[1]](*sys.argv[2:])
    sys.stdout.flush()
    os._exit(0)
