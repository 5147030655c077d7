//! A child process of the run: its stdout read line by line on a thread (each line echoed with
//! the time since the run began and the child's name, then passed on a channel), every wait
//! for a line or an exit bounded (and cut short by SIGINT, SIGTERM or SIGHUP to the run), and
//! the child stopped and reaped on drop (its stop signal first, SIGKILL after 5 s), so no exit
//! path of the run leaves one behind. A child is SIGKILLed by the kernel too if the run dies
//! without a chance to clean up (`PR_SET_PDEATHSIG`).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::process::{Child as StdChild, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

/// What every step returns on failure.
pub type Failure = Box<dyn std::error::Error>;

/// Seconds since the run began (the first call), for log lines.
pub fn clock() -> f64 {
    static START: OnceLock<Instant> = OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_secs_f64()
}

/// Set by SIGINT, SIGTERM or SIGHUP once [`stop_on_signals`] is called.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: nix::libc::c_int) {
    // An atomic store is async-signal-safe.
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// From now on SIGINT, SIGTERM and SIGHUP end every wait with an error instead of ending the
/// process, so that the run cleans up as on any failure.
pub fn stop_on_signals() -> Result<(), Failure> {
    let handler = nix::sys::signal::SigHandler::Handler(on_signal);
    for signal in [Signal::SIGINT, Signal::SIGTERM, Signal::SIGHUP] {
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        unsafe { nix::sys::signal::signal(signal, handler) }
            .map_err(|e| format!("cannot handle {signal}: {e}"))?;
    }
    Ok(())
}

/// An error if the run was asked to stop.
pub fn check_interrupted() -> Result<(), Failure> {
    if INTERRUPTED.load(Ordering::SeqCst) {
        return Err("interrupted by a signal".into());
    }
    Ok(())
}

/// The longest a wait sleeps before it looks at [`check_interrupted`] again.
const SLICE: Duration = Duration::from_millis(100);

/// How a child is started.
#[derive(Debug, Clone, Copy)]
pub struct Spec {
    /// Its name in the log.
    pub name: &'static str,
    /// Whether its stdin is a pipe ([`Child::ask`]).
    pub talk: bool,
    /// Whether its lines are echoed.
    pub echo: bool,
    /// The signal that stops it on drop.
    pub stop: Signal,
}

impl Spec {
    /// A child called `name`, echoed, no stdin, SIGTERMed on drop.
    pub fn new(name: &'static str) -> Spec {
        Spec {
            name,
            talk: false,
            echo: true,
            stop: Signal::SIGTERM,
        }
    }
}

/// A running child and its stdout's lines.
#[derive(Debug)]
pub struct Child {
    spec: Spec,
    child: StdChild,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
}

impl Child {
    /// Start `command` as `spec` says (stderr inherited).
    pub fn spawn(spec: Spec, mut command: Command) -> Result<Child, Failure> {
        let stdin = if spec.talk {
            Stdio::piped()
        } else {
            Stdio::null()
        };
        // SAFETY: the closure runs in the child between fork and exec and makes one
        // async-signal-safe system call (prctl), allocating nothing. The signal comes when the
        // thread that started the child ends: children are started from the main thread.
        unsafe {
            command.pre_exec(|| {
                nix::sys::prctl::set_pdeathsig(Signal::SIGKILL).map_err(std::io::Error::from)
            });
        }
        let mut child = command
            .stdin(stdin)
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("start {}: {e}", spec.name))?;
        let stdout = child.stdout.take().ok_or("no stdout")?;
        let (send, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if spec.echo {
                    println!("[{:8.3}] {}: {line}", clock(), spec.name);
                }
                if send.send(line).is_err() {
                    return;
                }
            }
        });
        Ok(Child {
            spec,
            stdin: child.stdin.take(),
            child,
            lines,
        })
    }

    /// The next line that starts with one of `prefixes` within `timeout` (lines before it
    /// are skipped).
    pub fn expect_any(&mut self, prefixes: &[&str], timeout: Duration) -> Result<String, Failure> {
        let deadline = Instant::now() + timeout;
        loop {
            check_interrupted()?;
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left.min(SLICE)) {
                Ok(line) if prefixes.iter().any(|p| line.starts_with(p)) => return Ok(line),
                Ok(_) => {}
                Err(RecvTimeoutError::Timeout) if !left.is_zero() => {}
                Err(RecvTimeoutError::Timeout) => {
                    return Err(format!(
                        "{} did not say {prefixes:?} within {timeout:?}",
                        self.spec.name
                    )
                    .into());
                }
                Err(RecvTimeoutError::Disconnected) => {
                    let status = self.wait_for(Duration::from_secs(1), false);
                    return Err(format!(
                        "{} ended ({status:?}) before it said {prefixes:?}",
                        self.spec.name
                    )
                    .into());
                }
            }
        }
    }

    /// [`expect_any`](Self::expect_any) of one prefix.
    pub fn expect(&mut self, prefix: &str, timeout: Duration) -> Result<String, Failure> {
        self.expect_any(&[prefix], timeout)
    }

    /// Send `request` as one line on its stdin and wait up to `timeout` for the answer: a line
    /// `ok REST` (REST returned) or `err REASON` (an error).
    pub fn ask(&mut self, request: &str, timeout: Duration) -> Result<String, Failure> {
        let name = self.spec.name;
        let stdin = self.stdin.as_mut().ok_or("not a child to talk to")?;
        writeln!(stdin, "{request}").map_err(|e| format!("{name} {request}: {e}"))?;
        stdin.flush()?;
        let line = self.expect_any(&["ok ", "err "], timeout)?;
        match line.strip_prefix("ok ") {
            Some(rest) => Ok(rest.to_owned()),
            None => Err(format!("{name} {request}: {line}").into()),
        }
    }

    /// Its exit status, waiting up to `timeout`.
    pub fn wait(&mut self, timeout: Duration) -> Result<ExitStatus, Failure> {
        self.wait_for(timeout, true)
    }

    fn wait_for(&mut self, timeout: Duration, interruptible: bool) -> Result<ExitStatus, Failure> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait()? {
                return Ok(status);
            }
            if Instant::now() >= deadline {
                return Err(format!("{} did not exit within {timeout:?}", self.spec.name).into());
            }
            if interruptible {
                check_interrupted()?;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Close its stdin (a child that reads commands then ends).
    pub fn close_stdin(&mut self) {
        self.stdin = None;
    }

    /// Send it `signal`.
    pub fn signal(&self, signal: Signal) -> Result<(), Failure> {
        let pid = Pid::from_raw(i32::try_from(self.child.id())?);
        kill(pid, signal).map_err(|e| format!("{signal} to {}: {e}", self.spec.name))?;
        Ok(())
    }

    /// SIGKILL it and reap it.
    pub fn kill(&mut self) -> Result<(), Failure> {
        self.child.kill()?;
        self.child.wait()?;
        Ok(())
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        self.stdin = None;
        if let Ok(None) = self.child.try_wait() {
            let _ = self.signal(self.spec.stop);
            if self.wait_for(Duration::from_secs(5), false).is_err() {
                let _ = self.child.kill();
                let _ = self.child.wait();
            }
        }
    }
}
