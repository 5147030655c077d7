//! The example daemon serves its buffer to a Rust client and a Python client at once, both
//! started with `std::process::Command` (not by vmm-core), while a third client sits connected
//! and silent: each client checks the buffer's pattern; the daemon's fds end where they started.
//! The host buffer runs everywhere; the GPU buffer needs a GPU and `cuda.bindings` in python3.
//!
//! The Rust client is this executable re-run (`client_role`, which calls the same
//! `vmm_examples::client::run` as `vmm-client`'s `main`); the Python files are embedded and
//! written to a temporary directory, so a staged copy of this executable needs no checkout.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::AtomicBool;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use vmm_core::cuda::{Device, ResourceOptions, VirtualMemoryResource};
use vmm_core::shm::HostBuffer;
use vmm_core::testing::{cuda_vmm_ipc, settled_open_fds, skip_unless};
use vmm_core::wire::endpoint::{Connection, Listener, ListenerOptions, Name};
use vmm_examples::{Daemon, Served, pattern};

const PEER: &str = include_str!("../../python/vmm_ipc_peer.py");
const CUDA: &str = include_str!("../../python/vmm_ipc_cuda.py");
const CLIENT: &str = include_str!("../python/daemon_client.py");
const ARGS_VAR: &str = "VMM_EXAMPLE_CLIENT_ARGS";

/// The Rust client, when `ARGS_VAR` holds its arguments (separated by U+001F).
#[test]
#[ignore = "the Rust client the other tests start"]
fn client_role() {
    let Ok(args) = std::env::var(ARGS_VAR) else {
        return;
    };
    let args: Vec<String> = args.split('\u{1f}').map(str::to_owned).collect();
    match vmm_examples::client::run(&args) {
        Ok(report) => println!("{report}"),
        Err(e) => panic!("vmm-client: {e}"),
    }
}

fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// The embedded Python files, written to a fresh directory that is removed on drop.
struct PythonDir(PathBuf);

impl Drop for PythonDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn python_dir() -> PythonDir {
    let dir = std::env::temp_dir().join(format!("vmm-examples-python-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for (file, text) in [
        ("vmm_ipc_peer.py", PEER),
        ("vmm_ipc_cuda.py", CUDA),
        ("daemon_client.py", CLIENT),
    ] {
        std::fs::write(dir.join(file), text).unwrap();
    }
    PythonDir(dir)
}

fn python_ok(code: &str) -> bool {
    Command::new("python3")
        .args(["-c", code])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn python3() -> Result<(), String> {
    if python_ok("import sys; assert sys.version_info >= (3, 9)") {
        Ok(())
    } else {
        Err("no python3 (3.9 or newer) on PATH".into())
    }
}

fn python_cuda() -> Result<(), String> {
    cuda_vmm_ipc()?;
    python3()?;
    if python_ok("import cuda.bindings.driver") {
        Ok(())
    } else {
        Err("python3 cannot import cuda.bindings (pip install cuda-python)".into())
    }
}

fn rust_client(name: &Name, seed: u8) -> Child {
    let args = [
        name.to_string(),
        "weights".into(),
        "--check-seed".into(),
        seed.to_string(),
    ];
    Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "client_role",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
            "-q",
        ])
        .env(ARGS_VAR, args.join("\u{1f}"))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

fn python_client(dir: &PythonDir, name: &Name, seed: u8) -> Child {
    let dir = &dir.0;
    Command::new("python3")
        .args([
            "daemon_client.py",
            &name.to_string(),
            "weights",
            "--check-seed",
        ])
        .arg(seed.to_string())
        .current_dir(dir)
        .env("PYTHONPATH", dir)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// The client's output, once it exited successfully with an `OK` report (killed past `within`).
fn report(mut child: Child, within: Duration) -> String {
    let deadline = Instant::now() + within;
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let output = child.wait_with_output().unwrap();
    let out = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        output.status.success() && out.contains("OK weights: "),
        "{out}"
    );
    out
}

/// Serve `weights` (pattern of `seed`) to a Rust and a Python client at once, with a silent
/// client connected throughout; both reports name `kind` and `size`.
fn serve_to_both(weights: Served, seed: u8, kind: &str, size: usize, within: Duration) {
    let py = python_dir();
    let name = Name::abstract_name(format!("vmm-example-daemon-{}-{seed}", std::process::id()));
    // A connection may stay silent for 30 s: longer than a client waits to be admitted (10 s),
    // so a daemon that served one connection at a time would fail the clients below.
    let listener = Listener::bind_with(
        &name,
        ListenerOptions::default().timeout(Some(Duration::from_secs(30))),
    )
    .unwrap();
    let mut daemon = Daemon::new();
    daemon.add("weights", weights);
    let stop = AtomicBool::new(false);
    /// Stops the daemon however the scope ends (a failed assertion included), so that a
    /// failure fails the test instead of leaving the scope waiting for the daemon forever.
    struct StopOnDrop<'a>(&'a AtomicBool);
    impl Drop for StopOnDrop<'_> {
        fn drop(&mut self) {
            self.0.store(true, std::sync::atomic::Ordering::Relaxed);
        }
    }
    std::thread::scope(|scope| {
        let serving = scope.spawn(|| daemon.serve(&listener, &stop));
        let _stop = StopOnDrop(&stop);
        // Connected and admitted first, and never says a word while the others are served.
        let silent = Connection::connect(&name).unwrap();
        let (rust, python) = (rust_client(&name, seed), python_client(&py, &name, seed));
        let expected = format!(
            "OK weights: {kind}, {size} bytes, from daemon pid {}",
            std::process::id()
        );
        let listing = format!("(lists: weights {kind} {size})");
        for out in [report(rust, within), report(python, within)] {
            assert!(out.contains(&expected) && out.contains(&listing), "{out}");
        }
        drop(silent);
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        serving.join().unwrap().unwrap();
    });
    assert_eq!(daemon.served(), 2);
}

#[test]
fn the_daemon_serves_a_host_buffer_to_rust_and_python_clients() {
    // Both count fds: one at a time.
    let _serial = serial();
    if !skip_unless(python3()) {
        return;
    }
    let before = settled_open_fds().unwrap();
    let size = 4 << 20;
    let buf = HostBuffer::new(size).unwrap();
    buf.write_at(0, &pattern(7, size)).unwrap();
    serve_to_both(Served::Host(buf), 7, "host", size, Duration::from_secs(60));
    assert_eq!(settled_open_fds().unwrap(), before);
}

#[test]
fn the_daemon_serves_a_gpu_buffer_to_rust_and_python_clients() {
    // Both count fds: one at a time.
    let _serial = serial();
    if !skip_unless(python_cuda()) {
        return;
    }
    let resource =
        VirtualMemoryResource::new(&Device::new(0).unwrap(), ResourceOptions::default()).unwrap();
    let g = resource.granularity();
    let run = |seed: u8| {
        let buf = resource
            .grow(&resource.allocate(g).unwrap(), 2 * g)
            .unwrap();
        assert_eq!(buf.chunk_sizes().len(), 2);
        buf.write_at(0, &pattern(seed, buf.size())).unwrap();
        serve_to_both(
            Served::Cuda(buf),
            seed,
            "cuda",
            2 * g,
            Duration::from_secs(120),
        );
    };
    // The first run opens what the driver keeps for the process's life (its first export).
    run(8);
    let before = settled_open_fds().unwrap();
    run(9);
    assert_eq!(settled_open_fds().unwrap(), before);
}
