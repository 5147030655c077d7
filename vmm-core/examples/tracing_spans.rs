//! Prints the spans vmm-core's `tracing` feature emits, with the `fmt` subscriber: a host
//! buffer exported and imported, a child spawned with a buffer argument and joined, and a
//! named endpoint that admits one client and refuses another.
//!
//! ```sh
//! cargo run -p vmm-core --features tracing --example tracing_spans
//! ```
//!
//! Each span prints when it closes (`close`), with its fields and how long it took. No GPU is
//! needed: the CUDA spans (`cuda.export`, `cuda.import`, `cuda.map`) have the same shape.

use std::time::Duration;

use tracing_subscriber::fmt::format::FmtSpan;
use vmm_core::peer::Session;
use vmm_core::process::{Context, StartMethod};
use vmm_core::shm::HostBuffer;
use vmm_core::wire::endpoint::{Allow, Listener, ListenerOptions, Name};

/// The child: its argument arrives imported (the parent exported it on the way).
fn child(buf: HostBuffer) {
    buf.fill(7).unwrap();
}

fn main() -> vmm_core::Result<()> {
    // First: in a child this takes its role and never returns.
    vmm_core::process::init();
    tracing_subscriber::fmt()
        .with_max_level(tracing::Level::DEBUG)
        .with_span_events(FmtSpan::CLOSE)
        .with_target(false)
        .init();

    // shm.export, shm.import, shm.map.
    let buf = HostBuffer::new(1 << 20)?;
    let alias = HostBuffer::import(&buf.export()?)?;
    drop(alias);

    // process.spawn (the argument's shm.export nested in it), process.join.
    for method in [StartMethod::Spawn, StartMethod::Forkserver] {
        Context::new(method)
            .spawn(child, buf.clone())?
            .join(Duration::from_secs(30))?;
    }

    // endpoint.accept: this process's uid is admitted (the default allow-list).
    let name = Name::abstract_name(format!("vmm-tracing-spans-{}", std::process::id()));
    let listener = Listener::bind(&name)?;
    let client = std::thread::spawn({
        let name = name.clone();
        move || Session::connect(&name).map(|_| ())
    });
    Session::accept(&listener, Some(Duration::from_secs(10)))?;
    client.join().expect("the client thread")?;
    drop(listener);

    // endpoint.refuse inside endpoint.accept: an allow-list that admits nobody.
    let options = ListenerOptions::default()
        .allow(Allow::none())
        .log_refusals(false);
    let listener = Listener::bind_with(&name, options)?;
    let client = std::thread::spawn({
        let name = name.clone();
        move || Session::connect(&name).map(|_| ())
    });
    let refused = Session::accept(&listener, Some(Duration::from_millis(500)));
    assert!(refused.is_err(), "a refused peer is no connection");
    assert!(client.join().expect("the client thread").is_err());
    Ok(())
}
