//! Shared helpers of the test suite (a downstream crate's view of vmm-core): every test target
//! in `tests/tests` takes what it shares from here, and only from here.

pub mod endpoint;
pub mod flood;
pub mod fuzz;
pub mod pki;
pub mod process_table;
pub mod turns;

use std::process::{Command, Output};

use cudarc::driver::sys;
use vmm_core::cuda::{Device, VirtualMemoryBuffer, VirtualMemoryResource};

/// The README's Rust examples, compiled (and, where not `no_run`, run) as this crate's doc
/// tests, so that the README cannot drift from the API.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
pub struct ReadmeExamples;

/// A byte pattern that differs per `seed` and per position.
pub fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| seed.wrapping_add((i % 251) as u8))
        .collect()
}

/// Every byte of a CUDA buffer, copied to the host.
pub fn contents(buf: &VirtualMemoryBuffer) -> Vec<u8> {
    let mut out = vec![0u8; buf.size()];
    buf.read_at(0, &mut out).unwrap();
    out
}

/// A buffer of `resource` made of `chunks` chunks of its granularity (allocated, then grown a
/// chunk at a time), filled with `pattern(1, ..)`.
pub fn filled_in(resource: &VirtualMemoryResource, chunks: usize) -> VirtualMemoryBuffer {
    let g = resource.granularity();
    let mut buf = resource.allocate(g).unwrap();
    for n in 2..=chunks {
        buf = resource.grow(&buf, n * g).unwrap();
    }
    assert_eq!(buf.chunk_sizes(), vec![g; chunks]);
    buf.write_at(0, &pattern(1, buf.size())).unwrap();
    buf
}

/// Copy an executable to `to`, to run it from there (as another uid, say). The copy is written
/// by `cp`, another process: written here, it would be open for writing in this process while
/// other tests' threads fork, and a forked child that holds that fd until its exec makes
/// executing the copy fail with ETXTBSY ("Text file busy").
pub fn copy_executable(from: &std::path::Path, to: &std::path::Path) {
    let copied = std::process::Command::new("cp")
        .arg(from)
        .arg(to)
        .status()
        .expect("run cp");
    assert!(
        copied.success(),
        "cp {} {}: {copied}",
        from.display(),
        to.display()
    );
}

/// Run one test of the current test binary in a subprocess (with `--ignored`, so the
/// demonstration tests that fail on purpose can be ignored in normal runs), and return its output.
pub fn run_own_test(name: &str, env: &[(&str, Option<&str>)]) -> Output {
    run_own_tests(&["--exact", name, "--test-threads=1"], env)
}

/// Run the ignored tests of the current test binary that `args` select (a name filter, and
/// libtest options such as `--test-threads=8`) in one subprocess, and return its output.
/// `env` sets (`Some`) or removes (`None`) environment variables.
pub fn run_own_tests(args: &[&str], env: &[(&str, Option<&str>)]) -> Output {
    let exe = std::env::current_exe().expect("current test executable");
    let mut command = Command::new(exe);
    command.args(["--ignored", "--nocapture"]).args(args);
    for (key, value) in env {
        match value {
            Some(value) => command.env(key, value),
            None => command.env_remove(key),
        };
    }
    command.output().expect("run the test binary")
}

/// stdout and stderr of `output`, together.
pub fn text(output: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// Where a process that stopped making progress is, as far as `/proc` tells (for a failing
/// test's message): each thread's name, state, kernel wait channel, the system call it is in
/// and, where readable (as root), its kernel stack.
pub fn where_stuck(pid: u32) -> String {
    let read = |path: String| {
        std::fs::read_to_string(path).map_or_else(|e| format!("({e})"), |s| s.trim().to_owned())
    };
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return format!("process {pid}: gone");
    };
    let mut report = format!("process {pid}:");
    for task in tasks.flatten() {
        let dir = task.path().display().to_string();
        let stat = read(format!("{dir}/stat"));
        let state = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .unwrap_or("?")
            .to_owned();
        report += &format!(
            "\n  thread {} ({}) state {state}, wchan {}, syscall {}\n    {}",
            task.file_name().to_string_lossy(),
            read(format!("{dir}/comm")),
            read(format!("{dir}/wchan")),
            read(format!("{dir}/syscall")),
            read(format!("{dir}/stack")).replace('\n', "\n    "),
        );
    }
    report
}

/// Panics unless `rc` is success, naming the driver call.
#[track_caller]
pub fn check(call: &str, rc: sys::CUresult) {
    assert_eq!(rc, sys::CUresult::CUDA_SUCCESS, "{call}");
}

/// Run `f` with `device`'s primary context current on this thread, waiting for its work, then
/// restore the thread's previous context. The buffer API always makes the buffer's own device
/// current, so a peer's access through a mapping is driven with the driver directly.
pub fn with_context_of(device: &Device, f: impl FnOnce()) {
    let mut raw = 0;
    // SAFETY: a live out-pointer; libcuda is loaded and initialised (vmm-core made `device`).
    check("cuDeviceGet", unsafe {
        sys::cuDeviceGet(&mut raw, device.ordinal() as i32)
    });
    let mut ctx = std::ptr::null_mut();
    // SAFETY: a live out-pointer and a valid device; released below.
    check("cuDevicePrimaryCtxRetain", unsafe {
        sys::cuDevicePrimaryCtxRetain(&mut ctx, raw)
    });
    let mut previous = std::ptr::null_mut();
    // SAFETY: a live out-pointer.
    check("cuCtxGetCurrent", unsafe {
        sys::cuCtxGetCurrent(&mut previous)
    });
    // SAFETY: `ctx` is retained (alive) until the release below.
    check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(ctx) });
    f();
    // SAFETY: acts on the current context, `ctx`.
    check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() });
    // SAFETY: `previous` was current on this thread a moment ago (or null) and nothing here
    // destroyed it.
    check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(previous) });
    // SAFETY: releases the retain above; this thread no longer has `ctx` current and nothing
    // here uses it again (vmm-core keeps its own retain where it uses a primary context).
    check("cuDevicePrimaryCtxRelease", unsafe {
        sys::cuDevicePrimaryCtxRelease_v2(raw)
    });
}

/// Embedded Python files (the peer, the CUDA helper, test roles), written to a fresh directory
/// for one test and removed when dropped: tests never read the repository's files at run time
/// (the GPU machine runs the built executables from elsewhere).
#[derive(Debug)]
pub struct PythonDir(pub std::path::PathBuf);

impl PythonDir {
    /// Write `files` (path relative to the directory, contents) to a fresh directory named
    /// after `tag`, this process and a counter.
    pub fn new<'a>(tag: &str, files: impl IntoIterator<Item = (&'a str, &'a str)>) -> PythonDir {
        use std::sync::atomic::{AtomicU32, Ordering};
        static N: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "vmm-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        for (file, text) in files {
            let path = dir.join(file);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, text).unwrap();
        }
        PythonDir(dir)
    }
}

impl Drop for PythonDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `Ok` when `python3` (3.9 or newer, for `socket.send_fds`) runs here and the `-c` program
/// `check` succeeds in it; else `Err(missing)`, a reason for a skip line.
pub fn python3_can(check: &str, missing: &str) -> Result<(), String> {
    let program = format!("import sys; assert sys.version_info >= (3, 9); {check}");
    let ok = Command::new("python3")
        .args(["-c", &program])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if ok { Ok(()) } else { Err(missing.to_owned()) }
}

/// A fresh abstract endpoint name, `vmm-<prefix>-<tag>-<pid>-<n>`: unique in this process
/// and across processes running at once.
pub fn unique_name(prefix: &str, tag: &str) -> vmm_core::wire::endpoint::Name {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    vmm_core::wire::endpoint::Name::abstract_name(format!(
        "vmm-{prefix}-{tag}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ))
}

/// This process's uid, as a peer role takes it on its command line.
pub fn own_uid() -> String {
    vmm_core::wire::endpoint::Credentials::of_this_process()
        .uid
        .to_string()
}
