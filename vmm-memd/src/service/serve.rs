//! [`Service`]: the registry served on a [`Listener`], one thread per connection, within caps
//! on connections in all and per uid (a uid at its cap gets a slot by the eviction of its own
//! longest-idle connection that holds no lease and no pending generation: `conns.rs`), with
//! one reaper thread that ends leases past their TTL and gives back the fds-in-flight charge
//! of ended connections once their fds are read.

use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use vmm_core::cuda::{DeviceIdentity, HandleType, IpcDescriptor};
use vmm_core::peer::{MAX_DATA, PeerMessage, Session};
use vmm_core::shm::HostDescriptor;
use vmm_core::wire::endpoint::{Credentials, Listener};

use crate::error::{Refusal, RequestRule};
use crate::identity::{self, Admins, Identity};
use crate::keeper::Keeper;
use crate::protocol::{self, Backend, Request, Response, Status};
use crate::service::conns::{Admitted, Conns};
use crate::service::generation::ChunkFd;
use crate::service::inflight::{Charge, FdBudget, InFlightScope};
use crate::service::registry::{Policy, Registry};
use crate::trace::event;

/// Connections served at once unless told otherwise: 256.
pub const DEFAULT_MAX_CONNECTIONS: usize = 256;
/// Connections one uid may hold at once unless told otherwise: 64. A uid at this cap gets a
/// slot for a new connection by the eviction of its longest-idle connection that serves no
/// request and holds no lease and no pending generation; refused when it has none.
pub const DEFAULT_MAX_CONNECTIONS_PER_UID: usize = 64;
/// A lease's TTL unless told otherwise: 10 s.
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(10);
/// Descriptor fds in flight to one uid's connections unless told otherwise: 1024 (and at most
/// a quarter of the cap in all, so that one uid always leaves room for the others).
pub const DEFAULT_MAX_FDS_IN_FLIGHT_PER_UID: usize = 1024;
/// Descriptor fds in flight in all unless told otherwise: 4096 (and at most half the
/// service's soft `RLIMIT_NOFILE`).
pub const DEFAULT_MAX_FDS_IN_FLIGHT: usize = 4096;
/// How long a connection may stay idle (no request, no lease, no pending generation) before
/// the service closes it, unless told otherwise: 5 minutes. It frees a slot of its uid's
/// connection cap; a client that kept it sees `ServiceGone` at its next request.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(300);
/// The longest a writer waits for a region's writer slot, whatever it asks: 60 s.
pub const DEFAULT_MAX_WAIT: Duration = Duration::from_secs(60);
/// How long the service waits for a client to read a previous reply's descriptors before it
/// refuses to send more ([`Refusal::FdsInFlight`]): 1 s.
pub const IN_FLIGHT_WAIT: Duration = Duration::from_secs(1);
/// How often a connection thread looks whether its client has read the fds it was sent (until
/// it has: then the thread sleeps until something happens), and the reaper at leases: every
/// 10 ms (so a lease ends within that of its TTL or its process's exit).
pub const TICK: Duration = Duration::from_millis(10);
/// How often the service looks whether its keeper is alive: every 50 ms.
pub const KEEPER_TICK: Duration = Duration::from_millis(50);

/// The memory service. Configure, then [`serve`](Self::serve).
#[derive(Debug)]
pub struct Service {
    policy: Policy,
    max_connections: usize,
    max_connections_per_uid: usize,
    max_fds_in_flight: (usize, usize),
    idle_timeout: Option<Duration>,
}

impl Service {
    /// A service that gives every uid a quota of `quota_bytes`.
    pub fn new(quota_bytes: u64) -> Service {
        Service {
            policy: Policy {
                quota: quota_bytes,
                quota_of: HashMap::new(),
                lease_ttl: DEFAULT_LEASE_TTL,
                max_wait: DEFAULT_MAX_WAIT,
                retain: 0,
                admins: Admins::default(),
            },
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_connections_per_uid: DEFAULT_MAX_CONNECTIONS_PER_UID,
            max_fds_in_flight: (DEFAULT_MAX_FDS_IN_FLIGHT_PER_UID, DEFAULT_MAX_FDS_IN_FLIGHT),
            idle_timeout: Some(DEFAULT_IDLE_TIMEOUT),
        }
    }

    /// Close a connection that has sent no request for `timeout` while it holds no lease and
    /// no pending generation (`None`: never). See [`DEFAULT_IDLE_TIMEOUT`].
    pub fn set_idle_timeout(&mut self, timeout: Option<Duration>) {
        self.idle_timeout = timeout;
    }

    /// Give `uid` a quota of its own.
    pub fn set_quota_of(&mut self, uid: u32, bytes: u64) {
        self.policy.quota_of.insert(uid, bytes);
    }

    /// Name the service's operators (none unless set; the `vmm-memd` program makes root one
    /// by default): they may list, delete, sleep and wake any region, change its ACL, set any
    /// uid's quota and release everything.
    pub fn set_admins(&mut self, admins: Admins) {
        self.policy.admins = admins;
    }

    /// Set the lease TTL (at least [`TICK`]).
    pub fn set_lease_ttl(&mut self, ttl: Duration) {
        self.policy.lease_ttl = ttl.max(TICK);
    }

    /// Keep the `retain` newest retired generations of each region even when no lease holds
    /// them (default 0: a retired generation goes with its last lease). They count against
    /// the quota of the uid that allocated them, and a `Begin` of that uid that would pass
    /// its quota frees them first, oldest first.
    pub fn set_retain(&mut self, retain: usize) {
        self.policy.retain = retain;
    }

    /// Set the longest writer wait.
    pub fn set_max_wait(&mut self, wait: Duration) {
        self.policy.max_wait = wait;
    }

    /// Set the caps on descriptor fds in flight (sent, not read yet): per uid and in all
    /// (clamped: see [`DEFAULT_MAX_FDS_IN_FLIGHT`] and [`DEFAULT_MAX_FDS_IN_FLIGHT_PER_UID`]).
    /// A connection has at most one reply's in flight whatever these are; a reply with more
    /// descriptors than the cap per uid is refused (`FdsInFlight` with scope `Uid`).
    pub fn set_max_fds_in_flight(&mut self, per_uid: usize, total: usize) {
        self.max_fds_in_flight = (per_uid, total);
    }

    /// Set the caps on connections: in all, and per uid (each at least 1; see
    /// [`DEFAULT_MAX_CONNECTIONS_PER_UID`] for a uid at its cap).
    pub fn set_max_connections(&mut self, total: usize, per_uid: usize) {
        self.max_connections = total.max(1);
        self.max_connections_per_uid = per_uid.clamp(1, self.max_connections);
    }

    /// Accept and serve connections until `stop` is set (looked at every [`TICK`]); then
    /// every connection ends (memory clients mapped stays theirs) and it returns. Errors of
    /// one connection end that connection only (logged on stderr); an accept error other
    /// than running out of fds (which pauses accepting for 50 ms) ends the service.
    pub fn serve(&self, listener: &Listener, stop: &AtomicBool) -> vmm_core::Result<()> {
        self.serve_until(listener, &Halt::new(stop)?, None)
    }

    /// [`serve`](Self::serve), with `keeper` holding every committed generation so that a
    /// service that crashes finds them when it starts again: the generations it held are
    /// served again first (regions, owners, ACLs, quota charges, contents), a keeper that
    /// dies is replaced and told everything again. A stop by `stop` leaves everything with
    /// the keeper for the next service, as a crash does; only deleting regions (an admin's
    /// `ReleaseAll`: `vmm-memctl release --all`) lets their memory go.
    pub fn serve_kept(
        &self,
        listener: &Listener,
        stop: &AtomicBool,
        keeper: Keeper,
    ) -> vmm_core::Result<()> {
        self.serve_until(listener, &Halt::new(stop)?, Some(keeper))
    }

    fn serve_until(
        &self,
        listener: &Listener,
        halt: &Halt<'_>,
        keeper: Option<Keeper>,
    ) -> vmm_core::Result<()> {
        let registry = Registry::new(self.policy.clone());
        let kept = keeper.is_some();
        if let Some(keeper) = keeper {
            let n = registry.adopt_keeper(keeper.link, keeper.restored, keeper.settings);
            eprintln!("vmm-memd: {n} committed generations taken back from the keeper");
            event!(INFO, "memd.keeper.adopted", generations = n);
        }
        let served = self.serve_registry(listener, halt, &registry, kept);
        registry.leave_keeper();
        event!(
            INFO,
            "memd.stop",
            outcome = if served.is_ok() { "stopped" } else { "failed" },
            keeper = kept
        );
        served
    }

    fn serve_registry(
        &self,
        listener: &Listener,
        halt: &Halt<'_>,
        registry: &Registry,
        kept: bool,
    ) -> vmm_core::Result<()> {
        let budget = FdBudget::new(self.max_fds_in_flight.0, self.max_fds_in_flight.1);
        let conns = Conns::new(self.max_connections, self.max_connections_per_uid);
        let next_conn = AtomicU64::new(0);
        // Connections that ended with descriptor fds unread: the kernel counts those fds
        // against this uid until the peer's socket reads or closes them (a forked child may
        // hold it after the client exits), so each keeps its charge, and its socket open to
        // ask, until then.
        let parked: Mutex<Vec<(Session, Charge<'_>)>> = Mutex::new(Vec::new());
        std::thread::scope(|scope| {
            let budget = &budget;
            let parked = &parked;
            let conns = &conns;
            scope.spawn(move || {
                while !halt.is_set() {
                    registry.expire(Instant::now());
                    parked
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .retain_mut(|(session, charge)| charge.unread(session.as_fd()));
                    std::thread::sleep(TICK);
                }
            });
            // Digests of committed GPU generations, off the commits' path.
            scope.spawn(move || registry.hash_queued(&|| halt.is_set()));
            if kept {
                scope.spawn(move || {
                    while !halt.is_set() {
                        registry.tend_keeper();
                        std::thread::sleep(KEEPER_TICK);
                    }
                });
            }
            loop {
                if halt.is_set() {
                    // Every connection thread waits on this too: it ends now.
                    halt.wake_all();
                    return Ok(());
                }
                let admitted = Session::accept_admitting(
                    listener,
                    Some(Duration::from_millis(100)),
                    &mut |peer| admit(conns, registry, peer),
                );
                let session = match admitted {
                    Ok(session) => session,
                    Err(vmm_core::Error::Timeout { .. }) => continue,
                    // This process's fd limit (EMFILE), or the system's (ENFILE): both pass.
                    Err(e @ vmm_core::Error::FdLimit { .. }) => {
                        eprintln!("vmm-memd: {e}; pausing accepts");
                        std::thread::sleep(Duration::from_millis(50));
                        continue;
                    }
                    Err(e) if e.raw_os_error() == Some(libc::ENFILE) => {
                        eprintln!("vmm-memd: {e}; pausing accepts");
                        std::thread::sleep(Duration::from_millis(50));
                        continue;
                    }
                    Err(e) => {
                        // Every connection thread ends with the scope.
                        halt.inner.store(true, Ordering::Relaxed);
                        halt.wake_all();
                        return Err(e);
                    }
                };
                let uid = session.peer().uid;
                let conn = next_conn.fetch_add(1, Ordering::Relaxed);
                let slot = conns.insert(conn, uid, Some(session.as_fd().as_raw_fd()));
                event!(
                    DEBUG,
                    "memd.conn.accepted",
                    conn,
                    uid,
                    pid = session.peer().pid
                );
                let started = std::thread::Builder::new()
                    .name("vmm-memd-conn".into())
                    .spawn_scoped(scope, move || {
                        let identity =
                            Identity::of(session.as_fd(), session.peer(), &self.policy.admins);
                        let mut served = Connection {
                            session: &session,
                            identity: &identity,
                            registry,
                            conn,
                            writing: None,
                            halt,
                            charge: budget.charge(uid),
                            idle_timeout: self.idle_timeout,
                            conns,
                        };
                        let conversed = served.converse();
                        if let Err(e) = &conversed {
                            eprintln!("vmm-memd: connection of {}: {e}", session.peer());
                        }
                        event!(
                            DEBUG,
                            "memd.conn.ended",
                            conn,
                            uid,
                            pid = identity.pid,
                            outcome = if conversed.is_ok() {
                                "closed"
                            } else {
                                "failed"
                            }
                        );
                        registry.release(conn, served.writing.as_deref());
                        let Connection { mut charge, .. } = served;
                        if charge.unread(session.as_fd()) {
                            parked
                                .lock()
                                .unwrap_or_else(|e| e.into_inner())
                                .push((session, charge));
                        }
                        // Uncounted before its socket closes (an eviction shuts the socket
                        // of a counted connection).
                        drop(slot);
                    });
                if let Err(e) = started {
                    // The thread's closure, and with it the slot, is gone.
                    eprintln!("vmm-memd: cannot start a connection thread: {e}");
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        })
    }
}

/// Why serving stops: the caller's flag, or a failure of the accept loop (which must end
/// every connection thread before `serve` can return it); and the eventfd that wakes every
/// connection thread when it does, so that an idle connection's thread sleeps in `poll`
/// without a tick.
struct Halt<'a> {
    outer: &'a AtomicBool,
    inner: AtomicBool,
    waker: OwnedFd,
}

impl<'a> Halt<'a> {
    fn new(outer: &'a AtomicBool) -> vmm_core::Result<Halt<'a>> {
        // SAFETY: eventfd with flags; the result is checked.
        let raw = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if raw < 0 {
            return Err(vmm_core::Error::Os {
                op: "eventfd(the connections' stop waker)".into(),
                source: std::io::Error::last_os_error(),
            });
        }
        Ok(Halt {
            outer,
            inner: AtomicBool::new(false),
            // SAFETY: a fresh fd that nothing else owns.
            waker: unsafe { OwnedFd::from_raw_fd(raw) },
        })
    }

    fn is_set(&self) -> bool {
        self.outer.load(Ordering::Relaxed) || self.inner.load(Ordering::Relaxed)
    }

    /// Make the waker readable for good: every connection thread's `poll` returns, and it
    /// finds the stop.
    fn wake_all(&self) {
        let one: u64 = 1;
        // SAFETY: an 8-byte write from a live local to the eventfd this Halt owns.
        unsafe {
            libc::write(
                self.waker.as_raw_fd(),
                std::ptr::from_ref(&one).cast(),
                std::mem::size_of::<u64>(),
            )
        };
    }
}

/// The connection caps, checked on the accepting thread before `HELLO`: a uid at its cap
/// evicts its longest-idle connection without a lease or a pending generation, if it has one
/// (whose thread ends at its next wake).
#[cfg_attr(not(feature = "tracing"), allow(unused_variables))]
fn admit(conns: &Conns, registry: &Registry, peer: &Credentials) -> Result<(), String> {
    match conns.admit(peer.uid, &|conn| registry.holds_leases(conn)) {
        Ok(Admitted::Free) => Ok(()),
        Ok(Admitted::Evicted { conn }) => {
            event!(
                INFO,
                "memd.conn.evicting",
                conn,
                uid = peer.uid,
                for_pid = peer.pid
            );
            Ok(())
        }
        Err(full) => {
            event!(
                WARN,
                "memd.conn.refused",
                uid = peer.uid,
                pid = peer.pid,
                reason = %full
            );
            Err(full.to_string())
        }
    }
}

/// What the next wait on a connection found.
enum Woke {
    Request,
    Idle,
    PeerGone,
}

/// One connection being served (`'a`: what its thread holds; `'s`: what the service holds,
/// which its charge may outlive the thread in).
struct Connection<'a, 's> {
    session: &'a Session,
    identity: &'a Identity,
    registry: &'a Registry,
    conn: u64,
    /// The region whose pending generation this connection writes.
    writing: Option<String>,
    /// The service's stop: a wait ends when it is set.
    halt: &'a Halt<'a>,
    /// Its descriptor fds in flight.
    charge: Charge<'s>,
    /// See [`Service::set_idle_timeout`].
    idle_timeout: Option<Duration>,
    /// The live connections (this one's eviction).
    conns: &'a Conns,
}

impl Connection<'_, '_> {
    fn converse(&mut self) -> vmm_core::Result<()> {
        let mut last_request = Instant::now();
        loop {
            // Fds in flight are looked at every tick until the client has read them (their
            // charge is given back then); otherwise the thread sleeps until a request, the
            // peer's end or exit, its eviction, the stop, or its idle timeout.
            let settled = self.charge.settle(self.session.as_fd());
            let wait = match (settled, self.idle_timeout) {
                (false, _) => Some(TICK),
                (true, None) => None,
                // Past the limit while it holds a lease or writes: look again a limit later.
                (true, Some(limit)) => Some(
                    limit
                        .checked_sub(last_request.elapsed())
                        .filter(|left| !left.is_zero())
                        .unwrap_or(limit),
                ),
            };
            let woke = self.wait(wait);
            // A stop is heeded between requests whether or not one waits: a client that
            // always has a request queued must not keep the service from stopping.
            if self.halt.is_set() {
                return Ok(());
            }
            // Evicted for a new connection of its uid: between requests only (an evicted
            // connection starts none, see `Conns::begin_request`).
            let evicted = match woke {
                Woke::Request => !self.conns.begin_request(self.conn),
                _ => self.conns.evicted(self.conn),
            };
            if evicted {
                event!(
                    INFO,
                    "memd.conn.evicted",
                    conn = self.conn,
                    uid = self.identity.uid,
                    pid = self.identity.pid,
                    idle_ms = last_request.elapsed().as_millis() as u64
                );
                return Ok(());
            }
            match woke {
                Woke::PeerGone => return Ok(()),
                Woke::Idle if self.idle_for(last_request.elapsed()) => {
                    event!(
                        INFO,
                        "memd.conn.idle",
                        conn = self.conn,
                        uid = self.identity.uid,
                        pid = self.identity.pid
                    );
                    return Ok(());
                }
                Woke::Idle => continue,
                Woke::Request => last_request = Instant::now(),
            }
            let served = self.serve_one();
            self.conns.end_request(self.conn, self.writing.is_some());
            if served? {
                return Ok(());
            }
        }
    }

    /// Receive and answer one request; whether the client has gone.
    fn serve_one(&mut self) -> vmm_core::Result<bool> {
        let bytes = match self.session.recv_message() {
            Ok(PeerMessage::Data(bytes)) => bytes,
            Ok(PeerMessage::Descriptor(_)) => {
                // Dropping it closes its fds; a client never sends descriptors.
                self.refuse(Refusal::InvalidRequest {
                    rule: RequestRule::Decode,
                    detail: "clients send DATA requests only, not descriptors".into(),
                })?;
                return Ok(false);
            }
            Err(vmm_core::Error::Disconnected(_)) => return Ok(true),
            Err(e) => return Err(e),
        };
        match protocol::decode_request(&bytes) {
            Ok(request) => self.answer(request)?,
            Err(refusal) => self.refuse(refusal)?,
        }
        Ok(false)
    }

    /// Whether the connection, `quiet` since its last request, has been idle too long: it
    /// writes nothing and holds no lease (a reader renews within its TTL, so a lease holder
    /// is never quiet that long anyway).
    fn idle_for(&self, quiet: Duration) -> bool {
        self.idle_timeout.is_some_and(|limit| quiet >= limit)
            && self.writing.is_none()
            && !self.registry.holds_leases(self.conn)
    }

    /// Wait up to `wait` (`None`: without a limit) for a request, the connection's end (an
    /// eviction shuts its reading side: it reads as a request, which `Conns` refuses), the
    /// peer process's exit, or the service's stop (its waker).
    fn wait(&self, wait: Option<Duration>) -> Woke {
        let mut fds = [
            libc::pollfd {
                fd: self.session.as_fd().as_raw_fd(),
                events: libc::POLLIN | libc::POLLRDHUP,
                revents: 0,
            },
            libc::pollfd {
                fd: self.identity.pidfd.as_ref().map_or(-1, |p| p.as_raw_fd()),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: self.halt.waker.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        let timeout = wait.map_or(-1, |w| {
            libc::c_int::try_from(w.as_millis().max(1)).unwrap_or(libc::c_int::MAX)
        });
        // SAFETY: three pollfds, live locals (a negative fd is ignored by poll).
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 3, timeout) };
        if n <= 0 {
            return Woke::Idle;
        }
        if fds[0].revents & libc::POLLIN != 0 {
            return Woke::Request;
        }
        if fds[0].revents & (libc::POLLHUP | libc::POLLRDHUP | libc::POLLERR) != 0
            || fds[1].revents != 0
        {
            return Woke::PeerGone;
        }
        Woke::Idle
    }

    /// Whether the peer hung up or exited, or the service stops (without waiting).
    fn gone(&self) -> bool {
        if self.halt.is_set() {
            return true;
        }
        let mut pfd = libc::pollfd {
            fd: self.session.as_fd().as_raw_fd(),
            events: libc::POLLRDHUP,
            revents: 0,
        };
        // SAFETY: one pollfd, a live local; no wait.
        let hung_up = unsafe { libc::poll(&mut pfd, 1, 0) } > 0;
        hung_up || identity::exited(self.identity.pidfd.as_ref())
    }

    fn send(&self, response: &Response) -> vmm_core::Result<()> {
        let bytes = postcard::to_allocvec(response).map_err(|e| vmm_core::Error::Os {
            op: "encoding a reply".into(),
            source: std::io::Error::other(e),
        })?;
        self.session.send_data(&bytes)
    }

    fn refuse(&self, refusal: Refusal) -> vmm_core::Result<()> {
        self.registry.refused();
        event!(
            INFO,
            "memd.refused",
            conn = self.conn,
            uid = self.identity.uid,
            pid = self.identity.pid,
            reason = refusal.kind(),
            region = refusal.region().unwrap_or(""),
            detail = %refusal
        );
        self.send(&Response::Refused(refusal))
    }

    fn answer(&mut self, request: Request) -> vmm_core::Result<()> {
        match self.handle(request) {
            Ok(()) => Ok(()),
            Err(Handled::Refused(refusal)) => self.refuse(refusal),
            Err(Handled::Transport(e)) => Err(e),
        }
    }

    fn handle(&mut self, request: Request) -> Result<(), Handled> {
        let (registry, conn, who) = (self.registry, self.conn, self.identity);
        let writing = || {
            self.writing.clone().ok_or(Refusal::InvalidRequest {
                rule: RequestRule::NotWriting,
                detail: "this connection has begun no generation".into(),
            })
        };
        let reply = match request {
            Request::List => Response::List(registry.list(who)),
            Request::Status => Response::Status(fit(registry.status(who))),
            Request::Metrics => Response::Metrics(crate::service::metrics::render(
                &registry.status(who),
                MAX_DATA - 64,
            )),
            Request::Begin {
                region,
                chunks,
                acl,
                wait_ms,
            } => return self.begin(region, chunks, acl, wait_ms, Backend::Host),
            Request::BeginOn {
                region,
                chunks,
                acl,
                wait_ms,
                backend,
            } => return self.begin(region, chunks, acl, wait_ms, backend),
            Request::PutMeta(entries) => {
                registry.put_meta(conn, &writing()?, entries)?;
                Response::Done
            }
            Request::Commit => {
                let region = writing()?;
                let generation = registry.commit(conn, &region)?;
                self.writing = None;
                // A GPU generation's digests are taken in the background, off this reply's
                // path (registry/hashing.rs).
                registry.hash_later(&region, generation);
                Response::Committed { generation }
            }
            Request::Abort => {
                registry.abort(conn, &writing()?)?;
                self.writing = None;
                Response::Done
            }
            Request::Attach { region, generation } => {
                return self.attach(&region, generation, false);
            }
            Request::AttachFabric { region, generation } => {
                return self.attach(&region, generation, true);
            }
            Request::Detach { lease } => {
                if !registry.detach(conn, lease) {
                    return Err(Refusal::InvalidRequest {
                        rule: RequestRule::NoSuchLease,
                        detail: format!("this connection holds no lease {lease}"),
                    }
                    .into());
                }
                Response::Done
            }
            Request::Renew => Response::Renewed(registry.renew(conn)),
            Request::Discard { lease } => {
                registry.discard(conn, who, lease)?;
                Response::Done
            }
            Request::Delete { region } => {
                registry.delete(who, &region)?;
                Response::Done
            }
            Request::Sleep { region } => {
                let (generation, leases) = registry.sleep_region(who, &region)?;
                Response::Slept { generation, leases }
            }
            Request::Wake { region } => {
                let (generation, zeroed) = registry.wake_region(who, &region)?;
                Response::Woke { generation, zeroed }
            }
            Request::Token { token } => {
                registry.set_token(conn, &writing()?, token)?;
                Response::Done
            }
            Request::CommitState { region, token } => {
                Response::CommitState(registry.commit_state(who, &region, token)?)
            }
            Request::ReleaseAll => {
                let (regions, busy) = registry.release_all(who)?;
                Response::Released { regions, busy }
            }
            Request::SetAcl { region, acl } => {
                registry.set_acl(who, &region, acl)?;
                Response::Done
            }
            Request::SetQuota { uid, bytes } => {
                registry.set_quota(who, uid, bytes)?;
                Response::Done
            }
            Request::Verify { region, generation } => {
                // Given up when the service stops or the client leaves (registry/verify.rs).
                let (generation, digests) =
                    registry.verify(who, &region, generation, &|| self.gone())?;
                Response::Verified {
                    generation,
                    digests,
                }
            }
        };
        Ok(self.send(&reply)?)
    }

    /// `Attach` (and `AttachFabric`, `as_fabric`): the reply, the metadata pages, then the
    /// chunks' descriptors (fabric handles for `AttachFabric`).
    fn attach(
        &mut self,
        region: &str,
        generation: Option<u64>,
        as_fabric: bool,
    ) -> Result<(), Handled> {
        let (registry, conn, who) = (self.registry, self.conn, self.identity);
        let grant = registry.attach(conn, who, region, generation, as_fabric)?;
        let fds = if as_fabric { 0 } else { grant.chunks.len() };
        if let Err(refusal) = self.drained(fds) {
            registry.detach(conn, grant.lease);
            return Err(refusal.into());
        }
        let (lease, generation) = (grant.lease, grant.generation);
        let chunks = grant.chunks.iter().map(|(_, len)| *len).collect();
        let meta_pages = grant.meta.len() as u32;
        let ttl_ms = registry.policy().lease_ttl.as_millis() as u64;
        self.send(&match grant.backend {
            Backend::Host => Response::Attached {
                lease,
                generation,
                chunks,
                meta_pages,
                ttl_ms,
            },
            Backend::Gpu { uuid } => Response::AttachedGpu {
                lease,
                generation,
                chunks,
                meta_pages,
                ttl_ms,
                device: uuid,
                fabric: grant.fabric,
            },
        })?;
        for page in grant.meta.iter() {
            self.session.send_data(page)?;
        }
        match &grant.fabric_handles {
            Some(handles) => {
                for descriptor in handles {
                    self.session.send_descriptor(descriptor)?;
                }
            }
            None => self.send_chunks(grant.backend, &grant.chunks)?,
        }
        Ok(())
    }

    /// `Begin` (`backend` Host) and `BeginOn`: the reply, then the chunks' descriptors.
    fn begin(
        &mut self,
        region: String,
        chunks: Vec<u64>,
        acl: crate::protocol::Acl,
        wait_ms: u64,
        backend: Backend,
    ) -> Result<(), Handled> {
        if self.writing.is_some() {
            return Err(Refusal::InvalidRequest {
                rule: RequestRule::AlreadyWriting,
                detail: "commit or abort the generation this connection writes first".into(),
            }
            .into());
        }
        self.drained(chunks.len())?;
        let wait = Duration::from_millis(wait_ms);
        let began = self.registry.begin(
            self.conn,
            self.identity,
            &region,
            &chunks,
            acl,
            wait,
            backend,
            &|| self.gone(),
        )?;
        self.writing = Some(region);
        let generation = began.generation;
        let sizes = began.chunks.iter().map(|(_, len)| *len).collect();
        self.send(&match began.backend {
            Backend::Host => Response::Began {
                generation,
                chunks: sizes,
            },
            Backend::Gpu { uuid } => Response::BeganGpu {
                generation,
                chunks: sizes,
                device: uuid,
                fabric: began.fabric,
            },
        })?;
        self.send_chunks(began.backend, &began.chunks)?;
        Ok(())
    }

    /// One descriptor per chunk: `HOST_MEMFD` (host), `CUDA_VMM` with one fd (GPU), naming
    /// the device by its UUID as the reply before does (an importer picks its device by it;
    /// the ordinal, informative only, is the service's where it has opened the device, else
    /// 0: a restarted service serves kept chunks without loading the driver).
    fn send_chunks(&self, backend: Backend, chunks: &[(ChunkFd, u64)]) -> vmm_core::Result<()> {
        let device = match backend {
            Backend::Host => None,
            Backend::Gpu { uuid } => Some(DeviceIdentity {
                ordinal: self.registry.gpus().opened_ordinal(&uuid).unwrap_or(0),
                uuid,
            }),
        };
        for (fd, len) in chunks {
            match backend {
                Backend::Host => {
                    let descriptor = HostDescriptor::from_fd(fd.as_fd(), *len as usize)?;
                    self.session.send_descriptor(&descriptor)?;
                }
                Backend::Gpu { .. } => {
                    let len = *len as usize;
                    let mut descriptor =
                        IpcDescriptor::from_fds(&[fd.as_fd()], &[len], HandleType::PosixFd, len)?;
                    if let Some(device) = device {
                        descriptor = descriptor.with_device(device);
                    }
                    self.session.send_descriptor(&descriptor)?;
                }
            }
        }
        Ok(())
    }

    /// Wait (at most [`IN_FLIGHT_WAIT`]) until the client has read every earlier reply (so
    /// that at most one reply's descriptors are in flight on this connection) and `fds` more
    /// fit the budget of this uid and of all; then they are charged.
    fn drained(&mut self, fds: usize) -> Result<(), Refusal> {
        let deadline = Instant::now() + IN_FLIGHT_WAIT;
        loop {
            let over = match self.charge.settle(self.session.as_fd()) {
                false => (InFlightScope::Connection, 0, 0),
                true => match self.charge.reserve(fds) {
                    Ok(()) => return Ok(()),
                    Err(over) => over,
                },
            };
            if Instant::now() >= deadline || self.gone() {
                let (scope, in_flight, cap) = over;
                return Err(Refusal::FdsInFlight {
                    scope,
                    in_flight: in_flight as u64,
                    cap: cap as u64,
                });
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// A request's end other than its reply.
enum Handled {
    Refused(Refusal),
    Transport(vmm_core::Error),
}

impl From<Refusal> for Handled {
    fn from(r: Refusal) -> Self {
        Handled::Refused(r)
    }
}

impl From<vmm_core::Error> for Handled {
    fn from(e: vmm_core::Error) -> Self {
        Handled::Transport(e)
    }
}

/// A status cut to fit one `DATA` message: at most 64 reader pids per generation, then
/// regions dropped from the end until it fits.
fn fit(mut status: Status) -> Status {
    for r in &mut status.regions {
        for g in &mut r.generations {
            if g.readers.len() > 64 {
                g.readers.truncate(64);
                status.truncated = true;
            }
        }
    }
    while postcard::to_allocvec(&Response::Status(status.clone()))
        .map_or(true, |b| b.len() > MAX_DATA)
        && status.regions.pop().is_some()
    {
        status.truncated = true;
    }
    status
}
