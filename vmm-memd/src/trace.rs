//! Events for the `tracing` crate (feature `tracing`), and nothing at all without it.
//!
//! Every call site writes [`event!`] from here rather than `tracing`'s macro, so that with the
//! feature off there is no `tracing` dependency to compile and no code at run time: the macro
//! then expands to nothing and evaluates none of its fields. A leaf module (it imports nothing
//! of this crate), so any module may use it without a cycle.
//!
//! Each event has a name (`memd.attach`, `memd.refused`, ...; the README's "Tracing" lists
//! them), the target `vmm_memd`, the name again as its message (what the fmt subscriber
//! prints), and structured fields: region, generation, uid, pid, conn, lease, bytes, outcome,
//! reason. Never a chunk's contents or a metadata value: a subscriber may ship what it sees
//! anywhere.

/// Emit one event: `event!(INFO, "memd.commit", region, generation = n, bytes = b);`. The
/// level is a `tracing::Level` constant's name; the fields are `tracing`'s syntax (`name`,
/// `name = value`, `name = %display`, `name = ?debug`). Without the feature: nothing, and no
/// field is evaluated (a binding used only by events is then unused: such functions say so
/// with `cfg_attr(not(feature = "tracing"), allow(unused_variables))`).
#[cfg(feature = "tracing")]
macro_rules! event {
    ($level:ident, $name:literal $(, $($fields:tt)*)?) => {
        ::tracing::event!(
            name: $name,
            target: "vmm_memd",
            ::tracing::Level::$level,
            $($($fields)*,)?
            $name
        )
    };
}

/// See the feature-on [`event!`]: without the feature an event is nothing.
#[cfg(not(feature = "tracing"))]
macro_rules! event {
    ($($ignored:tt)*) => {};
}

pub(crate) use event;

/// Install a subscriber that prints events on stderr (the `vmm-memd` program, feature
/// `tracing`), at the level `VMM_MEMD_LOG` names (`error`, `warn`, `info`, `debug`, `trace`;
/// default `info`; `off`: none). Returns whether one was installed (not if the process
/// already has one).
#[cfg(feature = "tracing")]
pub(crate) fn install_stderr_subscriber() -> bool {
    use tracing_subscriber::filter::LevelFilter;
    let level = match std::env::var("VMM_MEMD_LOG") {
        Ok(text) => text.parse::<LevelFilter>().unwrap_or(LevelFilter::INFO),
        Err(_) => LevelFilter::INFO,
    };
    let subscriber = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_max_level(level)
        .finish();
    tracing::subscriber::set_global_default(subscriber).is_ok()
}
