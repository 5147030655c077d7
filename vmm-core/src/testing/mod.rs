//! The runtime behind `#[ipc_test]`.

#[doc(hidden)]
pub mod __private;
