use vmm_core::process::Context;

#[vmm_core::ipc_test(methods = [spawn, spawn], retries = 3)]
async fn t(ctx: &mut Context) {
    let _ = ctx;
}

fn main() {}
