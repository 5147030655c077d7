use vmm_core::process::Context;

#[vmm_core::ipc_test]
fn t(ctx: &Context, n: u32) {
    let _ = (ctx, n);
}

fn main() {}
