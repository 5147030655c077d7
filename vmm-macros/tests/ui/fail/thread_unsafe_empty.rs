use vmm_core::process::Context;

#[vmm_core::ipc_test(thread_unsafe = "")]
fn t(ctx: &Context) {
    let _ = ctx;
}

fn main() {}
