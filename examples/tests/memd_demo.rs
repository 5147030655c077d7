//! A smoke test of the demo against a real `vmm-memd` (host memory): the Rust demo publishes,
//! the Rust and Python demos attach and check it, the Python demo publishes the next
//! generation, the Rust one checks that (and refuses it under the old seed), each a process of
//! its own that exits (the service holds the memory between them).
//!
//! The service and the Rust demo are this test executable re-run (`service_role`, which runs
//! `vmm_memd::cli::main`, and `demo_role`, which runs `vmm_examples::demo::run`); the Python
//! files are embedded and written to a temporary directory, so a staged copy of this
//! executable needs no checkout. Without `python3` (3.9+) the Python part prints one `SKIP`
//! line, and fails instead under `VMM_REQUIRE_PYTHON=1` or `VMM_REQUIRE_GPU=1`.

use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use vmm_core::testing::skip_unless;
use vmm_core::wire::endpoint::Name;

const ARGS_VAR: &str = "VMM_DEMO_ROLE_ARGS";
const PEER: &[(&str, &str)] = &include!("../../python/vmm_ipc_peer_files.rs");
/// The `vmm_memd` package (with the CUDA helper it imports for GPU regions).
const MEMD: &[(&str, &str)] = &include!("../../python/vmm_memd_files.rs");
/// The Python demo.
const DEMO: (&str, &str) = ("memd_demo.py", include_str!("../python/memd_demo.py"));

/// The role's arguments (separated by U+001F), when this process plays one.
fn role_args() -> Option<Vec<String>> {
    let args = std::env::var(ARGS_VAR).ok()?;
    Some(args.split('\u{1f}').map(str::to_owned).collect())
}

#[test]
#[ignore = "the service the smoke test starts"]
fn service_role() {
    if let Some(args) = role_args() {
        std::process::exit(vmm_memd::cli::main(&args));
    }
}

#[test]
#[ignore = "the Rust demo the smoke test starts"]
fn demo_role() {
    if let Some(args) = role_args() {
        match vmm_examples::demo::run(&args) {
            Ok(report) => println!("{report}"),
            Err(e) => {
                eprintln!("{e}");
                std::process::exit(1);
            }
        }
    }
}

/// This executable re-run as its ignored test `role` with `args`.
fn role(role: &str, args: &[&str]) -> Command {
    let mut command = Command::new(std::env::current_exe().unwrap());
    command
        .args([
            "--exact",
            role,
            "--ignored",
            "--nocapture",
            "--test-threads=1",
            "-q",
        ])
        .env(ARGS_VAR, args.join("\u{1f}"))
        .stdin(Stdio::null());
    command
}

/// The service, SIGTERMed and reaped on drop.
struct Service(Child, String);

impl Drop for Service {
    fn drop(&mut self) {
        // SAFETY: kill of our own child (not reaped yet).
        unsafe { libc::kill(self.0.id() as i32, libc::SIGTERM) };
        let _ = self.0.wait();
    }
}

/// The `OK ...` or `published ...` line of a demo's output, which must have succeeded.
fn report(output: Output, starts: &str) -> String {
    let (out, err) = (
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr),
    );
    assert!(output.status.success(), "{out}{err}");
    let line = out.lines().find(|l| l.starts_with(starts));
    line.unwrap_or_else(|| panic!("no {starts:?} line: {out}{err}"))
        .to_owned()
}

/// Whether `python3` (3.9+) runs here; when not, one `SKIP` line (vmm-core's
/// `skip_unless`, which fails instead under `VMM_REQUIRE_GPU=1`), or a failure under
/// `VMM_REQUIRE_PYTHON=1`.
fn python3() -> bool {
    let ok = Command::new("python3")
        .args(["-c", "import sys; assert sys.version_info >= (3, 9)"])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    let strict = std::env::var("VMM_REQUIRE_PYTHON").is_ok_and(|v| v == "1");
    assert!(ok || !strict, "no python3 (3.9+), and VMM_REQUIRE_PYTHON=1");
    skip_unless(ok.then_some(()).ok_or("no python3 (3.9 or newer) on PATH"))
}

#[test]
fn the_demo_publishes_and_attaches_from_rust_and_python() {
    let socket = format!("@vmm-examples-demo-{}", std::process::id());
    let args = [
        "--socket",
        &socket,
        "--quota-bytes",
        "1073741824",
        "--no-keeper",
    ];
    let service = Service(role("service_role", &args).spawn().unwrap(), socket.clone());
    let started = Instant::now();
    while vmm_memd::Client::connect(&Name::from(socket.as_str())).is_err() {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "vmm-memd did not come up"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let rust = |words: &[&str]| {
        role("demo_role", &[&["--socket", &service.1], words].concat())
            .output()
            .unwrap()
    };
    let published = report(rust(&["publish"]), "published");
    assert_eq!(
        published,
        "published demo-weights generation 1: 4 tensors (seed 7)"
    );
    let ok1 = "OK demo-weights generation 1: 4 tensors, every byte as published with seed 7";
    assert_eq!(report(rust(&["attach"]), "OK"), ok1);
    let ok2 = "OK demo-weights generation 2: 4 tensors, every byte as published with seed 9";
    if python3() {
        let dir = std::env::temp_dir().join(format!("vmm-examples-demo-{}", std::process::id()));
        for (file, text) in PEER.iter().chain(MEMD.iter()).chain([&DEMO]) {
            std::fs::create_dir_all(dir.join(file).parent().unwrap()).unwrap();
            std::fs::write(dir.join(file), text).unwrap();
        }
        let python = |words: &[&str]| python_demo(&dir, &service.1, words);
        assert_eq!(report(python(&["attach"]), "OK"), ok1);
        let published = report(python(&["--seed", "9", "publish"]), "published");
        assert_eq!(
            published,
            "published demo-weights generation 2: 4 tensors (seed 9)"
        );
        assert_eq!(report(python(&["--seed", "9", "attach"]), "OK"), ok2);
        std::fs::remove_dir_all(&dir).unwrap();
    } else {
        report(rust(&["--seed", "9", "publish"]), "published");
    }
    assert_eq!(report(rust(&["--seed", "9", "attach"]), "OK"), ok2);
    // The check is real: generation 2 is not seed 7's.
    let stale = rust(&["attach"]);
    assert_eq!(stale.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&stale.stderr).contains("is not seed 7's"));
}

/// `python3 memd_demo.py --socket SOCKET WORDS...` in `dir`; its output.
fn python_demo(dir: &Path, socket: &str, words: &[&str]) -> Output {
    Command::new("python3")
        .args(["memd_demo.py", "--socket", socket])
        .args(words)
        .current_dir(dir)
        .env("PYTHONPATH", dir)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

/// The program cargo built, where it exists (not where this executable was copied alone:
/// then a `SKIP` line): a usage error is exit status 2 with the usage on stderr.
#[test]
fn the_built_program_says_its_usage() {
    let exe = Path::new(env!("CARGO_BIN_EXE_memd-demo"));
    if !exe.exists() {
        eprintln!(
            "SKIP the_built_program_says_its_usage: {} is not here",
            exe.display()
        );
        return;
    }
    let out = Command::new(exe).arg("frobnicate").output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("usage: memd-demo"));
}
