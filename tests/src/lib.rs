//! Shared helpers of the scenario suite (a downstream crate's view of vmm-core).

use std::process::{Command, Output};

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

/// Run one test of the current test binary in a subprocess (with `--ignored`, so the
/// demonstration tests that fail on purpose can be ignored in normal runs), and return its output.
pub fn run_own_test(name: &str, env: &[(&str, Option<&str>)]) -> Output {
    let exe = std::env::current_exe().expect("current test executable");
    let mut command = Command::new(exe);
    command.args([
        "--exact",
        name,
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ]);
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
