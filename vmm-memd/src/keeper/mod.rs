//! The keeper: a process of the service's executable that holds every committed generation's
//! fds (and the settings an admin changed) across the service's stop, crash and upgrade.
//! Layers, from the ground: `handover` (the key an upgraded binary proves), `wire` (the
//! socket, the messages, the checks both ends make), then `holder` (the keeper process's loop)
//! and `link` (the service's end: find or start the keeper, take back, keep it told). See
//! `vmm-memd/README.md`, "Surviving a restart".

pub mod handover;
mod holder;
mod link;
pub mod wire;

pub use holder::run;
pub use link::Keeper;
pub(crate) use link::{GenerationRecord, KeeperLink, Restored, Settings};
