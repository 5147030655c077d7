use vmm_core::process::Context;

// Wrong order: `#[rstest]` must come above `#[ipc_test]`.
#[vmm_core::ipc_test]
#[rstest::rstest]
#[case(1)]
fn t(#[ignore] ctx: &Context, #[case] n: u32) {
    let _ = (ctx, n);
}

fn main() {}
