//! The Rust client of the service: a [`Client`] is one connection (`connection`); a writer
//! publishes through it (`writer`), a reader attaches and detaches (`attach`), sleeps and
//! wakes at stable addresses (`sleep`, over the `layout` a wake compares), and an operator
//! sends its requests (`admin`). The mappings it makes are `mapping` (host memfds) and
//! `gpu_mapping` (CUDA chunks); `keep_alive` takes turns between calls and the renewal
//! thread. Layers, from the ground: `keep_alive`, `mapping`, `gpu_mapping`, `layout`;
//! `connection`; `writer`, `attach`, `admin`; `sleep`.

mod admin;
mod attach;
mod connection;
mod gpu_mapping;
mod keep_alive;
mod layout;
mod mapping;
mod sleep;
mod writer;

pub use admin::{RegionSlept, RegionWoke, Released};
pub use attach::{Attached, FabricAttached, Unmapped};
pub use connection::Client;
pub use gpu_mapping::GpuChunks;
pub use layout::{layout_hash, layout_hash_on};
pub use mapping::{ReadOnlyChunk, Reservation};
pub use sleep::{SleepFailed, Sleeping, WakeFailed};
pub use writer::{BeginOptions, Writer, commit_token};
