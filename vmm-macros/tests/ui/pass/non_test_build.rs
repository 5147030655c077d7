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

fn main() {}
