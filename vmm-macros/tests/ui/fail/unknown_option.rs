use vmm_core::process::Context;

#[vmm_core::ipc_test(retries = 3)]
fn t(ctx: &Context) {
    let _ = ctx;
}

fn main() {}
