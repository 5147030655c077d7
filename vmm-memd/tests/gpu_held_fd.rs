//! Issue 26 item 4's GPU question, which the service's restart survival rests on: does an
//! exported POSIX fd that is only held (never imported) keep a VMM allocation's physical
//! memory, and its contents, alive after the process that created it exits?
//!
//! A creator process allocates 64 MiB on device 0, fills it with a pattern, exports it, sends
//! the fd to this process (the holder, which never imports it and never makes a CUDA
//! context) and exits. Two seconds after the creator has been reaped, an importer process is
//! sent the held fd, imports it and reads every byte back. The answer (yes on the H200,
//! driver 580) is recorded in `vmm-memd/README.md`. Needs a GPU (`SKIP` without one).

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::test_exe;
use vmm_core::cuda::{Device, ResourceOptions, VirtualMemoryResource};
use vmm_core::peer::Session;
use vmm_core::testing::{cuda_vmm_ipc, skip_unless};
use vmm_core::wire::endpoint::{Listener, Name};

/// 64 MiB.
const LEN: usize = 64 << 20;

fn pattern(len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect()
}

/// The entry of the creator and importer processes (does nothing in a plain test run).
#[test]
fn held_fd_role() {
    let Ok(role) = std::env::var("HELD_FD_ROLE") else {
        return;
    };
    let name = Name::from(std::env::var("HELD_FD_SOCKET").unwrap().as_str());
    let device = Device::new(0).unwrap();
    let resource = VirtualMemoryResource::new(&device, ResourceOptions::default()).unwrap();
    let session = Session::connect(&name).unwrap();
    match role.as_str() {
        "creator" => {
            let buffer = resource.allocate(LEN).unwrap();
            buffer.write_at(0, &pattern(LEN)).unwrap();
            session.send_descriptor(&buffer.export().unwrap()).unwrap();
            // Wait until the holder has the fd, then exit (the buffer is released first).
            session.recv_data().unwrap();
        }
        "importer" => {
            let descriptor = session.recv_descriptor().unwrap().into_cuda().unwrap();
            let verdict = match resource.import(&descriptor) {
                Ok(buffer) => {
                    let mut back = vec![0u8; LEN];
                    buffer.read_at(0, &mut back).unwrap();
                    if back == pattern(LEN) {
                        "INTACT".to_owned()
                    } else {
                        "CHANGED".to_owned()
                    }
                }
                Err(e) => format!("IMPORT-FAILED {e}"),
            };
            session.send_data(verdict.as_bytes()).unwrap();
        }
        other => panic!("unknown role {other}"),
    }
}

fn spawn(role: &str, socket: &str) -> std::process::Child {
    Command::new(test_exe())
        .args([
            "--exact",
            "held_fd_role",
            "--nocapture",
            "--test-threads=1",
            "-q",
        ])
        .env("HELD_FD_ROLE", role)
        .env("HELD_FD_SOCKET", socket)
        .stdin(Stdio::null())
        .spawn()
        .unwrap()
}

/// The creator exits; the fd this process only held still imports, with every byte intact.
#[test]
fn a_held_exported_fd_keeps_the_memory_after_its_creator_exits() {
    if !skip_unless(cuda_vmm_ipc()) {
        return;
    }
    let socket = format!("@vmm-memd-held-fd-{}", std::process::id());
    let listener = Listener::bind(&Name::from(socket.as_str())).unwrap();
    let mut creator = spawn("creator", &socket);
    let session = Session::accept(&listener, Some(Duration::from_secs(60))).unwrap();
    let held = session.recv_descriptor().unwrap().into_cuda().unwrap();
    session.send_data(b"held").unwrap();
    assert!(creator.wait().unwrap().success());
    drop(session);
    std::thread::sleep(Duration::from_secs(2));
    let mut importer = spawn("importer", &socket);
    let session = Session::accept(&listener, Some(Duration::from_secs(60))).unwrap();
    session.send_descriptor(&held).unwrap();
    let verdict = String::from_utf8(session.recv_data().unwrap()).unwrap();
    assert!(importer.wait().unwrap().success());
    eprintln!("held fd after its creator exited: {verdict}");
    assert_eq!(verdict, "INTACT");
}
