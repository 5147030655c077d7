//! Running the Python tests (`python/tests`, unittest) from a Rust test: the embedded Python
//! files written to a temporary directory (a staged test executable needs no checkout), one
//! `python3 -m unittest` run within a deadline, and the skip rule: without `python3` a test
//! prints one `SKIP` line and passes, unless `VMM_REQUIRE_PYTHON=1` (or `VMM_REQUIRE_GPU=1`)
//! makes that a failure.
#![allow(dead_code)]

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// How long one run of the Python tests may take.
pub const DEADLINE: Duration = Duration::from_secs(300);

/// Whether a skip is a failure here.
pub fn strict() -> bool {
    ["VMM_REQUIRE_PYTHON", "VMM_REQUIRE_GPU"]
        .iter()
        .any(|v| std::env::var(v).is_ok_and(|v| v == "1"))
}

/// `Ok` when `python3` (3.9+) runs the `-c` program `check`; else `Err(missing)`.
pub fn python3_can(check: &str, missing: &str) -> Result<(), String> {
    let program = format!("import sys; assert sys.version_info >= (3, 9); {check}");
    let ok = Command::new("python3")
        .args(["-c", &program])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if ok { Ok(()) } else { Err(missing.to_owned()) }
}

/// `python3`, 3.9 or newer.
pub fn python3() -> Result<(), String> {
    python3_can("", "no python3 (3.9 or newer) on PATH")
}

/// `true` when `requirement` holds; otherwise one `SKIP <test>: <reason>` line on the real
/// stderr (libtest captures only `eprint!`) and in `VMM_SKIP_LOG`, and `false`; a failure
/// when [`strict`].
pub fn run_unless(test: &str, requirement: Result<(), String>) -> bool {
    let Err(reason) = requirement else {
        return true;
    };
    assert!(
        !strict(),
        "{test} would be skipped, but VMM_REQUIRE_PYTHON=1 or VMM_REQUIRE_GPU=1 requires it: \
         {reason}"
    );
    let line = format!("SKIP {test}: {reason}\n");
    let _ = std::io::stderr().write_all(line.as_bytes());
    if let Some(path) = std::env::var_os("VMM_SKIP_LOG") {
        let _ = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .and_then(|mut log| log.write_all(line.as_bytes()));
    }
    false
}

/// Python files (`(path, text)` pairs), written to a fresh directory; removed on drop.
pub struct PythonDir(pub PathBuf);

impl PythonDir {
    pub fn new(tag: &str, files: &[&[(&str, &str)]]) -> PythonDir {
        let dir = std::env::temp_dir().join(format!("vmm-memd-py-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for (file, text) in files.iter().flat_map(|f| f.iter()) {
            let path = dir.join(file);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, text).unwrap();
        }
        PythonDir(dir)
    }

    /// `python3 -m unittest -v MODULES` here with `env`, within [`DEADLINE`] (killed past
    /// it): its success and its output (stdout and stderr, through a file: no pipe to fill).
    pub fn unittest(&self, modules: &[&str], env: &[(&str, String)]) -> (bool, String) {
        self.unittest_within(modules, env, DEADLINE)
    }

    /// [`PythonDir::unittest`] within `deadline` rather than [`DEADLINE`].
    pub fn unittest_within(
        &self,
        modules: &[&str],
        env: &[(&str, String)],
        deadline: Duration,
    ) -> (bool, String) {
        let log_path = self.0.join("unittest.log");
        let log = std::fs::File::create(&log_path).unwrap();
        let mut child = Command::new("python3")
            .args(["-m", "unittest", "-v"])
            .args(modules)
            .current_dir(&self.0)
            .env("PYTHONPATH", &self.0)
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start python3");
        let status = wait_by(&mut child, deadline);
        let out = std::fs::read_to_string(&log_path).unwrap_or_default();
        match status {
            Some(status) => (status.success(), out),
            None => (false, format!("killed after {deadline:?}:\n{out}")),
        }
    }
}

impl Drop for PythonDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `child`'s exit status, or `None` (and the child killed and reaped) once `limit` has passed.
pub fn wait_by(
    child: &mut std::process::Child,
    limit: Duration,
) -> Option<std::process::ExitStatus> {
    let started = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return Some(status);
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Each of `tests` ran and passed (a `... ok` line), none skipped.
pub fn assert_passed(out: &str, tests: &[&str]) {
    for test in tests {
        let line = out.lines().find(|l| l.starts_with(&format!("{test} ")));
        assert!(
            line.is_some_and(|l| l.ends_with(" ok")),
            "{test} did not run and pass: {line:?}\n{out}"
        );
    }
}
