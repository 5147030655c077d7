//! The environment settings vmm-core reads, at and past their documented maxima (the README's
//! Environment paragraph): a value at the maximum works; one past it, or absurd (300
//! children, `u64::MAX`, a negative number, a string of 64 KiB), is refused with
//! `Error::InvalidEnv` and the `EnvRule` it broke, or clamped with one line on stderr, as each
//! setting documents.
//!
//! Each case runs in a real process started with that environment: a child of `Context` that
//! checks the typed outcome (`probe_*`), or this test binary re-run with it, when what the
//! process prints on stderr is the point (`probe_every_setting`).

use std::time::Duration;

use rstest::rstest;
use serde::{Deserialize, Serialize};
use vmm_core::Error;
use vmm_core::error::{EnvRule, MAX_ENV_LEN};
use vmm_core::process::{
    Context, DEFAULT_DEPTH, DEPTH_VAR, DEVICES_VAR, MAX_DEPTH, MAX_DEVICE_ORDINAL, MAX_DEVICES,
    MAX_TIMEOUT, StartMethod, TIMEOUT_VAR, WarmOptions, WarmPool, default_timeout,
    try_default_timeout,
};
use vmm_core::wire::{Channel, MAX_SPIN_US, SPIN_VAR};
use vmm_tests::process_table::children_of;
use vmm_tests::{run_own_test, text};

const TIMEOUT: Duration = Duration::from_secs(60);

/// `u64::MAX`, as a variable would hold it.
const U64_MAX: &str = "18446744073709551615";

/// A value far longer than any setting reads (and short enough to pass `exec`).
fn huge() -> String {
    "9".repeat(64 << 10)
}

const TOO_LONG: EnvRule = EnvRule::TooLong {
    max: MAX_ENV_LEN as u64,
};

/// What `WarmOptions::from_env` must give, and how many children the process-wide pool must
/// then keep.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct WarmExpected {
    from_env: Result<(usize, Vec<usize>), EnvRule>,
    children: usize,
}

/// In a process started with the warm variables under test: `from_env` gives what is
/// expected (the variable and rule of a refusal), and the process-wide pool, once full, is
/// exactly the expected number of this process's children.
fn probe_warm_pool(expected: WarmExpected) {
    match (WarmOptions::from_env(), &expected.from_env) {
        (Ok(options), Ok((depth, devices))) => {
            assert_eq!(options.depth(), *depth);
            assert_eq!(options.devices(), &devices[..]);
        }
        (Err(Error::InvalidEnv { variable, rule, .. }), Err(want)) => {
            assert!(
                variable == DEPTH_VAR || variable == DEVICES_VAR,
                "{variable}"
            );
            assert_eq!(rule, *want);
        }
        (got, want) => panic!("from_env gave {got:?}, expected {want:?}"),
    }
    let waiting = WarmPool::global().fill().unwrap();
    assert_eq!(
        waiting.len(),
        expected.children,
        "children waiting in the pool"
    );
    let children = children_of(std::process::id());
    assert_eq!(
        children.len(),
        expected.children,
        "this process's children: {children:?}"
    );
}

/// Run `probe(expected)` in a child started with `env`, and require it to pass.
fn run_probe_with<F, A>(env: &[(&str, &str)], probe: F, expected: A)
where
    F: Fn(A) + Copy,
    A: Serialize + for<'de> Deserialize<'de>,
{
    let mut ctx = Context::new(StartMethod::Spawn);
    for (key, value) in env {
        ctx = ctx.with_env(*key, *value);
    }
    ctx.spawn(probe, expected).unwrap().join(TIMEOUT).unwrap();
}

/// `VMM_WARM_DEPTH`: up to `MAX_DEPTH` children (that many are started); past it, refused
/// (`EnvRule::TooLarge`, and so on), and the process-wide pool keeps the default depth: 300
/// does not start 300 children.
#[rstest]
#[case::zero("0", Ok(0))]
#[case::at_the_maximum(&MAX_DEPTH.to_string(), Ok(MAX_DEPTH))]
#[case::past_the_maximum(&(MAX_DEPTH + 1).to_string(), Err(EnvRule::TooLarge { max: MAX_DEPTH as u64 }))]
#[case::three_hundred("300", Err(EnvRule::TooLarge { max: MAX_DEPTH as u64 }))]
#[case::u64_max(U64_MAX, Err(EnvRule::TooLarge { max: MAX_DEPTH as u64 }))]
#[case::past_u64("18446744073709551616", Err(EnvRule::TooLarge { max: MAX_DEPTH as u64 }))]
#[case::negative("-1", Err(EnvRule::TooSmall))]
#[case::huge(&huge(), Err(TOO_LONG))]
#[case::not_a_number("lots", Err(EnvRule::Syntax))]
fn warm_depth_from_the_environment(#[case] value: &str, #[case] depth: Result<usize, EnvRule>) {
    let expected = WarmExpected {
        children: *depth.as_ref().unwrap_or(&DEFAULT_DEPTH),
        from_env: depth.map(|d| (d, Vec::new())),
    };
    // No devices: the children initialise no GPU, where there is one.
    let env = [(DEPTH_VAR, value), (DEVICES_VAR, "none")];
    run_probe_with(&env, probe_warm_pool, expected);
}

/// `VMM_WARM_DEVICES`: at most `MAX_DEVICES` ordinals up to `MAX_DEVICE_ORDINAL` (a pool
/// warming them works: a device the child does not see is skipped); past either, a negative
/// one, a huge list, refused by rule, and the pool keeps the default options.
#[rstest]
#[case::largest_ordinal(&MAX_DEVICE_ORDINAL.to_string(), Ok(vec![MAX_DEVICE_ORDINAL]))]
#[case::every_ordinal(&every_ordinal(MAX_DEVICES), Ok((0..MAX_DEVICES).collect()))]
#[case::past_the_largest_ordinal(&(MAX_DEVICE_ORDINAL + 1).to_string(), Err(EnvRule::TooLarge { max: MAX_DEVICE_ORDINAL as u64 }))]
#[case::three_hundred("0,300", Err(EnvRule::TooLarge { max: MAX_DEVICE_ORDINAL as u64 }))]
#[case::u64_max(U64_MAX, Err(EnvRule::TooLarge { max: MAX_DEVICE_ORDINAL as u64 }))]
#[case::negative("-1", Err(EnvRule::TooSmall))]
#[case::one_too_many(&every_ordinal(MAX_DEVICES + 1), Err(EnvRule::TooMany { max: MAX_DEVICES as u64 }))]
#[case::huge(&"0,".repeat(32 << 10), Err(TOO_LONG))]
#[case::not_a_list("gpu0", Err(EnvRule::Syntax))]
fn warm_devices_from_the_environment(
    #[case] value: &str,
    #[case] devices: Result<Vec<usize>, EnvRule>,
) {
    let expected = WarmExpected {
        children: if devices.is_ok() { 1 } else { DEFAULT_DEPTH },
        from_env: devices.map(|d| (1, d)),
    };
    run_probe_with(
        &[(DEPTH_VAR, "1"), (DEVICES_VAR, value)],
        probe_warm_pool,
        expected,
    );
}

/// `n` entries `0,1,2,...`, wrapping at the largest ordinal.
fn every_ordinal(n: usize) -> String {
    let entries: Vec<String> = (0..n)
        .map(|d| (d % (MAX_DEVICE_ORDINAL + 1)).to_string())
        .collect();
    entries.join(",")
}

fn noop(_: ()) {}

/// In a process started with `VMM_CHILD_TIMEOUT` under test: `try_default_timeout` gives what
/// is expected, and where it is a timeout, a child joined under it works.
fn probe_timeout(expected: Result<Duration, EnvRule>) {
    match (try_default_timeout(), expected) {
        (Ok(timeout), Ok(want)) => {
            assert_eq!(timeout, want);
            assert_eq!(default_timeout(), want);
            let ctx = Context::new(StartMethod::Spawn);
            assert_eq!(ctx.timeout(), want);
            assert!(ctx.spawn(noop, ()).unwrap().wait().unwrap().success());
        }
        (Err(Error::InvalidEnv { variable, rule, .. }), Err(want)) => {
            assert_eq!(variable, TIMEOUT_VAR);
            assert_eq!(rule, want);
        }
        (got, want) => panic!("try_default_timeout gave {got:?}, expected {want:?}"),
    }
}

/// `VMM_CHILD_TIMEOUT`: up to `MAX_TIMEOUT` kept as it is; past it (`u64::MAX` included) no
/// timeout, as `inf`; zero, negative, not a number or huge, refused by rule.
#[rstest]
#[case::at_the_maximum(&MAX_TIMEOUT.as_secs().to_string(), Ok(MAX_TIMEOUT))]
#[case::past_the_maximum(&(MAX_TIMEOUT.as_secs() + 1).to_string(), Ok(Duration::MAX))]
#[case::u64_max(U64_MAX, Ok(Duration::MAX))]
#[case::inf("inf", Ok(Duration::MAX))]
#[case::zero("0", Err(EnvRule::TooSmall))]
#[case::negative("-300", Err(EnvRule::TooSmall))]
#[case::huge(&huge(), Err(TOO_LONG))]
#[case::not_a_number("300s", Err(EnvRule::Syntax))]
fn child_timeout_from_the_environment(
    #[case] value: &str,
    #[case] expected: Result<Duration, EnvRule>,
) {
    run_probe_with(&[(TIMEOUT_VAR, value)], probe_timeout, expected);
}

/// Run by `every_setting_warns_at_most_once_and_works` in a process with the environment under
/// test: use every setting (the warm pool, the default timeout twice, receives twice) and say
/// what came of it on stdout; what the library warned is on stderr.
#[test]
#[ignore = "run with an environment of its driver's choosing"]
fn probe_every_setting() {
    let waiting = WarmPool::global().fill().unwrap();
    let children = children_of(std::process::id());
    println!(
        "warm children: {} waiting, {} started",
        waiting.len(),
        children.len()
    );
    let timeouts = [default_timeout(), default_timeout()];
    println!("timeout: {:?}", timeouts[0]);
    assert_eq!(timeouts[0], timeouts[1]);
    let (a, b) = Channel::pair().unwrap();
    for round in 0..2u8 {
        a.send(&[round], &[]).unwrap();
        assert_eq!(b.recv(Some(TIMEOUT)).unwrap().bytes, [round]);
    }
    println!("receives: ok");
}

/// The environment of one run of `probe_every_setting`: every variable set (or removed).
fn run_every_setting(
    depth: &str,
    timeout: Option<&str>,
    spin: Option<&str>,
) -> (String, Vec<String>) {
    let output = run_own_test(
        "probe_every_setting",
        &[
            (DEPTH_VAR, Some(depth)),
            (DEVICES_VAR, Some("none")),
            (TIMEOUT_VAR, timeout),
            (SPIN_VAR, spin),
        ],
    );
    let all = text(&output);
    assert!(output.status.success(), "the probe failed:\n{all}");
    let warnings = String::from_utf8_lossy(&output.stderr)
        .lines()
        .filter(|line| line.starts_with("vmm-ipc:"))
        .map(str::to_owned)
        .collect();
    (all, warnings)
}

/// Every setting at its maximum: no warning, and everything works.
#[test]
fn every_setting_at_its_maximum_works_without_a_warning() {
    let max_timeout = MAX_TIMEOUT.as_secs().to_string();
    let (all, warnings) = run_every_setting(
        &MAX_DEPTH.to_string(),
        Some(&max_timeout),
        Some(&MAX_SPIN_US.to_string()),
    );
    assert!(warnings.is_empty(), "{warnings:?}");
    for line in [
        &format!("warm children: {MAX_DEPTH} waiting, {MAX_DEPTH} started"),
        &format!("timeout: {MAX_TIMEOUT:?}"),
        "receives: ok",
    ] {
        assert!(all.contains(line), "{line:?} missing from:\n{all}");
    }
}

/// Absurd values, `u64::MAX` for each: the depth is refused (the default pool is kept, 2
/// children, not 300), the timeout becomes none, the spin is clamped, each with exactly one
/// line on stderr that names the variable, and everything works.
#[rstest]
#[case::three_hundred("300")]
#[case::u64_max(U64_MAX)]
fn absurd_values_warn_once_each_and_everything_works(#[case] depth: &str) {
    let (all, warnings) = run_every_setting(depth, Some(U64_MAX), Some(U64_MAX));
    for line in [
        &format!("warm children: {DEFAULT_DEPTH} waiting, {DEFAULT_DEPTH} started"),
        "timeout: 18446744073709551615.999999999s",
        "receives: ok",
    ] {
        assert!(all.contains(line), "{line:?} missing from:\n{all}");
    }
    for (variable, says) in [
        (
            DEPTH_VAR,
            format!("more than the maximum of {MAX_DEPTH} children"),
        ),
        (TIMEOUT_VAR, "no timeout".to_owned()),
        (SPIN_VAR, format!("clamped to {MAX_SPIN_US} us")),
    ] {
        let about: Vec<&String> = warnings
            .iter()
            .filter(|w| w.contains(&format!("{variable}=")))
            .collect();
        assert_eq!(about.len(), 1, "{variable}: {warnings:?}");
        assert!(about[0].contains(&says), "{variable}: {about:?}");
    }
    assert_eq!(warnings.len(), 3, "{warnings:?}");
}
