//! A short demo of `vmm-memd`, the memory service: weights loaded once, attached by every
//! engine.
//!
//! One process (`memd-demo publish`) loads a model's weights into a region of the service: it
//! begins a generation, fills the chunk through its own writable mapping, describes each named
//! tensor (chunk, offset, length, dtype, shape) and commits, and exits. From then on the
//! service holds the memory, sealed read-only. Every engine (`memd-demo attach`, or the Python
//! counterpart `examples/python/memd_demo.py attach`) attaches the current generation: a lease,
//! and the same pages mapped read-only in its own address space (zero copy), and checks each
//! tensor. Publishing again makes the next generation; engines attached to the old one keep it
//! until they detach.
//!
//! - [`model`]: the demo's tensors, their layout in one chunk and their contents (the Python
//!   demo computes the same, so either language can check what the other published);
//! - [`demo`]: publish, attach, and the program's command line (`src/bin/memd-demo.rs` is a
//!   thin `main` over [`demo::run`]).
//!
//! The service runs separately: `vmm-memd --socket @vmm-memd --quota-bytes 1073741824`.

#![cfg(target_os = "linux")]

pub mod demo;
pub mod model;
