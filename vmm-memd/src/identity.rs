//! Who a connection's peer is, from the kernel only: vmm-core's
//! [`PeerProcess`] (`SO_PEERCRED`, which the
//! endpoint's check already read; `SO_PEERGROUPS`; a pidfd pinned to the process, so that the
//! peer's exit ends its connection even when another process still holds the socket), in the
//! shape the service's rights checks read.

use std::os::fd::{BorrowedFd, OwnedFd};

use vmm_core::wire::endpoint::{Credentials, PeerProcess, pidfd_exited};

pub(crate) use vmm_core::wire::endpoint::peer_pidfd;

/// A connection's peer, as the kernel knows it.
#[derive(Debug)]
pub(crate) struct Identity {
    pub(crate) uid: u32,
    pub(crate) gid: u32,
    pub(crate) groups: Vec<u32>,
    pub(crate) pid: i32,
    /// Readable once the process has exited; `None` where the kernel gives none.
    pub(crate) pidfd: Option<OwnedFd>,
    /// Whether it is one of the service's [`Admins`].
    pub(crate) admin: bool,
}

impl Identity {
    /// The identity of the peer on `socket`, whose `SO_PEERCRED` is `creds`; whether it is
    /// one of `admins` (by its uid, primary gid or supplementary groups, all from the kernel).
    pub(crate) fn of(socket: BorrowedFd<'_>, creds: Credentials, admins: &Admins) -> Identity {
        let peer = PeerProcess::of(socket, creds);
        let mut identity = Identity {
            uid: creds.uid,
            gid: creds.gid,
            groups: peer.groups,
            pid: creds.pid,
            pidfd: peer.pidfd,
            admin: false,
        };
        identity.admin = admins.include(&identity);
        identity
    }

    /// Whether the identity's primary or a supplementary group is `gid`.
    pub(crate) fn has_gid(&self, gid: u32) -> bool {
        self.gid == gid || self.groups.contains(&gid)
    }
}

/// The service's operators: the uids, and the members of the gids, who may list, delete,
/// sleep and wake any region, change any region's ACL, set any uid's quota and release
/// everything (they may not read or write a region's memory for that). The `vmm-memd` program makes root the only one
/// unless told otherwise (`--admin-uid`, `--admin-gid`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Admins {
    /// Admin uids.
    pub uids: Vec<u32>,
    /// Groups whose members (primary or supplementary, as the kernel reports) are admins.
    pub gids: Vec<u32>,
}

impl Admins {
    /// Whether `who` is one of them.
    pub(crate) fn include(&self, who: &Identity) -> bool {
        self.uids.contains(&who.uid) || self.gids.iter().any(|&gid| who.has_gid(gid))
    }
}

/// Whether the process behind `pidfd` has exited (never, as far as is known, without one).
pub(crate) fn exited(pidfd: Option<&OwnedFd>) -> bool {
    pidfd.is_some_and(pidfd_exited)
}
