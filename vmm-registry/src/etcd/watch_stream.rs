//! One watch of a key prefix on etcd's bidirectional `Watch` stream: the create request is
//! sent first (etcd answers it, which opens the stream), and its sender is kept for the
//! stream's life (closing it would end the watch).

use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::codec::Streaming;
use tonic::transport::Channel;
use vmm_etcd_api::etcdserverpb::watch_client::WatchClient;
use vmm_etcd_api::etcdserverpb::watch_request::RequestUnion;
use vmm_etcd_api::etcdserverpb::{WatchCreateRequest, WatchRequest, WatchResponse};

use crate::error::EtcdError;

/// An open watch.
#[derive(Debug)]
pub(crate) struct WatchStream {
    _requests: mpsc::Sender<WatchRequest>,
    responses: Streaming<WatchResponse>,
}

impl WatchStream {
    /// Watch every key under `prefix` from revision `start` on.
    pub(crate) async fn open(
        channel: Channel,
        prefix: Vec<u8>,
        start: i64,
    ) -> Result<WatchStream, EtcdError> {
        let create = WatchCreateRequest {
            range_end: super::requests::prefix_end(&prefix),
            key: prefix,
            start_revision: start,
            ..WatchCreateRequest::default()
        };
        let (requests, queue) = mpsc::channel(1);
        let request = WatchRequest {
            request_union: Some(RequestUnion::CreateRequest(create)),
        };
        // The queue is new and empty: the request always fits.
        let _ = requests.try_send(request);
        let responses = WatchClient::new(channel)
            .watch(ReceiverStream::new(queue))
            .await?
            .into_inner();
        Ok(WatchStream {
            _requests: requests,
            responses,
        })
    }

    /// The next response (the first says the watch was created); `None` when etcd ended
    /// the stream.
    pub(crate) async fn message(&mut self) -> Result<Option<WatchResponse>, EtcdError> {
        Ok(self.responses.message().await?)
    }
}
