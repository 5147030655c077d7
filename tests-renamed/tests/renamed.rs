//! `#[ipc_test]` where vmm-core is called `vmm` (see this crate's Cargo.toml): the macro finds
//! that name in the manifest, and `crate = path` reaches vmm-core through a facade instead.
//! Each test starts a real child through its context and checks what the child wrote, so a pass
//! means the generated test ran the body and the body's child ran.

use std::time::Duration;

use vmm::process::Context;
use vmm::shm::HostBuffer;

const LEN: usize = 1 << 16;
const CHILD_TIMEOUT: Duration = Duration::from_secs(30);

/// The child's part: sevens, then its pid in the first four bytes. The parent sees them only
/// if the child ran, and the pid says it ran in another process.
fn fill_and_sign(buf: HostBuffer) {
    buf.fill(7).unwrap();
    buf.write_at(0, &std::process::id().to_ne_bytes()).unwrap();
}

/// Start a child that fills a shared buffer, join it, and check the buffer.
fn child_fills_buffer(ctx: &Context) -> Result<(), vmm::Error> {
    let buf = HostBuffer::new(LEN)?;
    buf.fill(1)?;
    ctx.spawn(fill_and_sign, buf.clone())?.join(CHILD_TIMEOUT)?;
    let seen = buf.to_vec();
    let pid = u32::from_ne_bytes(seen[..4].try_into().unwrap());
    assert_ne!(pid, std::process::id(), "the child ran in the test process");
    assert!(
        seen[4..].iter().all(|&b| b == 7),
        "the child's writes are missing"
    );
    Ok(())
}

#[vmm::ipc_test(methods = [spawn, forkserver])]
fn renamed_dependency(ctx: &Context) -> Result<(), vmm::Error> {
    child_fills_buffer(ctx)
}

/// What a crate that wraps vmm-core does: re-export it.
mod facade {
    pub use vmm as core_again;
}

#[vmm::ipc_test(crate = crate::facade::core_again, methods = [spawn, forkserver])]
fn through_facade(ctx: &Context) -> Result<(), vmm::Error> {
    child_fills_buffer(ctx)
}
