//! One error type for every registry operation, with the operation it ended and why, so a
//! caller can tell "etcd refused our certificate" from "etcd is down" from "that name is taken"
//! without reading a message.

use std::time::Duration;

/// What the registry was doing when an error ended it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Opening: connecting and granting the process's lease.
    Open,
    /// Publishing a locator (the create-only transaction).
    Publish,
    /// Removing one of this process's locators.
    Unpublish,
    /// Replacing the value of one of this process's locators.
    Update,
    /// Reading one locator.
    Resolve,
    /// Reading every locator of the domain.
    List,
    /// Starting a watch.
    Watch,
    /// Keeping the lease alive.
    KeepAlive,
    /// Revoking the lease at a clean shutdown.
    Revoke,
}

impl std::fmt::Display for Op {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Op::Open => "open",
            Op::Publish => "publish",
            Op::Unpublish => "unpublish",
            Op::Update => "update",
            Op::Resolve => "resolve",
            Op::List => "list",
            Op::Watch => "watch",
            Op::KeepAlive => "keep-alive",
            Op::Revoke => "revoke",
        })
    }
}

/// Which rule a name (domain, owner, export name) broke.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NameRule {
    /// Empty.
    Empty,
    /// Longer than [`MAX_NAME_LEN`](crate::MAX_NAME_LEN).
    TooLong,
    /// A byte other than ASCII letters, digits, `.`, `_` and `-`, or a name of dots only.
    Character,
}

/// Why a value found in etcd was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ValueError {
    /// Over [`MAX_LOCATOR_BYTES`](crate::MAX_LOCATOR_BYTES): refused before parsing.
    #[error("{len} bytes, over the cap of {max}")]
    TooLarge {
        /// The value's length.
        len: usize,
        /// The cap.
        max: usize,
    },
    /// Not a locator.
    #[error("not a locator: {0}")]
    Malformed(#[source] serde_json::Error),
    /// The owner inside the value is not the owner its key's prefix names: an owner may only
    /// describe its own memory.
    #[error("the value names owner {in_value:?} under owner {in_key:?}'s prefix")]
    OwnerMismatch {
        /// The owner the key names.
        in_key: String,
        /// The owner the value names.
        in_value: String,
    },
    /// A field of the locator breaks its rule.
    #[error("field {field}: {rule:?}")]
    Field {
        /// The field.
        field: &'static str,
        /// The rule broken.
        rule: NameRule,
    },
    /// The key is not `/vmm/v1/<domain>/exports/<owner>/<name>`.
    #[error("the key is not /vmm/v1/<domain>/exports/<owner>/<name>")]
    Key,
}

/// Why a configuration was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// No etcd endpoint.
    #[error("no etcd endpoint")]
    NoEndpoint,
    /// An endpoint that is not `host:port` (a scheme is refused: the registry always speaks TLS).
    #[error("endpoint {0:?} is not host:port (no scheme: the registry always speaks TLS)")]
    Endpoint(String),
    /// A name broke a rule.
    #[error("{what} {name:?}: {rule:?}")]
    Name {
        /// Which name.
        what: &'static str,
        /// The name.
        name: String,
        /// The rule.
        rule: NameRule,
    },
    /// A lease TTL under 2 s or over a day, or a zero timeout.
    #[error("{what}: {value:?} is out of range")]
    Range {
        /// Which setting.
        what: &'static str,
        /// Its value.
        value: Duration,
    },
    /// A PEM block that cannot be read.
    #[error("unreadable PEM")]
    Pem(#[source] rustls::pki_types::pem::Error),
    /// rustls refused the material (a CA, or a certificate and key that do not match).
    #[error("TLS material refused")]
    Tls(#[source] rustls::Error),
    /// A part of the TLS material is missing.
    #[error("missing {0}")]
    Missing(&'static str),
    /// The server name is not a DNS name or IP address.
    #[error("server name {0:?} is not a DNS name or IP address")]
    ServerName(String),
    /// etcd's client (tonic's channel) refused the TLS material or an endpoint.
    #[error("etcd client refused the configuration")]
    Client(#[source] tonic::transport::Error),
}

/// What a failed call to etcd ended with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EtcdError {
    /// The call ended with a gRPC status: etcd's answer (its code and message), or the
    /// channel's own when it could not reach etcd (the transport's error is its source).
    #[error("gRPC status {:?}: {}", .0.code(), .0.message())]
    Status(#[source] tonic::Status),
    /// No endpoint accepted a connection.
    #[error("connecting to etcd")]
    Connect(#[source] std::io::Error),
}

impl From<tonic::Status> for EtcdError {
    fn from(status: tonic::Status) -> EtcdError {
        EtcdError::Status(status)
    }
}

/// Every way a registry operation fails.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RegistryError {
    /// The configuration is unusable.
    #[error("configuration refused")]
    Config(#[from] ConfigError),
    /// The TLS handshake with etcd failed (a certificate refused either way, or a peer that
    /// does not speak TLS). Never retried in plaintext.
    #[error("{op}: TLS with etcd failed")]
    Tls {
        /// The operation.
        op: Op,
        /// How it failed.
        #[source]
        source: TlsFailure,
    },
    /// etcd could not be reached (refused, reset, or unavailable).
    #[error("{op}: etcd unreachable")]
    Unreachable {
        /// The operation.
        op: Op,
        /// What the client said.
        #[source]
        source: EtcdError,
    },
    /// etcd's RBAC refused the request: the user (the client certificate's name) may not
    /// touch that key (each owner writes only its own prefix).
    #[error("{op}: etcd denied permission")]
    PermissionDenied {
        /// The operation.
        op: Op,
        /// What etcd said.
        #[source]
        source: EtcdError,
    },
    /// etcd answered with an error.
    #[error("{op}: etcd refused the request")]
    Etcd {
        /// The operation.
        op: Op,
        /// What etcd said.
        #[source]
        source: EtcdError,
    },
    /// The operation did not finish by its deadline.
    #[error("{op}: no answer within {after:?}")]
    Deadline {
        /// The operation.
        op: Op,
        /// The deadline it had.
        after: Duration,
    },
    /// The name is already published (by this process or another one of the same owner).
    #[error("{key} is already published")]
    Duplicate {
        /// The key.
        key: String,
    },
    /// An update of a key this process did not publish: it is absent, or attached to another
    /// lease (another process of the same owner published it).
    #[error("{key} is not published by this process")]
    NotPublishedHere {
        /// The key.
        key: String,
    },
    /// The locator's owner is not this registry's owner.
    #[error("the locator names owner {in_locator:?}, this registry publishes for {ours:?}")]
    NotOurOwner {
        /// The owner this registry was opened for.
        ours: String,
        /// The owner the locator names.
        in_locator: String,
    },
    /// A locator larger than the cap once encoded.
    #[error("an encoded locator of {len} bytes is over the cap of {max}")]
    LocatorTooLarge {
        /// Its encoded length.
        len: usize,
        /// The cap.
        max: usize,
    },
    /// The locator could not be encoded.
    #[error("encoding the locator")]
    Encode(#[source] serde_json::Error),
    /// A value read from etcd was refused.
    #[error("{key}: value refused")]
    Value {
        /// The key it was under.
        key: String,
        /// Why.
        #[source]
        source: ValueError,
    },
    /// etcd said the process's lease is gone, and its replacement is not granted yet: the
    /// locators it held are unpublished, and nothing can be published now. Transient: a new
    /// lease is being granted, and the locators come back under it by themselves
    /// ([`LeaseEvent::Granted`](crate::LeaseEvent::Granted), then
    /// [`LeaseEvent::Republished`](crate::LeaseEvent::Republished)).
    #[error(
        "the lease is lost ({reason:?}): this process's locators are unpublished until a new lease is granted"
    )]
    LeaseLost {
        /// Why.
        reason: LeaseLoss,
    },
    /// The registry's background thread is gone (the registry was closed).
    #[error("the registry is closed")]
    Closed,
    /// The background thread could not be started.
    #[error("starting the registry's runtime thread")]
    Runtime(#[source] std::io::Error),
}

/// How a TLS session with etcd failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TlsFailure {
    /// rustls refused the peer, or the peer refused us with an alert, in the handshake.
    #[error("TLS: {0}")]
    Rustls(#[source] rustls::Error),
    /// The peer closed the connection in the handshake, or right after it without a word
    /// (a server that does not speak TLS closes at our hello).
    #[error("the peer closed the TLS connection before any answer ({0:?})")]
    Closed(std::io::ErrorKind),
}

/// Why the lease was lost. Only etcd's own answer counts: a keep-alive that fails or times
/// out (etcd down, restarting, stopped) is tried again, since etcd restores its leases when
/// it returns, and giving up then would unpublish a live exporter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseLoss {
    /// etcd says the lease no longer exists (it expired on etcd's clock, or was revoked): a
    /// keep-alive answered with TTL 0, or refused with `LeaseTimeToLive` then saying so.
    NotFound,
}

/// Results of this crate.
pub type Result<T, E = RegistryError> = std::result::Result<T, E>;
