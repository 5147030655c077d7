//! Spans for the `tracing` crate (feature `tracing`), and nothing at all without it.
//!
//! Every instrumented call site writes [`span!`] and [`record!`] from here rather than the
//! `tracing` macros, so that with the feature off there is no `tracing` dependency to compile
//! and no code at run time: [`span!`] then expands to a zero-sized `Off` and [`record!`] to
//! nothing, and neither evaluates its fields. A leaf module (it imports nothing of vmm-core), so any
//! module may use it without a cycle.
//!
//! The spans and their fields are listed in the README ("Tracing"). Fields are sizes, counts,
//! pids, uids, peer addresses and start methods: never a fabric handle's bytes, an fd's
//! contents or a key, because a subscriber may ship what it sees anywhere.

/// Enter a span for the rest of the enclosing scope: `let _span = span!(DEBUG, "shm.export",
/// bytes = size);`. The level is a `tracing::Level` constant's name; the fields are `tracing`'s
/// syntax (`name = value`, `name = %display`, `name = ?debug`, `name = trace::Empty` for one
/// [`record!`] fills in later). Without the feature: an `Off`, and nothing is evaluated.
#[cfg(feature = "tracing")]
macro_rules! span {
    ($level:ident, $name:literal $(, $($fields:tt)*)?) => {
        ::tracing::span!(::tracing::Level::$level, $name $(, $($fields)*)?).entered()
    };
}

/// See the feature-on [`span!`]: without the feature a span is nothing.
#[cfg(not(feature = "tracing"))]
macro_rules! span {
    ($($ignored:tt)*) => {
        $crate::trace::Off
    };
}

/// Fill in a field a [`span!`] declared `trace::Empty`, once its value is known (a child's pid
/// after it is made, a peer's uid after `accept`): `record!(span, "pid", pid)`. Without the
/// feature: nothing, and the value is not evaluated.
#[cfg(feature = "tracing")]
macro_rules! record {
    ($span:expr, $field:literal, $value:expr) => {
        $span.record($field, $value)
    };
}

/// See the feature-on [`record!`]: without the feature nothing is recorded.
#[cfg(not(feature = "tracing"))]
macro_rules! record {
    ($span:expr, $field:literal, $value:expr) => {{
        let _ = &$span;
    }};
}

/// What [`span!`] gives without the feature: nothing to enter, nothing to drop.
#[cfg(not(feature = "tracing"))]
#[derive(Debug, Clone, Copy)]
pub(crate) struct Off;

/// A field's placeholder until [`record!`] fills it in.
#[cfg(feature = "tracing")]
pub(crate) use ::tracing::field::Empty;
/// Records a value by its `Display` in [`record!`] (as `%` does in [`span!`]).
#[cfg(all(feature = "tracing", feature = "tls"))]
pub(crate) use ::tracing::field::display;
pub(crate) use {record, span};
