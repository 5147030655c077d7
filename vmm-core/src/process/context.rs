//! [`Context`]: how children are started, and what each is given.

use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::Duration;

use nix::sys::memfd::{MFdFlags, memfd_create};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::handle::Process;
use super::launch::{self, Launch, current_test_name};
use super::method::StartMethod;
use super::protocol::Start;
use super::tracker::{FateCell, Registry};
use super::{entry, forkserver, sys};
use crate::wire::{self, Channel};
use crate::{Error, Result};

/// The variable that sets the [default timeout](default_timeout), in seconds.
pub const TIMEOUT_VAR: &str = "VMM_CHILD_TIMEOUT";

/// The timeout when [`TIMEOUT_VAR`] is not set (or, for [`default_timeout`], is invalid).
pub const FALLBACK_TIMEOUT: Duration = Duration::from_secs(60);

/// Parse a timeout in seconds, as [`TIMEOUT_VAR`] gives it: a positive decimal number
/// (`30`, `0.5`, `1e3`). A number too large for a [`Duration`] (`1e30`, `inf`) saturates to
/// `Duration::MAX`, which every wait in vmm-core treats as "forever". Zero, a negative number,
/// NaN or anything that is not a number is [`Error::InvalidArgument`], naming the rule.
pub fn parse_timeout(value: &str) -> Result<Duration> {
    let refuse = |why: &str| {
        Err(Error::InvalidArgument(format!(
            "{TIMEOUT_VAR}={value:?}: {why}; give a positive number of seconds (such as 30, \
             0.5 or inf)"
        )))
    };
    let Ok(secs) = value.trim().parse::<f64>() else {
        return refuse("not a number of seconds");
    };
    if secs.is_nan() {
        return refuse("not a number of seconds (NaN)");
    }
    if secs <= 0.0 {
        return refuse("a timeout must be positive");
    }
    // Finite and too large, or infinite: forever.
    Ok(Duration::try_from_secs_f64(secs).unwrap_or(Duration::MAX))
}

/// The default child timeout from the environment: [`TIMEOUT_VAR`] parsed by
/// [`parse_timeout`] if it is set, else [`FALLBACK_TIMEOUT`] (60 s). An invalid value is
/// [`Error::InvalidArgument`]; `#[ipc_test]` fails a test with it rather than guess.
pub fn try_default_timeout() -> Result<Duration> {
    match std::env::var(TIMEOUT_VAR) {
        Ok(value) => parse_timeout(&value),
        Err(std::env::VarError::NotPresent) => Ok(FALLBACK_TIMEOUT),
        Err(std::env::VarError::NotUnicode(value)) => Err(Error::InvalidArgument(format!(
            "{TIMEOUT_VAR}={value:?}: not a number of seconds (not even UTF-8)"
        ))),
    }
}

/// The default child timeout: [`try_default_timeout`], or for an invalid `VMM_CHILD_TIMEOUT`
/// 60 s, after one line on stderr that says so (`vmm-ipc: ignoring VMM_CHILD_TIMEOUT=...`).
/// `inf` and values too large for a [`Duration`] mean `Duration::MAX`: forever.
pub fn default_timeout() -> Duration {
    try_default_timeout().unwrap_or_else(|error| {
        static WARNED: std::sync::Once = std::sync::Once::new();
        WARNED.call_once(|| {
            let why = match &error {
                Error::InvalidArgument(why) => why.clone(),
                other => other.to_string(),
            };
            eprintln!(
                "vmm-ipc: ignoring {why}; using {} s",
                FALLBACK_TIMEOUT.as_secs()
            )
        });
        FALLBACK_TIMEOUT
    })
}

/// Starts children with one start method.
///
/// ```no_run
/// use vmm_core::process::{Context, StartMethod};
/// let ctx = Context::new(StartMethod::Spawn);
/// let child = ctx.spawn(|n: u32| assert_eq!(n, 7), 7).unwrap();
/// child.wait().unwrap();
/// ```
#[derive(Debug, Clone)]
pub struct Context {
    method: StartMethod,
    timeout: Duration,
    env: Vec<(String, String)>,
    /// Set by `#[ipc_test]`: every child started is recorded so that none outlives the test.
    registry: Option<Arc<Registry>>,
}

impl Context {
    /// A context for `method`, with the [default timeout](default_timeout).
    pub fn new(method: StartMethod) -> Self {
        Self::with_method_and_timeout(method, default_timeout())
    }

    /// A context for `method` with `timeout`, the environment not consulted.
    pub(crate) fn with_method_and_timeout(method: StartMethod, timeout: Duration) -> Self {
        Context {
            method,
            timeout,
            env: Vec::new(),
            registry: None,
        }
    }

    /// The start method.
    pub fn method(&self) -> StartMethod {
        self.method
    }

    /// The timeout [`Process::wait`] uses.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Use `timeout` for [`Process::wait`] (`Duration::MAX`: wait forever).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Set an environment variable in every child this context starts (before its function runs).
    pub fn with_env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.env.push((key.into(), value.into()));
        self
    }

    /// Record every child started through this context (and its clones) in `registry`.
    pub(crate) fn with_registry(mut self, registry: Arc<Registry>) -> Self {
        self.registry = Some(registry);
        self
    }

    /// Start a child that runs `f(args)`.
    ///
    /// `f` is a plain `fn` or a non-capturing closure compiled into the main executable: the
    /// child finds it by its offset in its own copy of the executable. A function that lives
    /// elsewhere (in a shared library) is refused with [`Error::InvalidArgument`] before
    /// anything is started. `args` travels serialised, its fds out of band: pass a clone of
    /// anything the parent keeps (buffers and queues are reference-counted handles).
    ///
    /// `Ok` means the child is running (or has run) `f` and is held by the returned
    /// [`Process`]. `Err` means `f` never runs: a child that was already made when the error
    /// happened (a forkserver fork whose reply could not be received at the fd limit, say)
    /// never gets its start message and exits without running it. (A child that dies before
    /// its start message is sent, because it never reached its entry say, is returned: it ran
    /// nothing, and [`Process::join`] reports how it ended.)
    pub fn spawn<A>(&self, f: fn(A), args: A) -> Result<Process>
    where
        A: Serialize + DeserializeOwned,
    {
        let trampoline: sys::Trampoline = entry::trampoline::<A>;
        // The child finds both functions by their offsets from `code_base`: only addresses in
        // the main executable's code have the same offset in every process running it.
        sys::check_main_text(
            sys::code_base as fn() -> usize as usize,
            "vmm-core's code (is vmm-core linked as a shared library?)",
        )?;
        sys::check_main_text(f as usize, "the child's function passed to Context::spawn")?;
        sys::check_main_text(
            trampoline as usize,
            "the child trampoline for this argument type",
        )?;

        let encoded = wire::encode(&args)?;
        let start = Start {
            layout: sys::code_offset(sys::layout_probe as fn() -> usize as usize),
            trampoline: sys::code_offset(trampoline as usize),
            func: sys::code_offset(f as usize),
            method: self.method,
            env: self.env.clone(),
            args: encoded.bytes().to_vec(),
        };
        let (ours, theirs) = Channel::pair()?;
        let start = wire::encode(&start)?;
        let stdout = output_memfd(c"vmm-ipc-child-stdout")?;
        let stderr = output_memfd(c"vmm-ipc-child-stderr")?;
        let (pid, pidfd) = match self.method {
            StartMethod::Spawn => {
                let pid = launch::launch(Launch {
                    role: "spawn",
                    channel: theirs.into_fd(),
                    output: Some((dup(&stdout)?, dup(&stderr)?)),
                    test_name: current_test_name(),
                    env: self.env.clone(),
                })?;
                // Ours until reaped, so the pid is still this child. Without a pidfd (at the
                // fd limit) the child is watched by polling `waitpid`.
                (pid, sys::pidfd_open(pid).ok())
            }
            StartMethod::Forkserver => {
                let theirs = theirs.into_fd();
                forkserver::fork(&theirs, &stdout, &stderr)?
            }
        };
        let pidfd = pidfd.map(Arc::new);
        let fate = Arc::new(FateCell::default());
        let process = Process::new(
            pid,
            self.method,
            ours,
            (stdout, stderr),
            pidfd,
            Arc::clone(&fate),
            self.timeout,
        );
        // The child does nothing until its start message arrives, and it is sent only now that
        // the child is known and held by `process`: if anything above failed, the child (if
        // one was made: a forkserver fork whose reply could not be read, say) sees its channel
        // close and exits without running `f`. So `Err` from here means `f` never runs.
        let fds: Vec<_> = encoded.fds().collect();
        match process.send_start(start.bytes(), &fds) {
            // Disconnected: the child is already gone (it died starting, or never reached its
            // entry); it cannot run `f`, and `join` tells its story.
            Ok(()) | Err(Error::Disconnected(_)) => {}
            Err(error) => {
                process.abandon();
                return Err(error);
            }
        }
        drop(fds);
        drop(encoded);
        if let Some(registry) = &self.registry {
            let pidfd = process.pidfd();
            registry.track(pid, self.method, fate, pidfd);
        }
        Ok(process)
    }
}

fn output_memfd(name: &std::ffi::CStr) -> Result<OwnedFd> {
    memfd_create(name, MFdFlags::MFD_CLOEXEC)
        .map_err(|e| Error::errno("memfd_create(child output)", e))
}

fn dup(fd: &OwnedFd) -> Result<OwnedFd> {
    fd.try_clone().map_err(|e| Error::io("dup", e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refusal(value: &str) -> String {
        match parse_timeout(value) {
            Err(Error::InvalidArgument(message)) => message,
            other => panic!("{value:?}: expected InvalidArgument, got {other:?}"),
        }
    }

    #[test]
    fn ordinary_timeouts_parse_as_seconds() {
        assert_eq!(parse_timeout("30").unwrap(), Duration::from_secs(30));
        assert_eq!(parse_timeout(" 0.5 ").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_timeout("1e3").unwrap(), Duration::from_secs(1000));
    }

    #[test]
    fn huge_and_infinite_timeouts_saturate_to_forever() {
        for value in [
            "1e30",
            "18446744073709551616", // 2^64
            "1.8446744073709552e19",
            "1e308",
            "inf",
            "+inf",
            "infinity",
            "Infinity",
        ] {
            assert_eq!(parse_timeout(value).unwrap(), Duration::MAX, "{value}");
        }
        // Large but representable: kept as it is.
        assert_eq!(
            parse_timeout("1e9").unwrap(),
            Duration::from_secs(1_000_000_000)
        );
    }

    #[test]
    fn timeouts_that_make_no_sense_are_refused_naming_the_rule() {
        for (value, rule) in [
            ("2^64", "not a number of seconds"),
            ("abc", "not a number of seconds"),
            ("", "not a number of seconds"),
            ("30s", "not a number of seconds"),
            ("NaN", "NaN"),
            ("-1", "must be positive"),
            ("-inf", "must be positive"),
            ("0", "must be positive"),
            ("-0", "must be positive"),
        ] {
            let message = refusal(value);
            assert!(message.contains(rule), "{value:?}: {message}");
            assert!(
                message.contains(&format!("{TIMEOUT_VAR}={value:?}")),
                "{value:?}: {message}"
            );
        }
    }
}
