//! The keeper: a small process that holds every committed generation's fds (its record memfd
//! and its chunk memfds) for the service, so that a service that crashes (SIGKILL included)
//! and starts again finds its regions, with their contents, without any writer reloading
//! them. It parses no request: it keeps fds under a (region, generation) key (and the
//! service's settings record), lets them go, and hands them all back, to a peer that passes
//! [`keeper_wire::authenticate`] (this uid) and [`keeper_wire::keeper_handshake`] (this
//! executable, or the hand-over key) only. A
//! service that stops, gracefully or not, leaves everything with it for the next service,
//! of this binary or an upgraded one; a keeper that holds nothing when its service leaves
//! exits. See `vmm-memd/README.md`, "Surviving a restart".

use std::collections::BTreeMap;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::time::{Duration, Instant};

use vmm_core::wire::endpoint::Name;

use super::handover::HandOverKey;
use super::wire::{self as keeper_wire, KeeperError, KeeperMsg};

/// Run the keeper on `name`, proving `key` to the services that connect and asking it of one
/// of another executable, until no service has been connected for `linger` (`None`: forever)
/// or its service leaves it holding nothing. The process's exit status.
pub fn run(name: &Name, linger: Option<Duration>, key: &HandOverKey) -> i32 {
    // It holds one fd per chunk and one per generation, as many as the service.
    crate::fd_limit::raise();
    let listener = match keeper_wire::listen(name) {
        Ok(listener) => listener,
        Err(e) => {
            eprintln!("vmm-memd keeper: cannot listen on {name}: {e}");
            return 1;
        }
    };
    let mut held = Held::default();
    let mut service: Option<OwnedFd> = None;
    let mut alone_since = Instant::now();
    loop {
        if service.is_none() && linger.is_some_and(|l| alone_since.elapsed() >= l) {
            eprintln!("vmm-memd keeper: no service for {linger:?}; letting everything go");
            return 0;
        }
        let mut fds = [
            libc::pollfd {
                fd: listener.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: service.as_ref().map_or(-1, |s| s.as_raw_fd()),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: two pollfds, live locals (a negative fd is ignored).
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, 100) };
        if n <= 0 {
            continue;
        }
        if fds[0].revents & libc::POLLIN != 0 {
            match keeper_wire::accept(listener.as_fd()).and_then(|s| {
                let peer = keeper_wire::authenticate(s.as_fd())?;
                keeper_wire::keeper_handshake(s.as_fd(), &peer, key)?;
                Ok(s)
            }) {
                // The newest service wins: a restarted one replaces a dead one whose hangup
                // may not have been seen yet. What the old one sent before it died is
                // served first (a commit it reported is in it).
                Ok(s) => {
                    if let Some(old) = service.replace(s) {
                        drain(old.as_fd(), &mut held);
                    }
                }
                Err(e) => eprintln!("vmm-memd keeper: refused a connection: {e}"),
            }
            continue;
        }
        let Some(socket) = service.as_ref() else {
            continue;
        };
        if fds[1].revents == 0 {
            continue;
        }
        if let Err(e) = serve_one(socket.as_fd(), &mut held) {
            if !matches!(e, KeeperError::Gone) {
                eprintln!("vmm-memd keeper: service connection: {e}");
            }
            if held.is_empty() {
                // Nothing to keep for the next service (which starts a keeper of its own).
                return 0;
            }
            service = None;
            alone_since = Instant::now();
        }
    }
}

/// What the keeper holds: each committed generation's fds (its record, then its chunks) by
/// (region, generation), and the service's settings record.
#[derive(Default)]
struct Held {
    generations: BTreeMap<(String, u64), Vec<OwnedFd>>,
    settings: Option<OwnedFd>,
}

impl Held {
    fn is_empty(&self) -> bool {
        self.generations.is_empty() && self.settings.is_none()
    }
}

/// Serve what a replaced service's connection still holds, up to its end.
fn drain(socket: BorrowedFd<'_>, held: &mut Held) {
    loop {
        let mut pending = libc::pollfd {
            fd: socket.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one pollfd, a live local; no wait.
        if unsafe { libc::poll(&mut pending, 1, 0) } <= 0 || pending.revents & libc::POLLIN == 0 {
            return;
        }
        if serve_one(socket, held).is_err() {
            return;
        }
    }
}

/// Serve one message of the service.
fn serve_one(socket: BorrowedFd<'_>, held: &mut Held) -> Result<(), KeeperError> {
    let (msg, fds) = keeper_wire::recv(socket)?;
    match msg {
        KeeperMsg::Keep { region, generation } => {
            // A discarded generation's entry is its record alone.
            if fds.is_empty() {
                return Err(KeeperError::Protocol("Keep carries a record and chunks"));
            }
            held.generations.insert((region, generation), fds);
        }
        KeeperMsg::Forget { region, generation } => {
            held.generations.remove(&(region, generation));
        }
        KeeperMsg::KeepSettings => {
            let [record] = <[OwnedFd; 1]>::try_from(fds)
                .map_err(|_| KeeperError::Protocol("KeepSettings carries one record"))?;
            held.settings = Some(record);
        }
        KeeperMsg::ForgetSettings => {
            held.settings = None;
        }
        KeeperMsg::Hand => {
            for ((region, generation), fds) in held.generations.iter() {
                let borrowed: Vec<BorrowedFd<'_>> = fds.iter().map(|f| f.as_fd()).collect();
                let entry = KeeperMsg::Entry {
                    region: region.clone(),
                    generation: *generation,
                };
                keeper_wire::send(socket, &entry, &borrowed)?;
            }
            if let Some(record) = &held.settings {
                keeper_wire::send(socket, &KeeperMsg::Settings, &[record.as_fd()])?;
            }
            let done = KeeperMsg::Handed {
                entries: held.generations.len() as u64,
            };
            keeper_wire::send(socket, &done, &[])?;
        }
        KeeperMsg::Entry { .. }
        | KeeperMsg::Settings
        | KeeperMsg::Handed { .. }
        | KeeperMsg::Hello { .. }
        | KeeperMsg::Welcome { .. }
        | KeeperMsg::Prove { .. } => {
            return Err(KeeperError::Protocol(
                "after the handshake a service sends Keep, Forget, its settings or Hand",
            ));
        }
    }
    Ok(())
}
