//! The service's end of its keeper ([`run`](super::run())): find the keeper of this service's
//! socket name or start one (with a fresh hand-over key, left in the state directory for an
//! upgraded binary: [`super::handover`]), check it is ours, take back what it holds (a
//! restart), and keep it told of every generation committed and freed. A generation goes to the keeper as a
//! sealed record memfd ([`GenerationRecord`]: region, owner, ACL, charge, metadata, chunk
//! sizes) plus its chunk memfds.

use std::io::Write;
use std::os::fd::{AsFd, BorrowedFd, FromRawFd, OwnedFd};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use vmm_core::wire::endpoint::Name;

use super::handover::{HandOverKey, StateDir};
use super::wire::{self as keeper_wire, KeeperError, KeeperMsg};
use crate::protocol::{Acl, Backend, ChunkDigest, TensorMeta};

/// The largest record the service reads back: 64 MiB (65,536 metadata entries with long keys
/// and shapes stay below it).
const MAX_RECORD: u64 = 64 << 20;

/// How long a keeper just started has to listen.
const KEEPER_START: Duration = Duration::from_secs(5);

/// What the keeper holds of one committed generation besides its chunks.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct GenerationRecord {
    pub(crate) region: String,
    pub(crate) generation: u64,
    pub(crate) owner: u32,
    pub(crate) acl: Acl,
    pub(crate) charged_to: u32,
    pub(crate) meta: Vec<(String, TensorMeta)>,
    pub(crate) chunks: Vec<u64>,
    /// Where the chunks live (a GPU chunk's fd is its exported POSIX fd).
    pub(crate) backend: Backend,
    pub(crate) fabric: bool,
    /// The digests taken at commit (GPU).
    pub(crate) digests: Vec<ChunkDigest>,
    /// Its memory was discarded (a discard sleep): the entry carries the record only, no
    /// chunks; `chunks` are the sizes to make again.
    pub(crate) discarded: bool,
    /// The token its writer named it with: a commit's outcome is known after a restart too.
    pub(crate) token: Option<[u8; 16]>,
}

/// The settings an admin changed at run time, which the keeper holds beside the generations
/// (one sealed record memfd, replaced at each change) so that a restart keeps them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Settings {
    /// Quotas set with `SetQuota`, by uid.
    pub(crate) quotas: Vec<(u32, u64)>,
}

/// A generation taken back from the keeper.
#[derive(Debug)]
pub(crate) struct Restored {
    pub(crate) record: GenerationRecord,
    pub(crate) chunks: Vec<OwnedFd>,
}

/// The keeper, connected and checked.
#[derive(Debug)]
pub(crate) struct KeeperLink {
    name: Name,
    linger: Option<Duration>,
    /// Where the hand-over key of a keeper this service starts is left.
    state: Option<StateDir>,
    socket: OwnedFd,
    pidfd: OwnedFd,
    /// The keeper this service started (reaped when it ends); `None` for one a previous
    /// service started.
    child: Option<Child>,
    /// A send failed: the keeper is to be replaced.
    pub(crate) broken: bool,
}

impl KeeperLink {
    /// Connect to the keeper of the service named `service`, or start one (`linger`: how
    /// long it waits for a service before letting everything go; `state`: where its
    /// hand-over key is left, and found when the keeper runs another executable). Refuses an
    /// impostor at the keeper's name ([`KeeperError::Impostor`]). What it held comes back.
    pub(crate) fn establish(
        service: &Name,
        linger: Option<Duration>,
        state: Option<StateDir>,
    ) -> Result<(KeeperLink, Vec<Restored>, Option<Settings>), KeeperError> {
        let name = keeper_wire::keeper_name(service);
        if let Some(socket) = keeper_wire::connect(&name)? {
            let key = match state.as_ref().map(|s| s.read_key(&name)) {
                Some(Ok(key)) => key,
                None => None,
                Some(Err(e)) => {
                    eprintln!("vmm-memd: {e}; a keeper of another executable is refused");
                    None
                }
            };
            let mut link = KeeperLink::open(name, linger, state, socket, key.as_ref(), None)?;
            let (restored, settings) = link.take_back()?;
            return Ok((link, restored, settings));
        }
        Ok((KeeperLink::start(name, linger, state)?, Vec::new(), None))
    }

    fn start(
        name: Name,
        linger: Option<Duration>,
        state: Option<StateDir>,
    ) -> Result<KeeperLink, KeeperError> {
        let key = HandOverKey::random()?;
        if let Some(state) = &state {
            // Without it an upgraded binary cannot take this keeper's memory; a restart of
            // this one still can.
            if let Err(e) = state.write_key(&name, &key) {
                eprintln!("vmm-memd: {e}; an upgraded binary will not find this keeper's key");
            }
        }
        let exe = std::env::current_exe().map_err(|source| KeeperError::Os {
            op: "current_exe",
            source,
        })?;
        let mut command = Command::new(exe);
        command.arg("--keeper").arg(name.to_string());
        if let Some(linger) = linger {
            command
                .arg("--linger-ms")
                .arg(linger.as_millis().to_string());
        }
        // The key goes on its stdin (a pipe no other process holds), never on its command
        // line or in its environment, which other processes can read.
        command.stdin(Stdio::piped()).stdout(Stdio::null());
        // SAFETY: setsid is async-signal-safe; the keeper leaves the service's session and
        // process group, so a signal to the group (a terminal's ^C) does not end it.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut command, || {
                libc::setsid();
                Ok(())
            });
        }
        let mut child = command.spawn().map_err(|source| KeeperError::Os {
            op: "spawn the keeper",
            source,
        })?;
        let handed = child
            .stdin
            .take()
            .map(|mut stdin| stdin.write_all(key.bytes()));
        if !matches!(handed, Some(Ok(()))) {
            let _ = child.kill();
            let _ = child.wait();
            return Err(KeeperError::Gone);
        }
        let deadline = Instant::now() + KEEPER_START;
        let socket = loop {
            match keeper_wire::connect(&name) {
                Ok(Some(socket)) => break socket,
                Ok(None) if Instant::now() < deadline => {
                    if let Ok(Some(_)) = child.try_wait() {
                        return Err(KeeperError::Gone);
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                Ok(None) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(KeeperError::Gone);
                }
                Err(e) => return Err(e),
            }
        };
        let mut link = KeeperLink::open(name, linger, state, socket, Some(&key), Some(child))?;
        // One round trip before anything is sent: the keeper answers only a service it has
        // authenticated, and it authenticates only a live one. Without it, a service that
        // sent everything and died before the keeper accepted its connection would be
        // refused as dead, and everything it sent lost.
        let (restored, settings) = link.take_back()?;
        if !restored.is_empty() || settings.is_some() {
            return Err(KeeperError::Protocol("a new keeper holds generations"));
        }
        Ok(link)
    }

    /// The link over `socket`, connected to the keeper at `name`, once the keeper passed
    /// the checks (this uid; this executable, or its proof of `key`) and `key` was proven to
    /// it (`child`: the keeper, if this service started it).
    fn open(
        name: Name,
        linger: Option<Duration>,
        state: Option<StateDir>,
        socket: OwnedFd,
        key: Option<&HandOverKey>,
        child: Option<Child>,
    ) -> Result<KeeperLink, KeeperError> {
        let peer = keeper_wire::authenticate(socket.as_fd())?;
        keeper_wire::service_handshake(socket.as_fd(), &peer, key)?;
        Ok(KeeperLink {
            name,
            linger,
            state,
            socket,
            pidfd: peer.pidfd,
            child,
            broken: false,
        })
    }

    /// Whether the keeper has exited or a send to it failed.
    pub(crate) fn lost(&self) -> bool {
        self.broken || crate::identity::exited(Some(&self.pidfd))
    }

    /// Replace a lost keeper with a fresh one (which holds nothing: send it everything).
    pub(crate) fn restart(&mut self) -> Result<(), KeeperError> {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        *self = KeeperLink::start(self.name.clone(), self.linger, self.state.take())?;
        Ok(())
    }

    /// Ask for everything the keeper holds: its generations and its settings.
    fn take_back(&mut self) -> Result<(Vec<Restored>, Option<Settings>), KeeperError> {
        keeper_wire::send(self.socket.as_fd(), &KeeperMsg::Hand, &[])?;
        let (mut restored, mut settings) = (Vec::new(), None);
        loop {
            let (msg, mut fds) = keeper_wire::recv(self.socket.as_fd())?;
            match msg {
                KeeperMsg::Entry { region, generation } => {
                    if fds.is_empty() {
                        return Err(KeeperError::Protocol("an entry without its record"));
                    }
                    let chunks = fds.split_off(1);
                    let record: GenerationRecord = read_record(fds[0].as_fd())?;
                    let fds = if record.discarded {
                        0
                    } else {
                        record.chunks.len()
                    };
                    if record.region != region
                        || record.generation != generation
                        || fds != chunks.len()
                    {
                        return Err(KeeperError::Protocol("an entry unlike its record"));
                    }
                    restored.push(Restored { record, chunks });
                }
                KeeperMsg::Settings if fds.len() == 1 && settings.is_none() => {
                    settings = Some(read_record(fds[0].as_fd())?);
                }
                KeeperMsg::Handed { entries } if entries == restored.len() as u64 => {
                    return Ok((restored, settings));
                }
                _ => return Err(KeeperError::Protocol("the keeper sent something else")),
            }
        }
    }

    /// Have the keeper hold a committed generation.
    pub(crate) fn keep(
        &mut self,
        record: &GenerationRecord,
        chunks: &[BorrowedFd<'_>],
    ) -> Result<(), KeeperError> {
        let sealed = write_record(record)?;
        let mut fds = vec![sealed.as_fd()];
        fds.extend_from_slice(chunks);
        let msg = KeeperMsg::Keep {
            region: record.region.clone(),
            generation: record.generation,
        };
        self.sent(keeper_wire::send(self.socket.as_fd(), &msg, &fds))
    }

    /// Have the keeper hold the service's settings, replacing those it held; with none to
    /// hold (all as the command line says), let them go.
    pub(crate) fn keep_settings(&mut self, settings: &Settings) -> Result<(), KeeperError> {
        if *settings == Settings::default() {
            let msg = KeeperMsg::ForgetSettings;
            return self.sent(keeper_wire::send(self.socket.as_fd(), &msg, &[]));
        }
        let sealed = write_record(settings)?;
        let msg = KeeperMsg::KeepSettings;
        self.sent(keeper_wire::send(
            self.socket.as_fd(),
            &msg,
            &[sealed.as_fd()],
        ))
    }

    /// Have the keeper let a generation go.
    pub(crate) fn forget(&mut self, region: &str, generation: u64) {
        let msg = KeeperMsg::Forget {
            region: region.to_owned(),
            generation,
        };
        let _ = self.sent(keeper_wire::send(self.socket.as_fd(), &msg, &[]));
    }

    fn sent(&mut self, result: Result<(), KeeperError>) -> Result<(), KeeperError> {
        if let Err(e) = &result {
            eprintln!("vmm-memd: the keeper is lost ({e}); starting another");
            self.broken = true;
        }
        result
    }

    /// The service stops: the keeper keeps everything for the next service (this binary
    /// again, or an upgraded one that finds the hand-over key), and exits if it holds
    /// nothing. A keeper this service started is not waited for: it outlives the service.
    pub(crate) fn leave(mut self) {
        // Dropping the child handle neither kills nor reaps it; the keeper, in a session of
        // its own, is reparented when this process exits.
        drop(self.child.take());
    }
}

fn os(op: &'static str) -> impl FnOnce(std::io::Error) -> KeeperError {
    move |source| KeeperError::Os { op, source }
}

/// A sealed memfd holding `record` (postcard).
fn write_record(record: &impl Serialize) -> Result<OwnedFd, KeeperError> {
    let bytes = postcard::to_allocvec(record).map_err(|_| KeeperError::Protocol("unencodable"))?;
    // SAFETY: a NUL-terminated name and flags; the result is checked.
    let raw = unsafe {
        libc::memfd_create(
            c"vmm-memd-record".as_ptr(),
            libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
        )
    };
    if raw < 0 {
        return Err(os("memfd_create(record)")(std::io::Error::last_os_error()));
    }
    // SAFETY: a fresh fd that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let mut file = std::fs::File::from(fd);
    file.write_all(&bytes).map_err(os("write(record)"))?;
    let fd = OwnedFd::from(file);
    let seals = libc::F_SEAL_WRITE | libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    // SAFETY: fcntl on a live fd with an int argument.
    if unsafe {
        libc::fcntl(
            std::os::fd::AsRawFd::as_raw_fd(&fd),
            libc::F_ADD_SEALS,
            seals,
        )
    } != 0
    {
        return Err(os("F_ADD_SEALS(record)")(std::io::Error::last_os_error()));
    }
    Ok(fd)
}

/// Read a record memfd back (at most [`MAX_RECORD`] bytes).
fn read_record<T: serde::de::DeserializeOwned>(fd: BorrowedFd<'_>) -> Result<T, KeeperError> {
    let owned = fd.try_clone_to_owned().map_err(os("dup(record)"))?;
    let file = std::fs::File::from(owned);
    let len = file.metadata().map_err(os("fstat(record)"))?.len();
    if len > MAX_RECORD {
        return Err(KeeperError::Protocol("a record over its cap"));
    }
    // At an offset: the keeper's fd shares this file offset.
    let mut bytes = vec![0u8; len as usize];
    std::os::unix::fs::FileExt::read_exact_at(&file, &mut bytes, 0).map_err(os("read(record)"))?;
    postcard::from_bytes(&bytes).map_err(|_| KeeperError::Protocol("an undecodable record"))
}

/// A keeper found or started for a service, with what it held (see
/// [`Service::serve_kept`](crate::Service::serve_kept)).
#[derive(Debug)]
pub struct Keeper {
    pub(crate) link: KeeperLink,
    pub(crate) restored: Vec<Restored>,
    pub(crate) settings: Option<Settings>,
}

impl Keeper {
    /// Find the keeper of the service that listens on `service`, check it (this uid through
    /// `SO_PEERCRED` and a pidfd; this executable, or else its proof of the hand-over key
    /// found in `state`) and take back what it holds; or, when none listens, start one (a
    /// fresh process of this executable, `--keeper NAME`, its hand-over key on its stdin and
    /// left in `state`) that lets everything go once no service has been connected for
    /// `linger` (`None`: never). [`KeeperError::Impostor`]: another process holds the
    /// keeper's name.
    ///
    /// The running executable must be one that runs the keeper when its first argument is
    /// `--keeper` (the `vmm-memd` program does: [`crate::cli::main`]; another program
    /// serving with [`Service::serve_kept`](crate::Service::serve_kept) calls
    /// [`crate::keeper::run()`] then).
    pub fn establish(
        service: &Name,
        linger: Option<Duration>,
        state: Option<StateDir>,
    ) -> Result<Keeper, KeeperError> {
        let (link, restored, settings) = KeeperLink::establish(service, linger, state)?;
        Ok(Keeper {
            link,
            restored,
            settings,
        })
    }

    /// How many committed generations it held.
    pub fn held(&self) -> usize {
        self.restored.len()
    }
}
