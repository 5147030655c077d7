//! Which failure an etcd call's error is: a TLS refusal (found by walking the error's
//! sources down to rustls's own error), a permission etcd's RBAC denied, an unreachable
//! etcd, or etcd's answer.

use std::error::Error as StdError;
use std::future::Future;
use std::time::Duration;

use tonic::Code;

use crate::error::{EtcdError, Op, RegistryError, TlsFailure};

/// Turn a failed call of `op` into the registry's error.
///
/// A TLS failure is found by its rustls error below the call's; at open, the TLS probe
/// (`tls_probe`) has already checked TLS both ways, with rustls's error intact.
pub(crate) fn classify(op: Op, error: EtcdError) -> RegistryError {
    if let Some(tls) = causes(&error)
        .iter()
        .find_map(|e| e.downcast_ref::<rustls::Error>())
    {
        return RegistryError::Tls {
            op,
            source: TlsFailure::Rustls(tls.clone()),
        };
    }
    let unreachable = match &error {
        EtcdError::Status(status) if status.code() == Code::PermissionDenied => {
            return RegistryError::PermissionDenied { op, source: error };
        }
        EtcdError::Connect(_) => true,
        // The channel's own status when it reached no etcd: `Unavailable`, or `Unknown` with
        // the transport's error below it (etcd's own answers carry no source).
        EtcdError::Status(status) => {
            status.code() == Code::Unavailable
                || (status.code() == Code::Unknown && status.source().is_some())
        }
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
    future: impl Future<Output = Result<T, EtcdError>>,
) -> Result<T, RegistryError> {
    match tokio::time::timeout(deadline, future).await {
        Ok(answer) => answer.map_err(|e| classify(op, e)),
        Err(_) => Err(RegistryError::Deadline {
            op,
            after: deadline,
        }),
    }
}

/// Run `future` (which classifies its own errors) for `op` within `deadline`, all of it: a
/// wait for a lock included, so that a blocking caller's deadline holds.
pub(crate) async fn within<T>(
    op: Op,
    deadline: Duration,
    future: impl Future<Output = Result<T, RegistryError>>,
) -> Result<T, RegistryError> {
    tokio::time::timeout(deadline, future)
        .await
        .unwrap_or(Err(RegistryError::Deadline {
            op,
            after: deadline,
        }))
}

/// Every error below `error`, outermost first. `io::Error` hides its inner error from
/// `source()`, so it is opened with `get_ref`.
fn causes(error: &EtcdError) -> Vec<&(dyn StdError + 'static)> {
    let mut current = error.source();
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

#[cfg(test)]
mod tests {
    use super::*;

    fn status(code: Code) -> EtcdError {
        EtcdError::Status(tonic::Status::new(code, "etcdserver: said so"))
    }

    #[test]
    fn statuses_are_classified_by_their_code() {
        assert!(matches!(
            classify(Op::Publish, status(Code::PermissionDenied)),
            RegistryError::PermissionDenied {
                op: Op::Publish,
                ..
            }
        ));
        assert!(matches!(
            classify(Op::List, status(Code::Unavailable)),
            RegistryError::Unreachable { op: Op::List, .. }
        ));
        // etcd's own answers: no source below them.
        for code in [Code::Unknown, Code::InvalidArgument, Code::NotFound] {
            assert!(matches!(
                classify(Op::Resolve, status(code)),
                RegistryError::Etcd {
                    op: Op::Resolve,
                    ..
                }
            ));
        }
        let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        assert!(matches!(
            classify(Op::Open, EtcdError::Connect(refused)),
            RegistryError::Unreachable { op: Op::Open, .. }
        ));
    }

    #[test]
    fn a_rustls_error_below_a_status_is_a_tls_failure() {
        let tls = rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer);
        let io = std::io::Error::new(std::io::ErrorKind::InvalidData, tls.clone());
        let status = tonic::Status::from_error(Box::new(io));
        assert_eq!(status.code(), Code::Unknown);
        match classify(Op::KeepAlive, EtcdError::Status(status)) {
            RegistryError::Tls {
                op: Op::KeepAlive,
                source: TlsFailure::Rustls(found),
            } => assert_eq!(found, tls),
            other => panic!("expected a TLS failure, got {other:?}"),
        }
    }
}
