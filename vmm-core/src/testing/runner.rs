//! What one `#[ipc_test]`-generated test does at run time.

use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

use super::harness::current_test_name;
use super::registry::Registry;
use super::spec::Spec;
use super::{exclusive, skip};
use crate::process::{Context, StartMethod, WarmPool, try_default_timeout};

pub(crate) fn run<Q, B>(spec: Spec, requirement: Q, body: B)
where
    Q: FnOnce() -> Result<(), String>,
    B: FnOnce(&Context) -> Result<(), String> + Send + 'static,
{
    let name = test_name(&spec);
    if let Err(reason) = requirement() {
        skip::skip(&name, &reason);
        return;
    }
    let _turn = exclusive::take_turn(spec.thread_unsafe.is_some());
    // An invalid VMM_CHILD_TIMEOUT fails the test rather than run it under a guessed timeout.
    // `inf`, or a value too large to represent, is Duration::MAX: no timeout.
    let timeout = match spec.timeout_secs {
        Some(secs) => Duration::from_secs(secs),
        None => try_default_timeout()
            .unwrap_or_else(|e| panic!("{name} ({}) cannot run: {e}", spec.method)),
    };
    if spec.method == StartMethod::Warm {
        if spec.thread_unsafe.is_some() {
            // A test that runs alone may count fds: the pool is full and ready before it starts,
            // as `ensure_running` makes the forkserver's fd part of the baseline.
            if let Err(e) = WarmPool::global().fill() {
                panic!("{name} ({}) cannot warm the pool: {e}", spec.method);
            }
        } else {
            // Beside other tests: have children on their way, without waiting for a full pool.
            WarmPool::global().prestart();
        }
    }
    let registry = Arc::new(Registry::default());
    let ctx = Context::with_method_and_timeout(spec.method, timeout)
        .with_tracker(Arc::clone(&registry) as _);

    // The body runs on its own thread, named like the test (children take the running test's
    // name from the thread), so that the test can end at its timeout even if the body blocks.
    let (done_tx, done_rx) = mpsc::channel();
    let thread = std::thread::Builder::new()
        .name(name.clone())
        .spawn(move || {
            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| body(&ctx)));
            let _ = done_tx.send(());
            outcome
        });
    let thread = match thread {
        Ok(thread) => thread,
        Err(e) => panic!("{name}: could not start the test body's thread: {e}"),
    };
    if done_rx.recv_timeout(timeout).is_err() {
        let leftovers = registry.finish(true);
        panic!(
            "{name} ({}) timed out after {timeout:?}{}",
            spec.method,
            leftovers
                .iter()
                .map(|l| format!("\n  {l}"))
                .collect::<String>()
        );
    }
    let outcome = thread.join().unwrap_or_else(Err);
    let leftovers = registry.finish(false);
    match outcome {
        Err(payload) => std::panic::resume_unwind(payload),
        Ok(Err(message)) => panic!("{name} ({}) failed: {message}", spec.method),
        Ok(Ok(())) if !leftovers.is_empty() => panic!(
            "{name} ({}) left children behind:\n  {}",
            spec.method,
            leftovers.join("\n  ")
        ),
        Ok(Ok(())) => {}
    }
}

/// The running test's full name: libtest names the test's thread after it; outside libtest
/// (a custom harness), the generated path.
fn test_name(spec: &Spec) -> String {
    current_test_name().unwrap_or_else(|| {
        let module = spec
            .module_path
            .split_once("::")
            .map_or("", |(_, rest)| rest);
        let module = if module.is_empty() {
            String::new()
        } else {
            format!("{module}::")
        };
        format!("{module}{}", spec.method.name())
    })
}
