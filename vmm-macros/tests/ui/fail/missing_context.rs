#[vmm_core::ipc_test]
fn t() {}

fn main() {}
