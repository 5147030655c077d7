//! The service: [`Service`] serves the region table (`registry`) on a listener (`serve`), one
//! thread per connection; `conns` counts the connections and keeps their caps, `inflight`
//! the fds sent and not read yet, `metrics` renders what `Status` shows for Prometheus, `gpu`
//! is the CUDA backend and `generation` a committed generation's chunks and leases. Layers,
//! from the ground: `conns`, `inflight`, `generation`, `metrics`; `gpu`; `registry`;
//! `serve`.

mod conns;
mod generation;
mod gpu;
mod inflight;
mod metrics;
mod registry;
mod serve;

pub use inflight::InFlightScope;
pub use serve::{
    DEFAULT_IDLE_TIMEOUT, DEFAULT_LEASE_TTL, DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_CONNECTIONS_PER_UID, DEFAULT_MAX_FDS_IN_FLIGHT, DEFAULT_MAX_FDS_IN_FLIGHT_PER_UID,
    DEFAULT_MAX_WAIT, IN_FLIGHT_WAIT, KEEPER_TICK, Service, TICK,
};
