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
use vmm_core::peer::Session;
use vmm_core::shm::HostBuffer;
use vmm_core::testing::{cuda_vmm_ipc, settled_open_fds, skip_unless};
use vmm_core::wire::endpoint::{Listener, ListenerOptions, Name};
use vmm_examples::{Daemon, Served, pattern};

/// The `vmm_ipc_peer` package, module by module (`python/vmm_ipc_peer_files.rs`).
const PEER: [(&str, &str); 14] = include!("../../python/vmm_ipc_peer_files.rs");
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
    let scripts = [("vmm_ipc_cuda.py", CUDA), ("daemon_client.py", CLIENT)];
    for (file, text) in PEER.into_iter().chain(scripts) {
        let path = dir.join(file);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
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
    rust_client_command(name, seed).spawn().unwrap()
}

/// The Rust client's command (this executable's `client_role`), not started yet.
fn rust_client_command(name: &Name, seed: u8) -> Command {
    let args = [
        name.to_string(),
        "weights".into(),
        "--check-seed".into(),
        seed.to_string(),
    ];
    let mut command = Command::new(std::env::current_exe().unwrap());
    command
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
        .stderr(Stdio::piped());
    command
}

fn python_client(dir: &PythonDir, name: &Name, seed: u8, fabric: bool) -> Child {
    let dir = &dir.0;
    Command::new("python3")
        .args([
            "daemon_client.py",
            &name.to_string(),
            "weights",
            "--check-seed",
        ])
        .arg(seed.to_string())
        .args(fabric.then_some("--fabric"))
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
        let silent = Session::connect(&name).unwrap();
        let fabric = kind == "cuda-fabric";
        let (rust, python) = (
            rust_client(&name, seed),
            python_client(&py, &name, seed, fabric),
        );
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

/// The daemon's `--gpu --fabric` buffer: served as a `CUDA_FABRIC` descriptor (protocol
/// version 2, no fds), imported over the fabric by both clients.
#[test]
fn the_daemon_serves_a_fabric_buffer_to_rust_and_python_clients() {
    let _serial = serial();
    let requirement =
        python_cuda().and_then(|()| vmm_core::testing::cuda_fabric().map_err(|e| e.to_string()));
    if !skip_unless(requirement) {
        return;
    }
    let resource = VirtualMemoryResource::new(
        &Device::new(0).unwrap(),
        ResourceOptions::default().handle_type(vmm_core::cuda::HandleType::Fabric),
    )
    .unwrap();
    let g = resource.granularity();
    let buf = resource
        .grow(&resource.allocate(g).unwrap(), 2 * g)
        .unwrap();
    buf.write_at(0, &pattern(11, buf.size())).unwrap();
    serve_to_both(
        Served::Cuda(buf),
        11,
        "cuda-fabric",
        2 * g,
        Duration::from_secs(120),
    );
}

/// The same, to a client that sees only the other GPU (`CUDA_VISIBLE_DEVICES=1`): the owner
/// is a device the client cannot see, and the memory is mapped for the client's own GPU.
#[test]
fn two_gpus_the_daemon_serves_a_fabric_buffer_to_a_client_of_the_other_gpu() {
    let _serial = serial();
    let requirement = vmm_core::testing::cuda_devices(2)
        .and_then(|()| vmm_core::testing::cuda_fabric())
        .map_err(|e| e.to_string());
    if !skip_unless(requirement) {
        return;
    }
    let resource = VirtualMemoryResource::new(
        &Device::new(0).unwrap(),
        ResourceOptions::default().handle_type(vmm_core::cuda::HandleType::Fabric),
    )
    .unwrap();
    let buf = resource.allocate(resource.granularity()).unwrap();
    buf.write_at(0, &pattern(12, buf.size())).unwrap();
    let name = Name::abstract_name(format!(
        "vmm-example-daemon-{}-other-gpu",
        std::process::id()
    ));
    let listener = Listener::bind(&name).unwrap();
    let mut daemon = Daemon::new();
    daemon.add("weights", Served::Cuda(buf));
    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| {
        let serving = scope.spawn(|| daemon.serve(&listener, &stop));
        let client = rust_client_command(&name, 12)
            .env("CUDA_VISIBLE_DEVICES", "1")
            .spawn()
            .unwrap();
        let out = report(client, Duration::from_secs(120));
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        assert!(out.contains("OK weights: cuda-fabric"), "{out}");
        serving.join().unwrap().unwrap();
    });
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

// ---------------------------------------------------------------------------------------------
// Running out of fds: the daemon pauses and keeps serving.

const DAEMON_ARGS_VAR: &str = "VMM_EXAMPLE_DAEMON_ARGS";

/// The daemon (`vmm_examples::daemon::run`, what `vmm-daemon`'s `main` calls), when
/// `DAEMON_ARGS_VAR` holds its arguments (separated by U+001F).
#[test]
#[ignore = "the daemon the other tests start"]
fn daemon_role() {
    let Ok(args) = std::env::var(DAEMON_ARGS_VAR) else {
        return;
    };
    let args: Vec<String> = args.split('\u{1f}').map(str::to_owned).collect();
    if let Err(e) = vmm_examples::daemon::run(&args) {
        panic!("vmm-daemon: {e}");
    }
}

/// A raw connection to `name` (no handshake: it never reads its HELLO nor says anything), or
/// `None` when the daemon's backlog is full.
fn idle_connection(name: &Name) -> Option<std::os::fd::OwnedFd> {
    use nix::sys::socket::{AddressFamily, SockFlag, SockType, UnixAddr, connect, socket};
    use std::os::fd::AsRawFd;
    let fd = socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
        None,
    )
    .unwrap();
    let Name::Abstract(bytes) = name else {
        panic!("abstract names only")
    };
    connect(fd.as_raw_fd(), &UnixAddr::new_abstract(bytes).unwrap())
        .ok()
        .map(|()| fd)
}

#[test]
fn the_daemon_keeps_serving_after_running_out_of_fds() {
    let _serial = serial();
    let works = Command::new("prlimit")
        .args(["--nofile=64:64", "true"])
        .status()
        .is_ok_and(|s| s.success());
    if !works {
        eprintln!(
            "SKIP the_daemon_keeps_serving_after_running_out_of_fds: no prlimit to lower the \
             daemon's fd limit"
        );
        return;
    }
    let name = Name::abstract_name(format!("vmm-example-fds-{}", std::process::id()));
    let mut daemon = Command::new("prlimit")
        .arg("--nofile=64:64")
        .arg(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "daemon_role",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
            "-q",
        ])
        .env(
            DAEMON_ARGS_VAR,
            // One uid (this one) may hold every slot here: the fd limit, not the cap per uid,
            // is what this test runs into.
            [
                "--size",
                "65536",
                "--max-connections-per-uid",
                "64",
                &name.to_string(),
            ]
            .join("\u{1f}"),
        )
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The daemon's log, line by line.
    let (lines_tx, lines) = std::sync::mpsc::channel::<String>();
    let stderr = daemon.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            if lines_tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut log = Vec::new();
    let wait_for = |words: &str, log: &mut Vec<String>| -> bool {
        while let Ok(line) = lines.recv_timeout(Duration::from_secs(30)) {
            log.push(line);
            if log.last().unwrap().contains(words) {
                return true;
            }
        }
        false
    };
    assert!(wait_for("serving `weights`", &mut log), "{log:#?}");
    // More idle connections than the daemon has fds for.
    let idle: Vec<_> = (0..100).filter_map(|_| idle_connection(&name)).collect();
    assert!(idle.len() > 64, "only {} connections", idle.len());
    assert!(
        wait_for("out of fds", &mut log),
        "the daemon never ran out of fds (or died): {log:#?}"
    );
    assert!(
        daemon.try_wait().unwrap().is_none(),
        "the daemon exited: {log:#?}"
    );
    drop(idle);
    // A normal client is served once the idle ones are gone.
    let conn = Session::connect(&name).unwrap_or_else(|e| panic!("{e}: {log:#?}"));
    let fetched = vmm_examples::client::fetch(&conn, "weights").unwrap();
    assert_eq!(fetched.contents().unwrap(), pattern(7, 65536));
    drop((fetched, conn));
    assert!(
        daemon.try_wait().unwrap().is_none(),
        "the daemon exited: {log:#?}"
    );
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(daemon.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let status = daemon.wait().unwrap();
    reader.join().unwrap();
    while let Ok(line) = lines.try_recv() {
        log.push(line);
    }
    assert!(status.success(), "{status:?}: {log:#?}");
    assert!(
        log.iter()
            .any(|l| l.contains("stopped after serving 1 descriptor")),
        "{log:#?}"
    );
}
