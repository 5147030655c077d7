//! What the named-endpoint tests (`endpoint`, `endpoint_attacks`, `peer_v2`) share: one test at
//! a time, re-running the test executable as a role, and speaking to an endpoint as a raw
//! `SOCK_SEQPACKET` peer would (fresh names: [`crate::unique_name`]).

use std::ffi::OsStr;
use std::io::{BufReader, IoSlice, Read};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::Path;
use std::process::{Child, ChildStdout, Command, Output, Stdio};
use std::time::{Duration, Instant};

use nix::sys::socket::{
    AddressFamily, ControlMessage, MsgFlags, SockFlag, SockType, UnixAddr, connect, sendmsg, socket,
};
use vmm_core::wire::endpoint::Name;

/// The role a re-run of the test executable plays (see [`role_command`]).
pub const ROLE_VAR: &str = "VMM_ENDPOINT_TEST_ROLE";
/// The endpoint a role works on.
pub const NAME_VAR: &str = "VMM_ENDPOINT_TEST_NAME";

/// In a re-run of the test executable: the role it plays and the name it works on, from
/// `ROLE_VAR` and `NAME_VAR`; `None` in an ordinary run, where `role_entry` does nothing.
pub fn role_and_name() -> Option<(String, Name)> {
    let role = std::env::var(ROLE_VAR).ok()?;
    let name: Name = std::env::var(NAME_VAR).unwrap().as_str().into();
    Some((role, name))
}

/// A command that re-runs `exe` (this test executable, or a copy) as `role` on `name`: its
/// ignored `role_entry` test alone, optionally through `wrapper` (`setpriv ...`, `unshare -U`),
/// with stdout and stderr piped. The caller adds whatever else the role reads.
pub fn role_command(exe: &Path, wrapper: &[impl AsRef<OsStr>], role: &str, name: &Name) -> Command {
    let mut command = match wrapper.split_first() {
        Some((program, args)) => {
            let mut c = Command::new(program);
            c.args(args).arg(exe);
            c
        }
        None => Command::new(exe),
    };
    command
        .args([
            "--exact",
            "role_entry",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
            "-q",
        ])
        .env(ROLE_VAR, role)
        .env(NAME_VAR, name.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    command
}

/// Wait for `child` with a deadline (killing it past that); its output, and all it wrote as
/// text: what is left in `rest` (its stdout, where the test took it to read a line first),
/// then its stdout, then its stderr.
pub fn finish(
    mut child: Child,
    rest: Option<BufReader<ChildStdout>>,
    within: Duration,
) -> (Output, String) {
    let deadline = Instant::now() + within;
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let mut text = String::new();
    if let Some(mut rest) = rest {
        rest.read_to_string(&mut text).unwrap();
    }
    let output = child.wait_with_output().unwrap();
    text.push_str(&String::from_utf8_lossy(&output.stdout));
    text.push_str(&String::from_utf8_lossy(&output.stderr));
    (output, text)
}

/// A fresh `SOCK_SEQPACKET` Unix socket (close-on-exec), the kind every endpoint uses: for a
/// raw peer that follows none of vmm-core's rules.
pub fn seqpacket_socket() -> OwnedFd {
    socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .unwrap()
}

/// A raw client socket connected to `name`: no credential check, no handshake, and it never
/// reads its HELLO unless the test does.
pub fn raw_client(name: &Name) -> OwnedFd {
    let fd = seqpacket_socket();
    let addr = match name {
        Name::Abstract(bytes) => UnixAddr::new_abstract(bytes).unwrap(),
        Name::Path(path) => UnixAddr::new(path.as_path()).unwrap(),
    };
    connect(fd.as_raw_fd(), &addr).unwrap();
    fd
}

/// Send one packet of `bytes` with `fds` attached, as a peer that follows no rules would.
pub fn send_raw(fd: &OwnedFd, bytes: &[u8], fds: &[RawFd]) {
    let iov = [IoSlice::new(bytes)];
    let cmsgs = [ControlMessage::ScmRights(fds)];
    let cmsgs: &[ControlMessage<'_>] = if fds.is_empty() { &[] } else { &cmsgs };
    sendmsg::<UnixAddr>(fd.as_raw_fd(), &iov, cmsgs, MsgFlags::empty(), None).unwrap();
}

/// A v1 header with these fields (what docs/protocol.md specifies), without the frame byte.
pub fn header(kind: u16, handle_type: u32, count: u32, payload: u32, size: u64) -> Vec<u8> {
    let mut h = Vec::with_capacity(64);
    h.extend_from_slice(b"VMMI");
    h.extend_from_slice(&1u16.to_le_bytes());
    h.extend_from_slice(&kind.to_le_bytes());
    h.extend_from_slice(&64u16.to_le_bytes());
    h.extend_from_slice(&0u16.to_le_bytes());
    h.extend_from_slice(&handle_type.to_le_bytes());
    h.extend_from_slice(&count.to_le_bytes());
    h.extend_from_slice(&payload.to_le_bytes());
    h.extend_from_slice(&size.to_le_bytes());
    h.extend_from_slice(&[0; 32]);
    h
}

/// A DATA message of docs/protocol.md carrying `payload`, with its frame byte (0: inline).
pub fn data_packet(payload: &[u8]) -> Vec<u8> {
    [
        &[0u8][..],
        &header(3, 0, 0, payload.len() as u32, 0),
        payload,
    ]
    .concat()
}
