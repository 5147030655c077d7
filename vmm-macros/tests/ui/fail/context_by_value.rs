use vmm_core::process::Context;

#[vmm_core::ipc_test]
fn t(ctx: Context) {
    let _ = ctx;
}

fn main() {}
