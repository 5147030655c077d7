//! A torch engine restarts without reloading (issue 32, item 2), on a GPU: the Python test
//! `python/tests/test_memd_torch_engine.py` publishes a Llama of about 1B parameters (random
//! weights, bfloat16; nothing downloaded) with `vmm_memd.torch.publish_state_dict` from one
//! process, and serves it from engine processes that build the model on the meta device and
//! bind the attached weights zero-copy: the same logits as the publisher's; an engine
//! SIGKILLed and started again, ready again without loading anything; the service SIGKILLed
//! and restarted under a running engine, which keeps serving, and a new engine attaching the
//! same generation. Every process's timings are printed on stderr.
//!
//! This test executable plays the service (see `common`) and restarts it when the Python test
//! asks (a `kill-service` file in the control directory; `restarted` answers). The Python
//! files are embedded and written to a temporary directory: a staged copy of this executable
//! needs only `python3` with torch (CUDA), transformers and cuda.bindings. Without a GPU or
//! one of those it prints one `SKIP` line and passes; under `VMM_REQUIRE_GPU=1` that is a
//! failure.

mod common;
#[path = "common/python.rs"]
mod python;

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::ServiceProc;
use python::{PythonDir, python3_can, run_unless};

/// The `vmm_ipc_peer` package, module by module.
const PEER: &[(&str, &str)] = &include!("../../python/vmm_ipc_peer_files.rs");

/// The `vmm_memd` package (with the CUDA helper it imports for GPU regions).
const MEMD: &[(&str, &str)] = &include!("../../python/vmm_memd_files.rs");

/// The test.
const FILES: [(&str, &str); 1] = [(
    "test_memd_torch_engine.py",
    include_str!("../../python/tests/test_memd_torch_engine.py"),
)];

/// How long the Python test may take (it takes well under two minutes on an H200: this only
/// bounds a hang).
const DEADLINE: Duration = Duration::from_secs(540);

/// The service's quota: the model is 2.47 GB, chunks are rounded up to the granularity.
const QUOTA: &str = "17179869184";

#[test]
fn a_torch_engine_restarts_without_reloading() {
    let test = "a_torch_engine_restarts_without_reloading";
    if !vmm_core::testing::skip_unless(vmm_core::testing::cuda_vmm_ipc()) {
        return;
    }
    let python = python3_can(
        "import torch, transformers; from cuda.bindings import driver; \
         assert torch.cuda.is_available()",
        "python3 has no torch with CUDA, transformers or cuda.bindings",
    );
    if !run_unless(test, python) {
        return;
    }
    let mut service = ServiceProc::start(&["--quota-bytes", QUOTA]);
    let py = PythonDir::new("torch-engine", &[PEER, MEMD, &FILES]);
    let control = py.0.join("control");
    std::fs::create_dir(&control).unwrap();
    let log_path = py.0.join("unittest.log");
    let log = std::fs::File::create(&log_path).unwrap();
    let mut child = Command::new("python3")
        .args(["-m", "unittest", "-v", "test_memd_torch_engine"])
        .current_dir(&py.0)
        .env("PYTHONPATH", &py.0)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env("VMM_MEMD_SOCKET", &service.socket)
        .env("VMM_MEMD_RESTART_DIR", &control)
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .expect("start python3");
    // Restart the service when the Python test asks, until it ends (killed past DEADLINE).
    let started = Instant::now();
    let mut restarted = None;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if started.elapsed() > DEADLINE {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        if restarted.is_none() && control.join("kill-service").exists() {
            let at = Instant::now();
            service.signal(libc::SIGKILL);
            service.child.wait().unwrap();
            service.restart();
            restarted = Some(at.elapsed());
            std::fs::write(control.join("restarted"), b"").unwrap();
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let out = std::fs::read_to_string(&log_path).unwrap_or_default();
    println!("{out}");
    // The timings, on the real stderr (libtest captures println! of a passing test).
    let mut timings = std::fs::read_to_string(control.join("timings.txt")).unwrap_or_default();
    if let Some(took) = restarted {
        timings += &format!("  the service: SIGKILLed, started again and answering in {took:?}\n");
    }
    timings += &format!("  the Python test: {:?} in all\n", started.elapsed());
    let _ = std::io::stderr().write_all(timings.as_bytes());
    let status = status.unwrap_or_else(|| panic!("killed after {DEADLINE:?}:\n{out}"));
    // Both tests (test_an_engine_restarts_without_reloading and
    // test_publish_state_dict_round_trips_every_kind_of_tensor_on_the_gpu) ran and passed,
    // none skipped: "OK" alone, not "OK (skipped=...)". (Their report lines are not matched:
    // a warning printed while a test runs splits its line.)
    assert!(
        status.success() && out.contains("Ran 2 tests") && out.lines().any(|l| l == "OK"),
        "{out}"
    );
    assert!(restarted.is_some(), "the service was never restarted");
}
