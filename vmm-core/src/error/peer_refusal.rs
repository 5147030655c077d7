//! Who a named endpoint's client met, and why it did not go on
//! ([`Error::PeerRefused`](super::Error::PeerRefused)).

use std::fmt;

use serde::{Deserialize, Serialize};

/// A process's credentials as the kernel recorded them for a Unix socket (`SO_PEERCRED`): for
/// a client, when it called `connect`; for a listener, when it called `listen`. They are the
/// effective uid and gid of that moment, translated into this process's user and pid
/// namespaces (a pid of 0: the peer is in a pid namespace this process cannot see). Nothing the
/// peer sends can change them.
///
/// Defined here, beside the refusals that name them, and used as
/// [`wire::endpoint::Credentials`](crate::wire::endpoint::Credentials).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Credentials {
    /// The process id (at connect or listen time; the process may have exited since).
    pub pid: i32,
    /// The effective user id.
    pub uid: u32,
    /// The effective (primary) group id.
    pub gid: u32,
}

impl fmt::Display for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "pid {} (uid {}, gid {})", self.pid, self.uid, self.gid)
    }
}

/// Why a client of a named endpoint did not get a session
/// ([`Error::PeerRefused`](super::Error::PeerRefused)); each names the listener by the
/// kernel's credentials for it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum PeerRefusal {
    /// The client refused the listener: it is not whom the client expects (another process
    /// may have taken the name first). Nothing was sent to it.
    UnexpectedListener {
        /// The listener, as the kernel says.
        listener: Credentials,
        /// Whom the client expects (its allow-list), for people.
        expected: String,
        /// Why the kernel's word may name no one in particular (the overflow uid), for people;
        /// empty when there is nothing to note.
        note: String,
    },
    /// The listener closed the connection without admitting the client.
    ListenerClosed {
        /// The listener, as the kernel says.
        listener: Credentials,
    },
    /// The listener refused the client (`REFUSED`).
    RefusedByListener {
        /// The listener, as the kernel says.
        listener: Credentials,
        /// What the listener said (its words, not checked).
        said: String,
    },
}

impl PeerRefusal {
    /// The listener the client met.
    pub fn listener(&self) -> Credentials {
        match self {
            PeerRefusal::UnexpectedListener { listener, .. }
            | PeerRefusal::ListenerClosed { listener }
            | PeerRefusal::RefusedByListener { listener, .. } => *listener,
        }
    }
}

impl fmt::Display for PeerRefusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PeerRefusal::UnexpectedListener {
                listener,
                expected,
                note,
            } => write!(
                f,
                "its listener is {listener}, not whom this client expects ({expected}){note}: \
                 another process may have taken the name first; nothing was sent to it"
            ),
            PeerRefusal::ListenerClosed { listener } => write!(
                f,
                "its listener ({listener}) closed the connection without admitting it"
            ),
            PeerRefusal::RefusedByListener { listener, said } => {
                write!(f, "its listener ({listener}) refused this process: {said}")
            }
        }
    }
}
