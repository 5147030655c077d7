//! Running a test's body on the fake driver (`vmm-fake-driver`: a fake `libcuda.so`, one
//! device, allocations that are memfds, device addresses that are host addresses).
//!
//! cudarc `dlopen`s `libcuda.so` by name, and the dynamic loader reads `LD_LIBRARY_PATH` once,
//! when a process starts: so [`on_fake_driver`] writes the embedded fake to a fresh directory
//! and runs the test's body in a fresh exec of this test executable with that directory first
//! in `LD_LIBRARY_PATH`; the service the body starts ([`crate::common::ServiceProc`]) inherits
//! it. The body first checks that the device it sees is the fake's (a real driver on the
//! machine must not be picked instead).
//!
//! Included with `#[path]` by the test files that need it, next to `mod common;`.
#![allow(dead_code)]

use std::process::{Command, Stdio};
use std::time::Duration;

use vmm_core::cuda::Device;
use vmm_fake_driver::{DEVICE_NAME, DEVICE_UUID};

/// Set (to the fake's directory) in the fresh exec that runs a test's body on the fake driver.
pub const FAKE_DIR_VAR: &str = "VMM_FAKE_DRIVER_DIR";

/// How long a test's body may take in its own process.
pub const BODY_DEADLINE: Duration = Duration::from_secs(400);

/// Whether this process runs a test's body on the fake driver (started by [`on_fake_driver`]).
pub fn in_fake_exec() -> bool {
    std::env::var_os(FAKE_DIR_VAR).is_some()
}

/// Run `body` on the fake driver: here, when this process was started for that (with
/// [`FAKE_DIR_VAR`] and the fake first in `LD_LIBRARY_PATH`); otherwise install the fake in a
/// fresh owner-only directory and run test `test` alone in a fresh exec of this test
/// executable so started, which must run it and pass within [`BODY_DEADLINE`] (its output is
/// the failure's message).
pub fn on_fake_driver(test: &str, body: impl FnOnce()) {
    if in_fake_exec() {
        let device = Device::new(0).expect("device 0 of the fake driver");
        assert_eq!(
            (device.name(), device.uuid()),
            (DEVICE_NAME, &DEVICE_UUID),
            "LD_LIBRARY_PATH={:?} loaded another libcuda.so than the fake",
            std::env::var_os("LD_LIBRARY_PATH")
        );
        body();
        return;
    }
    let dir = std::env::temp_dir().join(format!("vmm-fake-driver-{}-{test}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    vmm_fake_driver::install(&dir).expect("write the fake libcuda.so");
    let log_path = dir.join("body.log");
    let log = std::fs::File::create(&log_path).unwrap();
    let mut child = Command::new(crate::common::test_exe())
        .args(["--exact", test, "--nocapture", "--test-threads=1", "-q"])
        // The test runs here because it was asked for, ignored or not.
        .arg("--include-ignored")
        .env("LD_LIBRARY_PATH", vmm_fake_driver::library_path(&dir))
        .env(FAKE_DIR_VAR, &dir)
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .expect("start this test executable on the fake driver");
    let exited = crate::common::until(BODY_DEADLINE, || child.try_wait().unwrap().is_some());
    if exited.is_none() {
        let _ = child.kill();
    }
    let status = child.wait().unwrap();
    let out = std::fs::read_to_string(&log_path).unwrap_or_default();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        exited.is_some() && status.success() && out.contains("1 passed"),
        "{test} on the fake driver ({status:?}{}):\n{out}",
        if exited.is_none() {
            format!(", killed after {BODY_DEADLINE:?}")
        } else {
            String::new()
        }
    );
    println!("{out}");
}
