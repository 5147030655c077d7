"""The Python side of vmm-core's `fabric_tcp` example: a fabric descriptor over TCP with mutual
TLS (python/vmm_ipc_peer's TLS, on the standard library's ``ssl``), imported or exported with
cuda.bindings (python/vmm_ipc_cuda.py). Put ``python/`` on PYTHONPATH.

    python3 fabric_tls.py import HOST:PORT CERTDIR EXPORTER_NAME IMPORTER_NAME
    python3 fabric_tls.py export HOST:PORT CERTDIR EXPORTER_NAME IMPORTER_NAME

CERTDIR holds ca.pem, exporter.pem/.key and importer.pem/.key. ``import`` connects as the
importer, admits only a server whose certificate names EXPORTER_NAME, imports the descriptor,
checks the exporter's pattern (seed 1), writes its own (seed 2) and replies. ``export`` listens
(port 0: any; it prints ``LISTENING <port>``), admits only a client whose certificate names
IMPORTER_NAME (a refused client gets a TLS alert and nothing else), sends the descriptor of a
fresh fabric allocation filled with seed 1, waits for the reply, and checks seed 2 is there.
The handles are never printed.
"""

import sys

import vmm_ipc_peer as peer

SIZE = 4 << 20
WAIT = 60.0


def config(certdir, me, peer_name):
    return peer.TlsConfig(cert=f"{certdir}/{me}.pem", key=f"{certdir}/{me}.key",
                          ca=f"{certdir}/ca.pem", allow_names=[peer_name], timeout=WAIT)


def address(text):
    host, port = text.rsplit(":", 1)
    return host, int(port)


def do_import(addr, certdir, exporter_name, importer_name):
    import vmm_ipc_cuda as vc
    ctx = vc.Context(0)
    with peer.tls_connect(address(addr), config(certdir, "importer", exporter_name),
                          timeout=WAIT) as conn:
        desc = conn.recv_descriptor()
        assert isinstance(desc, peer.FabricDescriptor), type(desc).__name__
        mapping = vc.import_fabric(ctx, desc)
        matched = mapping.read(0, mapping.size) == peer.pattern(1, mapping.size)
        mapping.write(0, peer.pattern(2, mapping.size))
        mapping.close()
        conn.send_data(b"imported, pattern matched" if matched else b"imported, NOT matched")
        if not matched:
            sys.exit("importer: the exporter's pattern is not in the buffer")
        print(f"importer: imported {desc.size} bytes over mutual TLS, pattern matched")


def do_export(addr, certdir, exporter_name, importer_name):
    import vmm_ipc_cuda as vc
    ctx = vc.Context(0)
    owned = vc.Allocation(ctx, chunks=max(1, SIZE // ctx.granularity), fabric=True)
    owned.write(0, peer.pattern(1, owned.size))
    with peer.tls_listen(address(addr), config(certdir, "exporter", importer_name)) as listener:
        print(f"LISTENING {listener.address[1]}", flush=True)
        with listener.accept(timeout=WAIT) as conn:
            conn.send_descriptor(owned.export_fabric())
            reply = conn.recv_data()
    ctx.make_current()
    if owned.read(0, owned.size) != peer.pattern(2, owned.size):
        sys.exit(f"exporter: the importer's write is not in the buffer (it said {reply!r})")
    owned.close()
    print(f"exporter: the importer replied {reply!r}; its write is in the buffer")


def main():
    if len(sys.argv) != 6 or sys.argv[1] not in ("import", "export"):
        sys.exit(__doc__)
    verb, addr, certdir, exporter_name, importer_name = sys.argv[1:]
    (do_import if verb == "import" else do_export)(addr, certdir, exporter_name, importer_name)


if __name__ == "__main__":
    main()
