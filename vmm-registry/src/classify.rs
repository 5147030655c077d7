//! Which failure an etcd client error is: a TLS refusal (found by walking the error's
//! sources down to rustls's own error), an unreachable etcd, or etcd's answer.

use std::error::Error as StdError;
use std::future::Future;
use std::time::Duration;

use crate::error::{Op, RegistryError};

/// Turn a client error of `op` into the registry's error.
pub(crate) fn classify(op: Op, error: etcd_client::Error) -> RegistryError {
    if let Some(tls) = rustls_cause(&error) {
        return RegistryError::Tls {
            op,
            source: tls.clone(),
        };
    }
    let unreachable = match &error {
        etcd_client::Error::TransportError(_) | etcd_client::Error::IoError(_) => true,
        etcd_client::Error::GRpcStatus(status) => status.code() == tonic::Code::Unavailable,
        _ => false,
    };
    if unreachable {
        RegistryError::Unreachable { op, source: error }
    } else {
        RegistryError::Etcd { op, source: error }
    }
}

/// Run `future` for `op` within `deadline`, classifying its error.
pub(crate) async fn bounded<T>(
    op: Op,
    deadline: Duration,
    future: impl Future<Output = Result<T, etcd_client::Error>>,
) -> Result<T, RegistryError> {
    match tokio::time::timeout(deadline, future).await {
        Ok(answer) => answer.map_err(|e| classify(op, e)),
        Err(_) => Err(RegistryError::Deadline {
            op,
            after: deadline,
        }),
    }
}

/// The rustls error somewhere below `error`, if any. `io::Error` hides its inner error from
/// `source()`, so it is opened with `get_ref`.
fn rustls_cause(error: &etcd_client::Error) -> Option<&rustls::Error> {
    let mut current: Option<&(dyn StdError + 'static)> = match error {
        etcd_client::Error::TransportError(e) => Some(e),
        etcd_client::Error::GRpcStatus(e) => Some(e),
        etcd_client::Error::IoError(e) => Some(e),
        _ => None,
    };
    while let Some(e) = current {
        if let Some(tls) = e.downcast_ref::<rustls::Error>() {
            return Some(tls);
        }
        if let Some(inner) = e
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
        {
            current = Some(inner);
            continue;
        }
        current = e.source();
    }
    None
}
