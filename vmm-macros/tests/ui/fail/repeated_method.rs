use vmm_core::process::Context;

#[vmm_core::ipc_test(methods = [spawn, forkserver, spawn])]
fn t(ctx: &Context) {
    let _ = ctx;
}

fn main() {}
