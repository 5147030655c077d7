//! Who is at the other end of a socket, as the kernel says (`SO_PEERCRED`), and who may be.

use std::fmt;
use std::os::fd::AsFd;

use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};

pub use crate::error::Credentials;
use crate::{Error, Result};

/// This process's effective uid.
pub(crate) fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// The kernel's overflow uid (`/proc/sys/kernel/overflowuid`; 65534 unless changed): what
/// `SO_PEERCRED` and `stat` report for a uid that has no mapping in this process's user
/// namespace. One such uid stands for every unmapped user at once, so it is never taken as
/// anyone's identity unless an allow-list names it. `None` when it cannot be read: then every
/// uid is treated as possibly the overflow uid (fail closed). (Only uids decide who a peer is,
/// so the overflow gid is not read: every child's role check pays for each file read.)
pub(crate) fn overflow_uid() -> Option<u32> {
    static UID: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    if let Some(uid) = UID.get() {
        return Some(*uid);
    }
    let uid = std::fs::read_to_string("/proc/sys/kernel/overflowuid")
        .ok()?
        .trim()
        .parse()
        .ok()?;
    Some(*UID.get_or_init(|| uid))
}

/// Whether `uid` may be the overflow uid (it is, or the overflow uid cannot be read).
pub(crate) fn maybe_overflow_uid(uid: u32) -> bool {
    overflow_uid().is_none_or(|overflow| overflow == uid)
}

/// Why the kernel's word for `peer` may name no one in particular: a note for refusals, empty
/// when its uid and gid are ordinary ids.
pub(crate) fn overflow_note(peer: &Credentials) -> String {
    match overflow_uid() {
        None => " (the overflow uid cannot be read from /proc/sys/kernel/overflowuid, so an id \
                  is admitted only when the allow-list names it)"
            .into(),
        Some(uid) if peer.uid == uid => format!(
            " (uid {uid} is the overflow uid: the process's uid has no mapping in this user \
             namespace, and it stands for every such user; admitted only when the allow-list \
             names it)"
        ),
        Some(_) => String::new(),
    }
}

impl Credentials {
    /// This process's own: its pid, effective uid and effective gid.
    pub fn of_this_process() -> Credentials {
        Credentials {
            pid: nix::unistd::getpid().as_raw(),
            uid: euid(),
            // SAFETY: getegid has no preconditions and cannot fail.
            gid: unsafe { libc::getegid() },
        }
    }

    /// The credentials of the peer of a connected Unix socket.
    pub(crate) fn of_peer(socket: impl AsFd) -> Result<Credentials> {
        let ucred = getsockopt(&socket, PeerCredentials)
            .map_err(|e| Error::errno("getsockopt(SO_PEERCRED)", e))?;
        Ok(Credentials {
            pid: ucred.pid(),
            uid: ucred.uid(),
            gid: ucred.gid(),
        })
    }
}

/// Which peers an endpoint accepts, by the kernel's credentials for them: a peer is admitted
/// when its uid is listed, or its (primary) gid is. The default, [`Allow::same_user`], is this
/// process's effective uid alone.
///
/// Supplementary groups are not consulted (`SO_PEERCRED` reports only the primary gid), and
/// uid 0 gets no exception: root is admitted only if listed.
///
/// The overflow uid (`/proc/sys/kernel/overflowuid`, usually 65534: what a uid that has no
/// mapping in this process's user namespace reads as) is admitted only when
/// [`uid`](Self::uid) names it: [`same_user`](Self::same_user) in a process whose own uid reads
/// as the overflow uid (a daemon run as `nobody`, or in a user namespace that does not map
/// it) admits nobody by uid, since that one id stands for every unmapped user. Where the
/// overflow uid cannot be read, the default uid is not admitted either (fail closed). Gids are
/// only ever named ([`gid`](Self::gid)), so a named overflow gid admits.
///
/// ```
/// use vmm_core::wire::endpoint::{Allow, Credentials};
/// let me = Credentials::of_this_process();
/// assert!(Allow::same_user().admits(&me));
/// assert!(!Allow::none().admits(&me));
/// assert!(Allow::none().uid(me.uid).admits(&me));
/// assert!(Allow::none().gid(me.gid).admits(&me));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allow {
    uids: Vec<u32>,
    gids: Vec<u32>,
    /// The uid [`same_user`](Self::same_user) put in, until [`uid`](Self::uid) names it too.
    implicit: Option<u32>,
}

impl Allow {
    /// This process's effective uid, and nothing else.
    pub fn same_user() -> Allow {
        let uid = euid();
        Allow {
            uids: vec![uid],
            gids: Vec::new(),
            implicit: Some(uid),
        }
    }

    /// Nobody (add uids and gids with [`uid`](Self::uid) and [`gid`](Self::gid)).
    pub fn none() -> Allow {
        Allow {
            uids: Vec::new(),
            gids: Vec::new(),
            implicit: None,
        }
    }

    /// Also admit `uid` (named: the overflow uid too, when named here).
    pub fn uid(mut self, uid: u32) -> Allow {
        if self.implicit == Some(uid) {
            self.implicit = None;
        }
        if !self.uids.contains(&uid) {
            self.uids.push(uid);
        }
        self
    }

    /// Also admit processes whose primary group is `gid`.
    pub fn gid(mut self, gid: u32) -> Allow {
        if !self.gids.contains(&gid) {
            self.gids.push(gid);
        }
        self
    }

    /// The admitted uids.
    pub fn uids(&self) -> &[u32] {
        &self.uids
    }

    /// The admitted gids.
    pub fn gids(&self) -> &[u32] {
        &self.gids
    }

    /// Whether a peer with these credentials is admitted: its uid is listed (the overflow uid
    /// only if named with [`uid`](Self::uid)), or its gid is.
    pub fn admits(&self, peer: &Credentials) -> bool {
        let by_uid = self.uids.contains(&peer.uid)
            && (self.implicit != Some(peer.uid) || !maybe_overflow_uid(peer.uid));
        by_uid || self.gids.contains(&peer.gid)
    }
}

impl Default for Allow {
    fn default() -> Self {
        Allow::same_user()
    }
}

impl fmt::Display for Allow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.uids.is_empty(), self.gids.is_empty()) {
            (true, true) => write!(f, "nobody"),
            (false, true) => write!(f, "uid {:?}", self.uids),
            (true, false) => write!(f, "gid {:?}", self.gids),
            (false, false) => write!(f, "uid {:?} or gid {:?}", self.uids, self.gids),
        }
    }
}
