//! A multi-producer, multi-consumer queue that crosses processes: the typed channel
//! ([`Channel::send_value`]/[`Channel::recv_value`], values with their fds out of band) on a
//! socketpair whose two ends every handle shares, so that any process holding a clone may put
//! or get. It adds no framing of its own: an item is one channel message.

use std::any::Any;
use std::fmt;
use std::marker::PhantomData;
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::Duration;

use serde::de::{DeserializeOwned, Deserializer};
use serde::ser::Serializer;
use serde::{Deserialize, Serialize};

use super::channel::Channel;
use super::fd::{FdIn, FdOut, FdOwner};
use crate::Result;

/// A typed queue shared by any number of processes.
///
/// It is a `SOCK_SEQPACKET` socketpair: `put` writes one packet to one end, `get` reads one packet
/// from the other, so every item is delivered whole to exactly one getter, whichever process it
/// is in. Items carry their fds out of band ([`Fd`](super::Fd), buffers, descriptors, other
/// queues). Cloning is cheap (a reference count); passing a queue to a child gives the child
/// handles to the same two sockets.
///
/// `put` blocks while the socket's buffer is full (about 200 small items), which is the queue's
/// back-pressure: it waits for a getter to take items, for as long as that takes. Every handle
/// holds the receiving end too, so a `put` on a full queue whose getters are all gone (or
/// stuck) never returns: where that can happen, use [`put_timeout`](Self::put_timeout) or
/// [`try_put`](Self::try_put). Items larger than [`INLINE_MAX`](super::INLINE_MAX) travel in a
/// sealed memfd.
///
/// ```
/// use vmm_core::wire::Queue;
/// use std::time::Duration;
/// let queue: Queue<String> = Queue::new().unwrap();
/// queue.put(&"hello".to_owned()).unwrap();
/// assert_eq!(queue.get(Duration::from_secs(1)).unwrap(), "hello");
/// assert!(queue.try_get().unwrap().is_none());
/// ```
pub struct Queue<T> {
    ends: Arc<Ends>,
    _item: PhantomData<fn(T) -> T>,
}

#[derive(Debug)]
struct Ends {
    tx: Channel,
    rx: Channel,
}

impl<T> Clone for Queue<T> {
    fn clone(&self) -> Self {
        Queue {
            ends: Arc::clone(&self.ends),
            _item: PhantomData,
        }
    }
}

impl<T> fmt::Debug for Queue<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Queue")
            .field("tx", &self.ends.tx)
            .field("rx", &self.ends.rx)
            .finish()
    }
}

impl<T: Serialize + DeserializeOwned> Queue<T> {
    /// A new, empty queue.
    pub fn new() -> Result<Self> {
        let (tx, rx) = Channel::pair()?;
        Ok(Queue {
            ends: Arc::new(Ends { tx, rx }),
            _item: PhantomData,
        })
    }

    /// Add an item, waiting while the queue is full. Its fds are duplicated into the queue:
    /// `item` stays usable. See the type's docs for when this can block forever.
    pub fn put(&self, item: &T) -> Result<()> {
        self.put_within(item, None)
    }

    /// Add an item, waiting at most `timeout` for room; [`Error::Timeout`](crate::Error::Timeout)
    /// if the queue stayed full. Nothing is added on an error.
    pub fn put_timeout(&self, item: &T, timeout: Duration) -> Result<()> {
        self.put_within(item, Some(timeout))
    }

    /// Add an item if there is room now: `Ok(false)` (nothing added) when the queue is full.
    pub fn try_put(&self, item: &T) -> Result<bool> {
        match self.put_within(item, Some(Duration::ZERO)) {
            Ok(()) => Ok(true),
            Err(crate::Error::Timeout { .. }) => Ok(false),
            Err(e) => Err(e),
        }
    }

    fn put_within(&self, item: &T, timeout: Option<Duration>) -> Result<()> {
        self.ends.tx.send_value_timeout(item, timeout)
    }

    /// Take an item, waiting at most `timeout`; [`Error::Timeout`](crate::Error::Timeout) if none came.
    pub fn get(&self, timeout: Duration) -> Result<T> {
        self.ends.rx.recv_value(Some(timeout))
    }

    /// Take an item if one is waiting.
    pub fn try_get(&self) -> Result<Option<T>> {
        self.ends.rx.try_recv_value()
    }
}

impl<T> FdOwner for Queue<T> {
    const WHAT: &'static str = "vmm_core::wire::Queue";
}

impl<T> Serialize for Queue<T> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        // No duplicates: the message holds a reference to the queue's ends, which own both
        // sockets.
        let keep: Arc<dyn Any + Send + Sync> = self.ends.clone();
        // SAFETY: `Ends` owns both sockets as `Channel`s, which close their fd only when
        // dropped (nothing takes it out through `&self`), and an `Arc<Ends>` is never mutated:
        // both fds stay open, the same sockets, while any reference to `keep` lives.
        let ends = unsafe {
            (
                FdOut::<Self>::kept(keep.clone(), self.ends.tx.as_fd()),
                FdOut::<Self>::kept(keep, self.ends.rx.as_fd()),
            )
        };
        ends.serialize(serializer)
    }
}

impl<'de, T> Deserialize<'de> for Queue<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let (tx, rx) = <(FdIn<Self>, FdIn<Self>)>::deserialize(deserializer)?;
        Ok(Queue {
            ends: Arc::new(Ends {
                tx: Channel::from_fd(tx.into_inner()),
                rx: Channel::from_fd(rx.into_inner()),
            }),
            _item: PhantomData,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;
    use crate::Error;

    #[test]
    fn a_full_queue_refuses_try_put_and_times_out_put_timeout() {
        let queue: Queue<Vec<u8>> = Queue::new().unwrap();
        let item = vec![7u8; 4096];
        let mut queued = 0usize;
        while queue.try_put(&item).unwrap() {
            queued += 1;
            assert!(queued < 1_000_000, "the queue never filled");
        }
        assert!(queued > 0);
        let started = Instant::now();
        let err = queue
            .put_timeout(&item, Duration::from_millis(50))
            .unwrap_err();
        assert!(matches!(err, Error::Timeout { .. }), "{err:?}");
        assert!(started.elapsed() >= Duration::from_millis(50));
        // Taking one makes room again; nothing was half-added by the refusals.
        assert_eq!(queue.get(Duration::from_secs(1)).unwrap(), item);
        assert!(queue.try_put(&item).unwrap());
        let mut drained = 0;
        while queue.try_get().unwrap().is_some() {
            drained += 1;
        }
        assert_eq!(drained, queued);
    }

    #[test]
    fn duration_max_is_forever_not_a_panic() {
        let queue: Queue<u32> = Queue::new().unwrap();
        queue.put_timeout(&5, Duration::MAX).unwrap();
        assert_eq!(queue.get(Duration::MAX).unwrap(), 5);
    }
}
