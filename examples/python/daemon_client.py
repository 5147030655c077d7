"""The Python client of vmm-daemon (examples/src/bin/vmm-daemon.rs), on the standard-library
peer (the package python/vmm_ipc_peer; put python/ on PYTHONPATH).

    python3 daemon_client.py NAME BUFFER [--expect-uid UID] [--check-seed SEED] [--fabric]

Connects (checking the daemon's uid with SO_PEERCRED), asks for the list and for BUFFER, maps it
(a host memfd with mmap; a CUDA VMM buffer with cuda.bindings, through python/vmm_ipc_cuda.py),
checks its pattern if asked, and prints one line starting with OK.

With ``--fabric`` it also accepts a fabric descriptor (protocol version 2, kind CUDA_FABRIC: one
64-byte fabric handle per chunk, no fds), as a daemon whose buffer was allocated with fabric
handles sends, and imports it with ``vmm_ipc_cuda.import_fabric`` (a GPU with fabric support
and an IMEX channel needed here). Without it, such a reply is refused unimported: a client that
did not ask for fabric handles may have no IMEX channel. The handles are never printed.
"""

import argparse
import sys

import vmm_ipc_peer as peer


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("name")
    parser.add_argument("buffer")
    parser.add_argument("--expect-uid", type=int)
    parser.add_argument("--check-seed", type=int)
    parser.add_argument("--fabric", action="store_true",
                        help="accept (and import) a fabric descriptor")
    args = parser.parse_args()
    expect = None if args.expect_uid is None else [args.expect_uid]
    with peer.connect(args.name, expect_uids=expect) as conn:
        conn.send_data(b"list")
        listing = conn.recv_data().decode()
        conn.send_data(f"get {args.buffer}".encode())
        reply = conn.recv()
        if isinstance(reply, peer.Data):
            text = bytes(reply).decode(errors="replace")
            if text.startswith("error: busy: "):
                # Over a cap on descriptors sent and not yet read (per connection, per uid, in
                # all): read earlier descriptors first, or retry later.
                sys.exit(f"the daemon is busy (descriptors in flight): {text[len('error: busy: '):]}")
            sys.exit(f"the daemon says: {text}")
        with reply as desc:
            if isinstance(desc, peer.HostDescriptor):
                kind, view = "host", desc.map()
                contents = view[:]
                view.close()
            elif isinstance(desc, peer.FabricDescriptor):
                if not args.fabric:
                    sys.exit(f"buffer {args.buffer}: the daemon sent a fabric descriptor "
                             f"({len(desc.handles)} chunk(s)); pass --fabric to import it")
                import vmm_ipc_cuda as vc  # needs cuda.bindings, a GPU and an IMEX channel
                ctx = vc.Context(0)
                mapping = vc.import_fabric(ctx, desc)
                kind, contents = "cuda-fabric", mapping.read(0, mapping.size)
                mapping.close()
            else:
                import vmm_ipc_cuda as vc  # needs cuda.bindings and a GPU
                ctx = vc.Context(0)
                mapping = vc.import_descriptor(ctx, desc)
                kind, contents = "cuda", mapping.read(0, mapping.size)
                mapping.close()
        if args.check_seed is not None and contents != peer.pattern(args.check_seed, len(contents)):
            sys.exit(f"buffer {args.buffer}: not the pattern of seed {args.check_seed}")
        print(f"OK {args.buffer}: {kind}, {len(contents)} bytes, from daemon pid {conn.peer.pid} "
              f"(lists: {'; '.join(listing.splitlines())})")


if __name__ == "__main__":
    main()
