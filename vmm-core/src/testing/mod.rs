//! The runtime behind `#[ipc_test]`.
