//! The keeper's socket and messages (see [`run`](super::run())): a `SOCK_SEQPACKET` Unix socket
//! named after the service's own, postcard-encoded [`KeeperMsg`]s of at most
//! [`MAX_KEEPER_MSG`] bytes, each with at most [`MAX_KEEPER_FDS`] fds as `SCM_RIGHTS`, and
//! the check both ends make of the other: the same uid (`SO_PEERCRED`), then the handshake
//! ([`service_handshake`], [`keeper_handshake`]): of the same executable (`/proc/PID/exe`, by
//! device and inode, read while a pidfd pins the process) the ends trust each other as they
//! are; of two executables (an upgraded service) each must prove the keeper's hand-over key
//! ([`super::handover`]).

use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::MetadataExt;
use std::time::Duration;

use nix::sys::socket::{
    self, AddressFamily, ControlMessage, ControlMessageOwned, MsgFlags, SockFlag, SockType,
    UnixAddr,
};
use serde::{Deserialize, Serialize};
use vmm_core::wire::endpoint::Name;

use super::handover::{self, End, HandOverKey, KEY_LEN};

/// The version of these messages: the first of a connection (`Hello`, `Welcome`) carry it,
/// and the two ends must agree. 2: the handshake (version 1 had none and no upgrade).
pub const KEEPER_WIRE_VERSION: u32 = 2;

/// How long either end waits for the other's handshake message: a process of the service's
/// uid that connects and says nothing holds the keeper up for this long at most.
pub const HANDSHAKE_WAIT: Duration = Duration::from_secs(2);

/// How long a service waits for its keeper's `Welcome`: longer than [`HANDSHAKE_WAIT`], since
/// the keeper, one thread, may first be waiting out the handshake of a connection that said
/// nothing.
pub const WELCOME_WAIT: Duration = Duration::from_secs(10);

/// The largest keeper message: 4 KiB (a region name and a generation number, at most).
pub const MAX_KEEPER_MSG: usize = 4096;

/// The most fds one keeper message carries: a generation's record and its chunks.
pub const MAX_KEEPER_FDS: usize = crate::protocol::MAX_CHUNKS + 1;

/// A message between the service and its keeper.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum KeeperMsg {
    /// Service to keeper, first: its wire version and a fresh nonce.
    Hello {
        /// [`KEEPER_WIRE_VERSION`].
        version: u32,
        /// The service's nonce.
        nonce: [u8; KEY_LEN],
    },
    /// Keeper to service, the answer: its wire version, its nonce, and its proof of the
    /// hand-over key over both nonces.
    Welcome {
        /// [`KEEPER_WIRE_VERSION`].
        version: u32,
        /// The keeper's nonce.
        nonce: [u8; KEY_LEN],
        /// [`HandOverKey::proof`] as [`End::Keeper`].
        proof: [u8; 32],
    },
    /// Service to keeper, last: its proof of the hand-over key (zeros where it has none;
    /// the keeper looks at it only when the service runs another executable).
    Prove {
        /// [`HandOverKey::proof`] as [`End::Service`].
        proof: [u8; 32],
    },
    /// Service to keeper: hold this committed generation (fds: its record, then its chunks),
    /// replacing what it held under the same key.
    Keep {
        /// The region.
        region: String,
        /// The generation.
        generation: u64,
    },
    /// Service to keeper: let this generation go.
    Forget {
        /// The region.
        region: String,
        /// The generation.
        generation: u64,
    },
    /// Service to keeper: send back everything held (`Entry`s, then `Handed`).
    Hand,
    /// Keeper to service: one held generation (fds as in `Keep`).
    Entry {
        /// The region.
        region: String,
        /// The generation.
        generation: u64,
    },
    /// Service to keeper: hold the service's settings (one fd: their sealed record),
    /// replacing those it held.
    KeepSettings,
    /// Service to keeper: let the settings go (none differ from the command line's now).
    ForgetSettings,
    /// Keeper to service, during a `Hand`, after the entries: the settings it holds (one fd).
    Settings,
    /// Keeper to service: that was all.
    Handed {
        /// How many entries were sent.
        entries: u64,
    },
}

/// What went wrong between the service and its keeper.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KeeperError {
    /// A system call failed.
    #[error("{op}: {source}")]
    Os {
        /// What was being done.
        op: &'static str,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The process at the other end is not a keeper (or a service) of ours: another uid, or
    /// another executable. Nothing was sent to it or taken from it.
    #[error("pid {pid} (uid {uid}) at the keeper's socket is not ours: {why}")]
    Impostor {
        /// Its pid (SO_PEERCRED).
        pid: i32,
        /// Its uid (SO_PEERCRED).
        uid: u32,
        /// Which check failed.
        why: ImpostorCheck,
    },
    /// The other end sent something that is not a keeper message, or the wrong one.
    #[error("keeper protocol broken: {0}")]
    Protocol(&'static str),
    /// The other end hung up.
    #[error("the other end hung up")]
    Gone,
    /// The other end speaks another version of these messages.
    #[error("the other end speaks keeper wire version {theirs}, this one {ours}")]
    Version {
        /// [`KEEPER_WIRE_VERSION`].
        ours: u32,
        /// Theirs.
        theirs: u32,
    },
    /// The state directory or the hand-over key could not be used.
    #[error("hand-over key: {0}")]
    HandOver(#[from] handover::HandOverError),
}

/// Which check an impostor failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImpostorCheck {
    /// Another uid than this process's.
    Uid,
    /// Another executable than this process's, which proved no hand-over key.
    Executable,
    /// The kernel gave no pidfd, or the process exited during the check.
    Pidfd,
}

impl std::fmt::Display for ImpostorCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ImpostorCheck::Uid => "another uid",
            ImpostorCheck::Executable => "another executable, without the hand-over key",
            ImpostorCheck::Pidfd => "no pidfd pins it",
        })
    }
}

fn os(op: &'static str) -> impl FnOnce(nix::Error) -> KeeperError {
    move |e| KeeperError::Os {
        op,
        source: std::io::Error::from(e),
    }
}

/// The keeper's address for a service listening on `service`: `@NAME` gives
/// `@vmm-memd-keeper:NAME`, a path `P` gives `P.keeper` (in the same 0700 directory).
pub fn keeper_name(service: &Name) -> Name {
    match service {
        Name::Abstract(name) => {
            let mut keeper = b"vmm-memd-keeper:".to_vec();
            keeper.extend_from_slice(name);
            Name::Abstract(keeper)
        }
        Name::Path(path) => {
            let mut keeper = path.clone().into_os_string();
            keeper.push(".keeper");
            Name::Path(keeper.into())
        }
    }
}

fn addr(name: &Name) -> Result<UnixAddr, KeeperError> {
    match name {
        Name::Abstract(bytes) => UnixAddr::new_abstract(bytes),
        Name::Path(path) => UnixAddr::new(path.as_path()),
    }
    .map_err(os("keeper socket address"))
}

fn seqpacket() -> Result<OwnedFd, KeeperError> {
    socket::socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .map_err(os("socket(AF_UNIX, SOCK_SEQPACKET)"))
}

/// Listen on `name` (a stale path socket is replaced).
pub fn listen(name: &Name) -> Result<OwnedFd, KeeperError> {
    let fd = seqpacket()?;
    if let Name::Path(path) = name {
        let _ = std::fs::remove_file(path);
    }
    socket::bind(fd.as_raw_fd(), &addr(name)?).map_err(os("bind(keeper socket)"))?;
    socket::listen(&fd, socket::Backlog::new(8).expect("8 is a backlog"))
        .map_err(os("listen(keeper socket)"))?;
    Ok(fd)
}

/// Connect to the keeper at `name`; `Ok(None)`: no one listens there.
pub fn connect(name: &Name) -> Result<Option<OwnedFd>, KeeperError> {
    let fd = seqpacket()?;
    match socket::connect(fd.as_raw_fd(), &addr(name)?) {
        Ok(()) => Ok(Some(fd)),
        Err(nix::Error::ECONNREFUSED | nix::Error::ENOENT) => Ok(None),
        Err(e) => Err(os("connect(keeper socket)")(e)),
    }
}

/// Accept one connection on a listening keeper socket.
pub fn accept(listener: BorrowedFd<'_>) -> Result<OwnedFd, KeeperError> {
    let raw = socket::accept4(listener.as_raw_fd(), SockFlag::SOCK_CLOEXEC)
        .map_err(os("accept(keeper socket)"))?;
    // SAFETY: a fresh fd the kernel gave us.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

/// Send `msg` with `fds` (at most [`MAX_KEEPER_FDS`]).
pub fn send(
    fd: BorrowedFd<'_>,
    msg: &KeeperMsg,
    fds: &[BorrowedFd<'_>],
) -> Result<(), KeeperError> {
    let bytes = postcard::to_allocvec(msg).map_err(|_| KeeperError::Protocol("unencodable"))?;
    if bytes.len() > MAX_KEEPER_MSG || fds.len() > MAX_KEEPER_FDS {
        return Err(KeeperError::Protocol("message over the caps"));
    }
    let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
    let cmsg = [ControlMessage::ScmRights(&raw)];
    let cmsgs: &[ControlMessage<'_>] = if raw.is_empty() { &[] } else { &cmsg };
    let iov = [IoSlice::new(&bytes)];
    match socket::sendmsg::<()>(fd.as_raw_fd(), &iov, cmsgs, MsgFlags::MSG_NOSIGNAL, None) {
        Ok(_) => Ok(()),
        Err(nix::Error::EPIPE | nix::Error::ECONNRESET | nix::Error::ENOTCONN) => {
            Err(KeeperError::Gone)
        }
        Err(e) => Err(os("sendmsg(keeper socket)")(e)),
    }
}

/// Receive one message and its fds (closed on exec; at most [`MAX_KEEPER_FDS`], a message
/// cut short or carrying more is refused and its fds closed).
pub fn recv(fd: BorrowedFd<'_>) -> Result<(KeeperMsg, Vec<OwnedFd>), KeeperError> {
    let mut buf = vec![0u8; MAX_KEEPER_MSG];
    let mut space = nix::cmsg_space!([RawFd; MAX_KEEPER_FDS]);
    let mut iov = [IoSliceMut::new(&mut buf)];
    let got = socket::recvmsg::<()>(
        fd.as_raw_fd(),
        &mut iov,
        Some(&mut space),
        MsgFlags::MSG_CMSG_CLOEXEC,
    )
    .map_err(os("recvmsg(keeper socket)"))?;
    let mut fds = Vec::new();
    for cmsg in got.cmsgs().map_err(os("recvmsg(keeper socket)"))? {
        if let ControlMessageOwned::ScmRights(raw) = cmsg {
            // SAFETY: fds the kernel just installed in this process; nothing else owns them.
            fds.extend(raw.into_iter().map(|r| unsafe { OwnedFd::from_raw_fd(r) }));
        }
    }
    let (len, flags) = (got.bytes, got.flags);
    if flags.intersects(MsgFlags::MSG_TRUNC | MsgFlags::MSG_CTRUNC) {
        return Err(KeeperError::Protocol("message or fds cut short"));
    }
    if len == 0 {
        return Err(KeeperError::Gone);
    }
    let msg =
        postcard::from_bytes(&buf[..len]).map_err(|_| KeeperError::Protocol("undecodable"))?;
    Ok((msg, fds))
}

/// The process at the other end of a keeper connection, as [`authenticate`] found it.
#[derive(Debug)]
pub struct Peer {
    /// Its pidfd (readable once it exits).
    pub pidfd: OwnedFd,
    /// Its pid and uid (`SO_PEERCRED`).
    pub pid: i32,
    /// Its uid: this process's.
    pub uid: u32,
    /// Whether it runs this process's executable (then no hand-over key is asked of it).
    pub same_executable: bool,
}

/// The process at the other end of `socket`, checked: this process's uid, read while a pidfd
/// pins it; whether it runs this process's executable (the handshake asks the hand-over key
/// of one that does not).
pub fn authenticate(socket: BorrowedFd<'_>) -> Result<Peer, KeeperError> {
    let creds = socket::getsockopt(&socket, socket::sockopt::PeerCredentials)
        .map_err(os("getsockopt(SO_PEERCRED)"))?;
    let (pid, uid) = (creds.pid(), creds.uid());
    let impostor = |why| KeeperError::Impostor { pid, uid, why };
    // SAFETY: geteuid has no preconditions.
    if uid != unsafe { libc::geteuid() } {
        return Err(impostor(ImpostorCheck::Uid));
    }
    let pidfd = crate::identity::peer_pidfd(socket, pid).ok_or(impostor(ImpostorCheck::Pidfd))?;
    let exe = |pid: &str| std::fs::metadata(format!("/proc/{pid}/exe")).map(|m| (m.dev(), m.ino()));
    let same = match (exe(&pid.to_string()), exe("self")) {
        (Ok(theirs), Ok(ours)) => theirs == ours,
        _ => false,
    };
    // The pid named the peer while we looked only if the pidfd's process is still alive.
    if crate::identity::exited(Some(&pidfd)) {
        return Err(impostor(ImpostorCheck::Pidfd));
    }
    Ok(Peer {
        pidfd,
        pid,
        uid,
        same_executable: same,
    })
}

/// The service's side of the handshake with the keeper `peer` on `socket`: `Hello`, the
/// keeper's `Welcome` (its version must be ours; of another executable, its proof must be of
/// `key`), then `Prove` (of `key`, or zeros where the service has none).
pub fn service_handshake(
    socket: BorrowedFd<'_>,
    peer: &Peer,
    key: Option<&HandOverKey>,
) -> Result<(), KeeperError> {
    let ours = handover::nonce()?;
    send(
        socket,
        &KeeperMsg::Hello {
            version: KEEPER_WIRE_VERSION,
            nonce: ours,
        },
        &[],
    )?;
    let (version, theirs, proof) = match recv_within(socket, WELCOME_WAIT)? {
        KeeperMsg::Welcome {
            version,
            nonce,
            proof,
        } => (version, nonce, proof),
        _ => return Err(KeeperError::Protocol("a keeper answers Hello with Welcome")),
    };
    if version != KEEPER_WIRE_VERSION {
        return Err(KeeperError::Version {
            ours: KEEPER_WIRE_VERSION,
            theirs: version,
        });
    }
    let proven = key.is_some_and(|k| k.verify(End::Keeper, &theirs, &ours, &proof));
    if !peer.same_executable && !proven {
        return Err(KeeperError::Impostor {
            pid: peer.pid,
            uid: peer.uid,
            why: ImpostorCheck::Executable,
        });
    }
    let proof = key.map_or([0; 32], |k| k.proof(End::Service, &ours, &theirs));
    send(socket, &KeeperMsg::Prove { proof }, &[])
}

/// The keeper's side of the handshake with the service `peer` on `socket`: the service's
/// `Hello` (its version must be ours), `Welcome` with the keeper's proof of `key`, then the
/// service's `Prove`, which must be of `key` if the service runs another executable.
pub fn keeper_handshake(
    socket: BorrowedFd<'_>,
    peer: &Peer,
    key: &HandOverKey,
) -> Result<(), KeeperError> {
    let theirs = match recv_within(socket, HANDSHAKE_WAIT)? {
        KeeperMsg::Hello {
            version: KEEPER_WIRE_VERSION,
            nonce,
        } => nonce,
        KeeperMsg::Hello { version, .. } => {
            return Err(KeeperError::Version {
                ours: KEEPER_WIRE_VERSION,
                theirs: version,
            });
        }
        _ => return Err(KeeperError::Protocol("a service opens with Hello")),
    };
    let ours = handover::nonce()?;
    let welcome = KeeperMsg::Welcome {
        version: KEEPER_WIRE_VERSION,
        nonce: ours,
        proof: key.proof(End::Keeper, &ours, &theirs),
    };
    send(socket, &welcome, &[])?;
    let KeeperMsg::Prove { proof } = recv_within(socket, HANDSHAKE_WAIT)? else {
        return Err(KeeperError::Protocol(
            "a service answers Welcome with Prove",
        ));
    };
    if !peer.same_executable && !key.verify(End::Service, &theirs, &ours, &proof) {
        return Err(KeeperError::Impostor {
            pid: peer.pid,
            uid: peer.uid,
            why: ImpostorCheck::Executable,
        });
    }
    Ok(())
}

/// [`recv`] of one message without fds, waiting at most `wait`.
fn recv_within(socket: BorrowedFd<'_>, wait: Duration) -> Result<KeeperMsg, KeeperError> {
    let timeout = nix::sys::time::TimeVal::new(
        wait.as_secs() as libc::time_t,
        wait.subsec_micros() as libc::suseconds_t,
    );
    socket::setsockopt(&socket, socket::sockopt::ReceiveTimeout, &timeout)
        .map_err(os("setsockopt(SO_RCVTIMEO)"))?;
    let got = recv(socket);
    let forever = nix::sys::time::TimeVal::new(0, 0);
    socket::setsockopt(&socket, socket::sockopt::ReceiveTimeout, &forever)
        .map_err(os("setsockopt(SO_RCVTIMEO)"))?;
    let (msg, fds) = got?;
    if !fds.is_empty() {
        return Err(KeeperError::Protocol("a handshake message carries no fds"));
    }
    Ok(msg)
}
