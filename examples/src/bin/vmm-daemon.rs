//! `vmm-daemon [--gpu] [--size BYTES] [--allow-uid UID]... [--max-connections N] [NAME]`: own
//! one buffer, `weights` (a CUDA VMM buffer of two chunks with `--gpu`, else a host memfd buffer
//! of BYTES, default 4 MiB), filled with the examples' pattern of seed 7, and serve it on NAME
//! (default `@vmm-ipc-daemon`; a path such as `$XDG_RUNTIME_DIR/vmm/daemon.sock` works too)
//! until SIGINT or SIGTERM, to at most N connections at once (default 64). Clients:
//! `vmm-client NAME weights --check-seed 7`, or
//! `python3 examples/python/daemon_client.py NAME weights --check-seed 7`.

fn main() -> vmm_core::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    vmm_examples::daemon::run(&args)
}
