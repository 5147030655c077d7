use vmm_core::process::Context;

#[vmm_core::ipc_test(crate = vmm_core, crate = ::vmm_core)]
fn t(ctx: &Context) {
    let _ = ctx;
}

fn main() {}
