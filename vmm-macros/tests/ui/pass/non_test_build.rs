// Outside `cfg(test)` the generated `#[test]`s do not exist; the rest must compile without
// warnings.
#![deny(warnings)]

use vmm_core::process::Context;

fn available() -> Result<(), String> {
    Ok(())
}

#[vmm_core::ipc_test(
    methods = [forkserver, spawn],
    skip_unless = available(),
    thread_unsafe = "reason",
    timeout = 5
)]
fn every_option(ctx: &vmm_core::process::Context) -> Result<(), std::fmt::Error> {
    let _ = ctx;
    Ok(())
}

#[vmm_core::ipc_test]
fn defaults(ctx: &Context) {
    let _ = ctx;
}

mod facade {
    // Only the generated tests use it, and they exist only under `cfg(test)`.
    #[allow(unused_imports)]
    pub use vmm_core as inner;
}

#[vmm_core::ipc_test(crate = facade::inner)]
fn through_facade(ctx: &Context) {
    let _ = ctx;
}

fn main() {}
