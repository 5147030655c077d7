//! Keep-alives of one lease on etcd's bidirectional `LeaseKeepAlive` stream: each renewal
//! sends one request and reads its answer. The stream is opened by the first renewal (etcd
//! sends its response headers only with an answer, so a request goes first) and again
//! after it ended or failed.

use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::codec::Streaming;
use tonic::transport::Channel;
use vmm_etcd_api::etcdserverpb::lease_client::LeaseClient;
use vmm_etcd_api::etcdserverpb::{LeaseKeepAliveRequest, LeaseKeepAliveResponse};

use crate::error::EtcdError;

/// The keep-alives of one lease.
#[derive(Debug)]
pub(crate) struct KeepAlive {
    client: LeaseClient<Channel>,
    id: i64,
    open: Option<Open>,
}

/// An open stream: where requests go, and where their answers come from.
#[derive(Debug)]
struct Open {
    requests: mpsc::Sender<LeaseKeepAliveRequest>,
    answers: Streaming<LeaseKeepAliveResponse>,
}

impl KeepAlive {
    pub(crate) fn new(client: LeaseClient<Channel>, id: i64) -> KeepAlive {
        KeepAlive {
            client,
            id,
            open: None,
        }
    }

    /// Renew the lease once: the TTL etcd says it has left (0: etcd no longer has it), or
    /// `None` when the stream ended (as when etcd restarts). After `None`, an error, or a
    /// renewal abandoned midway (its deadline), the next renewal opens a new stream.
    pub(crate) async fn renew(&mut self) -> Result<Option<i64>, EtcdError> {
        // Taken out while in use: a renewal dropped midway leaves no half-read stream.
        let open = self.open.take();
        let request = LeaseKeepAliveRequest { id: self.id };
        let mut open = match open {
            Some(open) => {
                if open.requests.send(request).await.is_err() {
                    return Ok(None);
                }
                open
            }
            None => {
                let (requests, queue) = mpsc::channel(1);
                // The queue is new and empty: the first request always fits.
                let _ = requests.try_send(request);
                let answers = self
                    .client
                    .lease_keep_alive(ReceiverStream::new(queue))
                    .await?
                    .into_inner();
                Open { requests, answers }
            }
        };
        match open.answers.message().await? {
            Some(answer) => {
                self.open = Some(open);
                Ok(Some(answer.ttl))
            }
            None => Ok(None),
        }
    }
}
