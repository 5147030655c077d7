//! The shortest use of vmm-core: a buffer shared with a child process, which writes it; the
//! parent sees the write. Host memory (a sealed memfd), so it runs anywhere; `vmm_core::cuda`
//! shares GPU memory the same way.
//!
//! ```sh
//! cargo run -p vmm-core --example share_with_a_child
//! ```

use std::time::Duration;

use vmm_core::process::{Context, StartMethod};
use vmm_core::shm::HostBuffer;

fn child(buf: HostBuffer) {
    buf.fill(0xAB).unwrap();
}

fn main() -> vmm_core::Result<()> {
    vmm_core::process::init(); // the first line of main: a child takes its role here
    let buf = HostBuffer::new(4096)?;
    let ctx = Context::new(StartMethod::Forkserver);
    ctx.spawn(child, buf.clone())?
        .join(Duration::from_secs(10))?;
    assert_eq!(buf.to_vec()[0], 0xAB);
    println!("the child wrote {:#x}", buf.to_vec()[0]);
    Ok(())
}
