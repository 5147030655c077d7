use vmm_core::process::Context;

#[vmm_core::ipc_test]
fn t<T: Default>(ctx: &Context) {
    let _ = (ctx, T::default());
}

fn main() {}
