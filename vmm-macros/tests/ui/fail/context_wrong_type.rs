#[vmm_core::ipc_test]
fn t(ctx: &u32) {
    let _ = ctx;
}

fn main() {}
