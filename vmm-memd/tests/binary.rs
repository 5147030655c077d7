//! The `vmm-memd` program: usage, exit codes, a graceful stop, delete.

mod common;

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{ServiceProc, program, publish};
use vmm_memd::{MemdError, Refusal};

/// Run `cmd` with `args`; its output.
fn output(mut cmd: Command, args: &[&str]) -> Output {
    cmd.args(args).stdin(Stdio::null()).output().unwrap()
}

/// `--help` and usage errors of the `vmm-memd` program that `cmd` starts: exit codes 0 and 2.
fn check_help_and_usage_errors(cmd: impl Fn() -> Command) {
    let help = output(cmd(), &["--help"]);
    assert_eq!(help.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&help.stdout).contains("usage: vmm-memd"));
    for bad in [
        &["--socket", "@x"][..],
        &["--quota-bytes", "1"],
        &["--socket", "@x", "--quota-bytes", "lots"],
        &["--socket", "@x", "--quota-bytes", "1", "--frobnicate"],
        &["--socket", "@x", "--quota-bytes", "1", "--quota", "nobody"],
    ] {
        let out = output(cmd(), bad);
        assert_eq!(out.status.code(), Some(2), "{bad:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.starts_with("vmm-memd: "), "{bad:?}: {stderr}");
        assert!(out.stdout.is_empty());
    }
}

#[test]
fn help_and_usage_errors_have_their_exit_codes() {
    check_help_and_usage_errors(|| program("vmm-memd"));
}

/// The programs cargo built, checked where they exist: on the build machine, not where a test
/// executable was copied alone (then a `SKIP` line says so). The other tests run the same
/// entries (`vmm_memd::cli::main`, `vmm_memd::ctl::main`) in this test executable.
#[test]
fn the_built_programs_answer_help_and_usage_errors() {
    let memd = Path::new(env!("CARGO_BIN_EXE_vmm-memd"));
    let memctl = Path::new(env!("CARGO_BIN_EXE_vmm-memctl"));
    if !memd.exists() || !memctl.exists() {
        println!(
            "SKIP the built programs: {} or {} is not here",
            memd.display(),
            memctl.display()
        );
        return;
    }
    check_help_and_usage_errors(|| Command::new(memd));
    let help = output(Command::new(memctl), &["--help"]);
    assert_eq!(help.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&help.stdout).starts_with("usage: vmm-memctl"));
    let bad = output(Command::new(memctl), &["--socket", "@x", "frobnicate"]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).starts_with("vmm-memctl: "));
    assert!(bad.stdout.is_empty());
}

#[test]
fn sigterm_stops_within_2_s_and_leaves_mapped_memory_intact() {
    let mut service = ServiceProc::start(&[]);
    let client = service.connect();
    publish(&client, "weights", 1, 1 << 20);
    let attached = client.attach("weights").unwrap();
    // A writer holds the region and another waits for it, for up to 30 s.
    let _writer = client
        .begin("weights", &[4096], Default::default())
        .unwrap();
    let waiter = service.connect();
    let waiting = std::thread::spawn(move || {
        let wait = vmm_memd::BeginOptions {
            wait: Duration::from_secs(30),
            ..Default::default()
        };
        waiter.begin("weights", &[4096], wait).map(drop)
    });
    std::thread::sleep(Duration::from_millis(100));
    // SAFETY: kill of our own child (not reaped yet).
    let sent = unsafe { libc::kill(service.child.id() as i32, libc::SIGTERM) };
    assert_eq!(sent, 0);
    let started = Instant::now();
    let status = loop {
        if let Some(status) = service.child.try_wait().unwrap() {
            break status;
        }
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "still running after 2 s"
        );
        std::thread::sleep(Duration::from_millis(5));
    };
    assert_eq!(status.code(), Some(0));
    assert!(
        waiting.join().unwrap().is_err(),
        "the waiting writer got no slot"
    );
    assert!(common::holds(&attached.chunks[0], 1));
    let err = client.status().unwrap_err();
    assert!(matches!(err, MemdError::ServiceGone(_)), "{err:?}");
    let err = service.try_connect().unwrap_err();
    assert!(matches!(err, MemdError::ServiceGone(_)), "{err:?}");
}

#[test]
fn delete_removes_the_name_at_once_and_the_memory_with_its_last_lease() {
    let service = ServiceProc::start(&[]);
    let client = service.connect();
    publish(&client, "gone", 1, 4096);
    let reader = service.connect();
    let attached = reader.attach("gone").unwrap();
    client.delete("gone").unwrap();
    assert!(client.list().unwrap().is_empty());
    let err = client.attach("gone").unwrap_err();
    assert!(
        matches!(err, MemdError::Refused(Refusal::NoSuchRegion { .. })),
        "{err:?}"
    );
    assert_eq!(client.status().unwrap().used, 4096, "held by the lease");
    reader.detach(&attached).unwrap();
    assert_eq!(client.status().unwrap().used, 0);
    // The name is free for a new region.
    assert_eq!(publish(&client, "gone", 1, 4096), 1);
}
