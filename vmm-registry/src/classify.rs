//! Which failure an etcd client error is: a TLS refusal (found by walking the error's
//! sources down to rustls's own error), an unreachable etcd, or etcd's answer.

use std::error::Error as StdError;
use std::future::Future;
use std::time::Duration;

use crate::error::{Op, RegistryError, TlsFailure};

/// Turn a client error of `op` into the registry's error.
///
/// A TLS failure is found by its rustls error below the client's; at open, the TLS probe
/// (`tls_probe`) has already checked TLS both ways, with rustls's error intact.
pub(crate) fn classify(op: Op, error: etcd_client::Error) -> RegistryError {
    let causes = causes(&error);
    if let Some(tls) = causes
        .iter()
        .find_map(|e| e.downcast_ref::<rustls::Error>())
    {
        return RegistryError::Tls {
            op,
            source: TlsFailure::Rustls(tls.clone()),
        };
    }
    if let etcd_client::Error::GRpcStatus(status) = &error
        && status.code() == tonic::Code::PermissionDenied
    {
        return RegistryError::PermissionDenied { op, source: error };
    }
    let unreachable = match &error {
        etcd_client::Error::TransportError(_) | etcd_client::Error::IoError(_) => true,
        etcd_client::Error::GRpcStatus(status) => {
            status.code() == tonic::Code::Unavailable
                || (status.code() == tonic::Code::Unknown && status.source().is_some())
        }
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

/// Every error below `error`, outermost first. `io::Error` hides its inner error from
/// `source()`, so it is opened with `get_ref`.
fn causes(error: &etcd_client::Error) -> Vec<&(dyn StdError + 'static)> {
    let mut current: Option<&(dyn StdError + 'static)> = match error {
        etcd_client::Error::TransportError(e) => Some(e),
        etcd_client::Error::GRpcStatus(e) => Some(e),
        etcd_client::Error::IoError(e) => Some(e),
        _ => None,
    };
    let mut all = Vec::new();
    while let Some(e) = current {
        all.push(e);
        current = match e
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
        {
            Some(inner) => Some(inner),
            None => e.source(),
        };
    }
    all
}
