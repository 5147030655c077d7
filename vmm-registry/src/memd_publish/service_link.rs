//! The publisher's connection to the service, made again after the service is gone (it died
//! or restarts): tried with a doubling backoff (10 ms to 1 s), for a bounded time.

use std::time::{Duration, Instant};

use vmm_core::wire::endpoint::{ConnectOptions, Name};
use vmm_memd::{Client, MemdError};

use super::publish_error::PublishError;

const FIRST_BACKOFF: Duration = Duration::from_millis(10);
const MAX_BACKOFF: Duration = Duration::from_secs(1);

#[derive(Debug)]
pub(crate) struct ServiceLink {
    name: Name,
    options: ConnectOptions,
    within: Duration,
    client: Option<Client>,
    gone_since: Option<Instant>,
    next_try: Instant,
    backoff: Duration,
}

impl ServiceLink {
    /// Connect, trying for up to `within` while no service answers; a refusal that is not
    /// "no one there" (another uid listening, the connection cap) is an error at once.
    pub(crate) fn connect(
        name: Name,
        options: ConnectOptions,
        within: Duration,
    ) -> Result<ServiceLink, PublishError> {
        let client = Client::reconnect(&name, &options, within).map_err(|e| match e {
            MemdError::ServiceGone(_) => PublishError::ServiceGone { after: within },
            e => PublishError::Service(e),
        })?;
        Ok(ServiceLink {
            name,
            options,
            within,
            client: Some(client),
            gone_since: None,
            next_try: Instant::now(),
            backoff: FIRST_BACKOFF,
        })
    }

    /// The connection, lent out until [`restore`](Self::restore) (or [`lost`](Self::lost)),
    /// made again if it was lost and it is time to try, with whether it was just made (its
    /// leases are none yet); `None` while the service is not back.
    /// [`PublishError::ServiceGone`] once it has been gone for the whole bound.
    pub(crate) fn take(&mut self) -> Result<Option<(Client, bool)>, PublishError> {
        if let Some(client) = self.client.take() {
            return Ok(Some((client, false)));
        }
        let since = self.gone_since.get_or_insert_with(Instant::now).elapsed();
        if Instant::now() < self.next_try {
            return Ok(None);
        }
        match Client::connect_with(&self.name, &self.options) {
            Ok(client) => {
                self.gone_since = None;
                self.backoff = FIRST_BACKOFF;
                Ok(Some((client, true)))
            }
            // Whatever the failure (no one there, a service coming up and refusing), the
            // service is not back yet.
            Err(_) if since < self.within => {
                self.next_try = Instant::now() + self.backoff;
                self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
                Ok(None)
            }
            Err(_) => Err(PublishError::ServiceGone { after: since }),
        }
    }

    /// Give back the connection [`take`](Self::take) lent.
    pub(crate) fn restore(&mut self, client: Client) {
        self.client = Some(client);
    }

    /// The service is gone (the connection lent out is dropped, its leases with it).
    pub(crate) fn lost(&mut self) {
        self.client = None;
        self.gone_since = Some(Instant::now());
        self.next_try = Instant::now();
        self.backoff = FIRST_BACKOFF;
    }
}
