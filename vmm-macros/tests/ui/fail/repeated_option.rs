use vmm_core::process::Context;

#[vmm_core::ipc_test(timeout = 10, timeout = 20)]
fn t(ctx: &Context) {
    let _ = ctx;
}

fn main() {}
