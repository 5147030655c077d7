use vmm_core::process::Context;

// serde's spelling (a string) is not this option's: it takes the path itself.
#[vmm_core::ipc_test(crate = "vmm_core")]
fn quoted(ctx: &Context) {
    let _ = ctx;
}

#[vmm_core::ipc_test(crate = vmm_core::<u8>)]
fn generic(ctx: &Context) {
    let _ = ctx;
}

fn main() {}
