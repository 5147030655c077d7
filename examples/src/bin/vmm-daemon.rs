//! `vmm-daemon [--gpu] [--size BYTES] [--allow-uid UID]... [NAME]`: own one buffer, `weights`
//! (a CUDA VMM buffer of two chunks with `--gpu`, else a host memfd buffer of BYTES, default
//! 4 MiB), filled with the examples' pattern of seed 7, and serve it on NAME (default
//! `@vmm-ipc-daemon`; a path such as `$XDG_RUNTIME_DIR/vmm/daemon.sock` works too) until
//! SIGINT or SIGTERM. Clients: `vmm-client NAME weights --check-seed 7`, or
//! `python3 examples/python/daemon_client.py NAME weights --check-seed 7`.

use std::sync::atomic::{AtomicBool, Ordering};

use vmm_core::cuda::{Device, ResourceOptions, VirtualMemoryResource};
use vmm_core::shm::HostBuffer;
use vmm_core::wire::endpoint::{Allow, Listener, ListenerOptions, Name};
use vmm_examples::{Daemon, Served, pattern};

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn stop(_: libc::c_int) {
    // An atomic store is async-signal-safe.
    STOP.store(true, Ordering::Relaxed);
}

fn main() -> vmm_core::Result<()> {
    let mut args = std::env::args().skip(1);
    let (mut gpu, mut size, mut allow, mut name) = (false, 4 << 20, Allow::same_user(), None);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--gpu" => gpu = true,
            "--size" => {
                size = args
                    .next()
                    .and_then(|v| v.parse().ok())
                    .expect("--size BYTES")
            }
            "--allow-uid" => {
                allow = allow.uid(
                    args.next()
                        .and_then(|v| v.parse().ok())
                        .expect("--allow-uid UID"),
                )
            }
            other => name = Some(other.to_owned()),
        }
    }
    let name: Name = name.as_deref().unwrap_or("@vmm-ipc-daemon").into();
    let mut daemon = Daemon::new();
    let weights = if gpu {
        let resource = VirtualMemoryResource::new(&Device::new(0)?, ResourceOptions::default())?;
        let g = resource.granularity();
        let buf = resource.grow(&resource.allocate(g)?, 2 * g)?;
        buf.write_at(0, &pattern(7, buf.size()))?;
        Served::Cuda(buf)
    } else {
        let buf = HostBuffer::new(size)?;
        buf.write_at(0, &pattern(7, size))?;
        Served::Host(buf)
    };
    daemon.add("weights", weights);
    // SAFETY: `stop` only stores to an atomic, which is async-signal-safe.
    unsafe {
        libc::signal(libc::SIGINT, stop as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, stop as *const () as libc::sighandler_t);
    }
    let listener = Listener::bind_with(&name, ListenerOptions::default().allow(allow))?;
    eprintln!("vmm-daemon: serving `weights` on {name} (Ctrl-C to stop)");
    daemon.serve(&listener, &STOP)?;
    eprintln!(
        "vmm-daemon: stopped after serving {} descriptor(s)",
        daemon.served()
    );
    Ok(())
}
