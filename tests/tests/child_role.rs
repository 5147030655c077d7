//! The environment-variable entry, attacked from outside: this test executable (which links
//! vmm-core, so it carries the pre-`main` hook) is started by `std::process::Command` with
//! `VMM_IPC_CHILD` naming an fd that is not what vmm-core hands a child, in a process vmm-core
//! did not start. Each time the process must ignore the variable and run its own `main` (here:
//! libtest's `--list`), never adopt the fd or wait on it for orders. A positive control shows
//! that the same launch with a genuine channel does take the role, so the refusals are the
//! checks' doing.
//!
//! Runs everywhere (no GPU); the cases that need another uid, a setgid file or a user namespace
//! need root and print one `SKIP` line without it.

use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use nix::sys::socket::{AddressFamily, SockFlag, SockType, socketpair};

const ROLE_VAR: &str = "VMM_IPC_CHILD";

/// What a child that took its role does when its channel closes before a start message.
const EXIT_NO_START: i32 = 121;

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

fn skip(test: &str, reason: &str) {
    eprintln!("SKIP {test}: {reason}");
}

fn seqpacket_pair() -> (OwnedFd, OwnedFd) {
    socketpair(
        AddressFamily::Unix,
        SockType::SeqPacket,
        None,
        SockFlag::SOCK_CLOEXEC,
    )
    .expect("socketpair")
}

/// Run `argv` (program first) with `ROLE_VAR=role` and `fd` inherited at its own number
/// (CLOEXEC cleared in the child only), stdin closed, asking libtest to `--list` (what this
/// executable does when it runs as itself). Our copy of `fd` and of `keep` close once it runs.
fn run_with_role(argv: &[&str], role: &str, fd: OwnedFd, keep: Option<OwnedFd>) -> Output {
    let raw = fd.as_raw_fd();
    let mut command = Command::new(argv[0]);
    command
        .args(&argv[1..])
        .env(ROLE_VAR, role)
        .env_remove("VMM_IPC_NO_AUTO_INIT")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // SAFETY: the closure only calls fcntl, which is async-signal-safe, on a number that is
    // open in the child (inherited from us).
    unsafe {
        command.pre_exec(move || {
            if libc::fcntl(raw, libc::F_SETFD, 0) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = command.spawn().expect("start the target");
    // The target holds its copy now: a target that took its role would wait on it until our
    // end (in `keep`) closes.
    drop(fd);
    drop(keep);
    child.wait_with_output().expect("wait for the target")
}

/// Run this executable with `--list` as our child, `role` naming `fd`; `keep` closes once it
/// runs.
fn run_self(role: &str, fd: OwnedFd, keep: OwnedFd) -> Output {
    let exe = this_exe();
    run_with_role(&[exe.to_str().unwrap(), "--list"], role, fd, Some(keep))
}

/// Run `prefix... exe --list` as our child, with a genuine channel: our own socketpair, its
/// end named by the role variable with our pid as the parent.
fn run_on_our_channel(prefix: &[&str], exe: &Path) -> Output {
    let (ours, theirs) = seqpacket_pair();
    let role = format!("spawn:{}:{}", theirs.as_raw_fd(), std::process::id());
    let exe = exe.to_str().unwrap();
    let argv: Vec<&str> = prefix.iter().copied().chain([exe, "--list"]).collect();
    run_with_role(&argv, &role, theirs, Some(ours))
}

fn this_exe() -> PathBuf {
    std::env::current_exe().expect("current_exe")
}

/// The target ignored the variable (its stderr says why, containing `reason`) and ran its own
/// main to the end: libtest listed this file's tests.
#[track_caller]
fn assert_ignored(output: &Output, reason: &str) {
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success() && stdout.contains("the_role_variable_alone_grants_nothing"),
        "the target did not run its own main (status {}); stdout:\n{stdout}\nstderr:\n{stderr}",
        output.status
    );
    assert!(
        stderr.contains(&format!("vmm-ipc: ignoring {ROLE_VAR}")) && stderr.contains(reason),
        "no refusal naming {reason:?} on stderr:\n{stderr}"
    );
}

/// What a program that links vmm-core calls first thing in `main` (and what links vmm-core's
/// pre-`main` hook into this executable, which uses nothing else of it).
#[test]
fn the_role_variable_alone_grants_nothing_init_is_a_no_op_here() {
    vmm_core::process::init();
}

#[test]
fn the_role_variable_alone_grants_nothing_positive_control() {
    // Our own socketpair, handed to our own child, as our uid: the role is taken, and the
    // child waits for a start message that never comes (its channel closes).
    let (ours, theirs) = seqpacket_pair();
    let role = format!("spawn:{}:{}", theirs.as_raw_fd(), std::process::id());
    let output = run_self(&role, theirs, ours);
    assert_eq!(
        output.status.code(),
        Some(EXIT_NO_START),
        "a genuine channel must be taken: {output:?}"
    );
    assert!(
        !String::from_utf8_lossy(&output.stdout).contains("the_role_variable_alone"),
        "the child ran libtest although it took its role"
    );
}

#[test]
fn the_role_variable_alone_grants_nothing_for_a_pipe() {
    let (read, write) = nix::unistd::pipe().expect("pipe");
    let role = format!("spawn:{}:{}", read.as_raw_fd(), std::process::id());
    let output = run_self(&role, read, write);
    assert_ignored(&output, "is not a socket");
}

#[test]
fn the_role_variable_alone_grants_nothing_for_an_fd_that_is_not_open() {
    // one to inherit.
    let (ours, theirs) = seqpacket_pair();
    let role = format!("spawn:{}:{}", 900, std::process::id());
    let output = run_self(&role, theirs, ours);
    assert_ignored(&output, "fd 900 is not open");
}

#[test]
fn the_role_variable_alone_grants_nothing_for_a_stream_socket() {
    let (ours, theirs) = socketpair(
        AddressFamily::Unix,
        SockType::Stream,
        None,
        SockFlag::SOCK_CLOEXEC,
    )
    .expect("socketpair");
    let role = format!("spawn:{}:{}", theirs.as_raw_fd(), std::process::id());
    let output = run_self(&role, theirs, ours);
    assert_ignored(&output, "is not a Unix SOCK_SEQPACKET socket");
}

#[test]
fn the_role_variable_alone_grants_nothing_when_the_peer_is_not_the_parent() {
    // The target's parent is a shell (which names itself, `$$`, as the parent); the socket's
    // peer is this test process, not that shell.
    let (ours, theirs) = seqpacket_pair();
    let fd = theirs.as_raw_fd();
    let script = format!(
        "{ROLE_VAR}=spawn:{fd}:$$ \"$0\" --list; exit $?",
        ROLE_VAR = ROLE_VAR
    );
    let output = run_with_role(
        &["sh", "-c", &script, this_exe().to_str().unwrap()],
        "unused",
        theirs,
        Some(ours),
    );
    assert_ignored(&output, "not the parent");
}

/// A child of ours whose parent died before its hook ran: its channel was made by the pid the
/// variable names, and the kernel gave it another parent. It must exit without running its
/// `main` (a test binary's `main` with no filter runs the whole suite, whose children could
/// end the same way: this ran away once, a thousand processes deep).
#[test]
fn an_orphaned_child_exits_without_running_main() {
    // The channel is ours (this process made it), and the variable names us; the target's
    // parent is a shell between us, as if we had died and it had been given to another.
    let (ours, theirs) = seqpacket_pair();
    let role = format!("spawn:{}:{}", theirs.as_raw_fd(), std::process::id());
    let output = run_with_role(
        &[
            "sh",
            "-c",
            "\"$0\" --list; exit $?",
            this_exe().to_str().unwrap(),
        ],
        &role,
        theirs,
        Some(ours),
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(
        output.status.code(),
        Some(120),
        "stdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(
        !stdout.contains("the_role_variable_alone_grants_nothing"),
        "the orphan ran its main:\n{stdout}"
    );
    assert!(stderr.contains("exiting without running main"), "{stderr}");
}

#[test]
fn the_role_variable_alone_grants_nothing_when_the_parent_named_is_not_the_parent() {
    let (ours, theirs) = seqpacket_pair();
    // The peer is us, and the variable names pid 2 (kthreadd), which is not our child's parent.
    let role = format!("spawn:{}:2", theirs.as_raw_fd());
    let output = run_self(&role, theirs, ours);
    assert_ignored(&output, "names pid 2 as the parent");
}

#[test]
fn the_role_variable_alone_grants_nothing_to_a_peer_of_another_uid() {
    const TEST: &str = "the_role_variable_alone_grants_nothing_to_a_peer_of_another_uid";
    if !is_root() {
        return skip(TEST, "running a process as another uid needs root");
    }
    // Our socket (uid 0) offered to a process that runs as uid 65534.
    let exe = copy_of_this_exe(0o755);
    let output = run_on_our_channel(
        &[
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
        ],
        exe.path(),
    );
    assert_ignored(&output, "runs as uid 0, and this process as uid 65534");
}

#[test]
fn the_role_variable_alone_grants_nothing_in_a_secure_exec_process() {
    const TEST: &str = "the_role_variable_alone_grants_nothing_in_a_secure_exec_process";
    if !is_root() {
        return skip(TEST, "making a setgid executable needs root");
    }
    // A setgid-root copy run with another real gid: the kernel marks it AT_SECURE. Its uid
    // stays ours and its parent is us, so only the secure-exec check stands in the way.
    let exe = copy_of_this_exe(0o2755);
    let output = run_on_our_channel(&["setpriv", "--regid=65534", "--clear-groups"], exe.path());
    if String::from_utf8_lossy(&output.stderr).contains("Permission denied") {
        return skip(
            TEST,
            "the copy cannot be executed (a nosuid or noexec mount?)",
        );
    }
    assert_ignored(&output, "secure-exec");
}

#[test]
fn the_role_variable_alone_grants_nothing_to_an_unmapped_user() {
    const TEST: &str = "the_role_variable_alone_grants_nothing_to_an_unmapped_user";
    let works = Command::new("unshare")
        .args(["-U", "true"])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !works {
        return skip(TEST, "unshare -U is not permitted here");
    }
    // In a user namespace without a mapping, the target runs as the overflow uid, and so does
    // every peer whose uid is unmapped there: a uid match would prove nothing.
    let output = run_on_our_channel(&["unshare", "-U"], &this_exe());
    assert_ignored(&output, "overflow uid");
}

/// A copy of this executable with `mode`, in a directory of its own that goes when dropped.
struct Copy {
    dir: PathBuf,
    file: PathBuf,
}

impl Copy {
    fn path(&self) -> &Path {
        &self.file
    }
}

impl Drop for Copy {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn copy_of_this_exe(mode: u32) -> Copy {
    let dir = std::env::temp_dir().join(format!(
        "vmm-child-role-{}-{mode:o}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    ));
    std::fs::create_dir(&dir).expect("create a directory for the copy");
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).expect("chmod dir");
    let file = dir.join("target");
    vmm_tests::copy_executable(&this_exe(), &file);
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(mode)).expect("chmod copy");
    Copy { dir, file }
}
