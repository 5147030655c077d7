use vmm_core::process::Context;

#[vmm_core::ipc_test(thread_unsafe = true)]
fn t(ctx: &Context) {
    let _ = ctx;
}

fn main() {}
