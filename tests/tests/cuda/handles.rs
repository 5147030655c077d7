//! The scenarios that are the same for both handle types: a buffer as a process argument and
//! through a `Queue`, one rstest case per handle type (`posix_fd`, `fabric`), each run under
//! every start method. The fabric case skips where fabric handles cannot be used (no fabric
//! support, or no IMEX channel: the reason says which).

use rstest::rstest;
use vmm_core::cuda::{HandleType, VirtualMemoryBuffer};
use vmm_core::ipc_test;
use vmm_core::process::Context;
use vmm_core::testing::{cuda_fabric, skip_unless};
use vmm_core::wire::Queue;
use vmm_tests::turns::shared;
use vmm_tests::{contents, pattern};

use super::{TIMEOUT, filled, filled_fabric};

/// Whether `handle_type` can be used here (the test's requirement passed already: a GPU with
/// VMM IPC support); if not, a `SKIP` line says why.
fn usable(handle_type: HandleType) -> bool {
    handle_type != HandleType::Fabric || skip_unless(cuda_fabric())
}

/// A buffer of `chunks` chunks with `handle_type`'s handles, filled with `pattern(1, ..)`.
fn filled_with(handle_type: HandleType, chunks: usize) -> VirtualMemoryBuffer {
    match handle_type {
        HandleType::Fabric => filled_fabric(chunks),
        _ => filled(chunks),
    }
}

/// In the child: the parent's pattern arrived, by the handle type the parent allocated with
/// (`by_fabric`); answer with the next pattern.
pub(super) fn read_back_and_reply((buf, by_fabric): (VirtualMemoryBuffer, bool)) {
    assert!(buf.is_imported());
    assert_eq!(
        buf.handle_type() == HandleType::Fabric,
        by_fabric,
        "arrived by fabric handle: {by_fabric}"
    );
    assert_eq!(
        contents(&buf),
        pattern(1, buf.size()),
        "child did not see the parent's pattern"
    );
    buf.write_at(0, &pattern(2, buf.size())).unwrap();
}

#[rstest]
#[case::posix_fd(HandleType::PosixFd, 1)]
#[case::fabric(HandleType::Fabric, 2)]
#[ipc_test(methods = all, skip_unless = vmm_core::testing::cuda_vmm_ipc())]
fn buffer_as_process_argument(
    #[ignore] ctx: &Context,
    #[case] handle_type: HandleType,
    #[case] chunks: usize,
) {
    let _turn = shared();
    if !usable(handle_type) {
        return;
    }
    let buf = filled_with(handle_type, chunks);
    let by_fabric = handle_type == HandleType::Fabric;
    ctx.spawn(read_back_and_reply, (buf.clone(), by_fabric))
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(contents(&buf), pattern(2, buf.size()));
    // The child has imported: nothing is kept for it any more (a POSIX-fd buffer: at once).
    buf.wait_imported(TIMEOUT).unwrap();
}

#[rstest]
#[case::posix_fd(HandleType::PosixFd)]
#[case::fabric(HandleType::Fabric)]
#[ipc_test(methods = all, skip_unless = vmm_core::testing::cuda_vmm_ipc())]
fn buffer_through_queue(#[ignore] ctx: &Context, #[case] handle_type: HandleType) {
    let _turn = shared();
    if !usable(handle_type) {
        return;
    }
    let queue: Queue<VirtualMemoryBuffer> = Queue::new().unwrap();
    let child = ctx
        .spawn(
            |(q, by_fabric): (Queue<VirtualMemoryBuffer>, bool)| {
                read_back_and_reply((q.get(TIMEOUT).unwrap(), by_fabric))
            },
            (queue.clone(), handle_type == HandleType::Fabric),
        )
        .unwrap();
    let buf = filled_with(handle_type, 1);
    queue.put(&buf).unwrap();
    child.wait().unwrap();
    assert_eq!(contents(&buf), pattern(2, buf.size()));
}
