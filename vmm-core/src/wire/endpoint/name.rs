//! Endpoint names (a filesystem path, or a name in the abstract namespace), and everything
//! binding a path involves: the owner-only directory, the stale socket file of a dead listener,
//! the socket file's mode, and unlinking only what this listener made.

use std::fmt;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::sys::socket::{AddressFamily, SockFlag, SockType, UnixAddr, connect, socket};

use crate::error::EndpointRule;
use crate::{Error, Result};

/// Where an endpoint listens.
///
/// - [`Name::Path`]: a socket file. It is created mode 0600 inside a directory that must be
///   owned by this process's effective uid and closed to everyone else (mode 0700 or
///   stricter); a missing last directory is created so. The directory is what keeps other
///   users from reaching the socket at all.
/// - [`Name::Abstract`]: Linux's abstract namespace (no file; gone when the listener closes).
///   Any process in the same network namespace can connect, so the credential checks are all
///   that stands between it and the fds.
///
/// As a string (see [`FromStr`](std::str::FromStr)), a leading `@` names an abstract socket:
/// `"@vmm-weights"`; anything else is a path.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Name {
    /// A socket file at this path.
    Path(PathBuf),
    /// A name in the abstract namespace (the bytes after the leading NUL).
    Abstract(Vec<u8>),
}

/// `sun_path` is 108 bytes: a path needs its terminating NUL, an abstract name its leading one.
const SUN_PATH_MAX: usize = 107;

impl Name {
    /// A path socket.
    pub fn path(path: impl Into<PathBuf>) -> Name {
        Name::Path(path.into())
    }

    /// An abstract socket named `name` (without the leading NUL or `@`).
    pub fn abstract_name(name: impl AsRef<[u8]>) -> Name {
        Name::Abstract(name.as_ref().to_vec())
    }

    /// The socket address, checked for length.
    pub(crate) fn addr(&self) -> Result<UnixAddr> {
        let too_long = |len: usize| {
            Err(Error::InvalidEndpoint {
                rule: EndpointRule::NameTooLong {
                    len,
                    max: SUN_PATH_MAX,
                },
                message: format!(
                    "endpoint name {self} is {len} bytes; a Unix socket name has at most \
                     {SUN_PATH_MAX}"
                ),
            })
        };
        match self {
            Name::Path(path) => {
                let len = path.as_os_str().len();
                if len == 0 {
                    return Err(Error::InvalidEndpoint {
                        rule: EndpointRule::EmptyName,
                        message: "endpoint path is empty".into(),
                    });
                }
                if len > SUN_PATH_MAX {
                    return too_long(len);
                }
                UnixAddr::new(path.as_path())
                    .map_err(|e| Error::errno(format!("socket address {}", path.display()), e))
            }
            Name::Abstract(name) => {
                if name.len() > SUN_PATH_MAX {
                    return too_long(name.len());
                }
                UnixAddr::new_abstract(name)
                    .map_err(|e| Error::errno(format!("abstract socket address {self}"), e))
            }
        }
    }
}

impl fmt::Display for Name {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Name::Path(path) => write!(f, "{}", path.display()),
            Name::Abstract(name) => write!(f, "@{}", String::from_utf8_lossy(name)),
        }
    }
}

impl std::str::FromStr for Name {
    type Err = std::convert::Infallible;

    /// `@name` is abstract; anything else is a path.
    fn from_str(s: &str) -> std::result::Result<Name, Self::Err> {
        Ok(match s.strip_prefix('@') {
            Some(name) => Name::abstract_name(name),
            None => Name::path(s),
        })
    }
}

impl From<&str> for Name {
    fn from(s: &str) -> Name {
        s.parse().expect("infallible")
    }
}

/// A fresh, unbound `SOCK_SEQPACKET` Unix socket (CLOEXEC; `nonblocking` sets O_NONBLOCK).
pub(crate) fn seqpacket_socket(nonblocking: bool) -> Result<OwnedFd> {
    let mut flags = SockFlag::SOCK_CLOEXEC;
    if nonblocking {
        flags |= SockFlag::SOCK_NONBLOCK;
    }
    socket(AddressFamily::Unix, SockType::SeqPacket, flags, None)
        .map_err(|e| Error::errno("socket(AF_UNIX, SOCK_SEQPACKET)", e))
}

/// The socket file a path listener made: unlinked on drop if it is still the same file.
#[derive(Debug)]
pub(crate) struct SocketFile {
    path: PathBuf,
    /// (st_dev, st_ino) of the file this listener bound.
    id: (u64, u64),
}

impl Drop for SocketFile {
    fn drop(&mut self) {
        // Only our own file: a later listener may have replaced it (after this one was
        // presumed dead), and its socket is not ours to remove.
        if let Ok(meta) = std::fs::symlink_metadata(&self.path)
            && (meta.dev(), meta.ino()) == self.id
        {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// The checks a path endpoint's directory must pass, in the words every refusal uses.
fn check_directory(dir: &Path) -> Result<()> {
    let refuse = |rule: EndpointRule, why: String| {
        Err(Error::InvalidEndpoint {
            rule,
            message: format!(
                "endpoint directory {}: {why}; a path endpoint lives in a directory only its \
                 owner can enter (mode 0700, owned by this process's effective uid), or use an \
                 abstract name (@name)",
                dir.display()
            ),
        })
    };
    let meta = match std::fs::symlink_metadata(dir) {
        Ok(meta) => meta,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            // Create the last component only, owner-only from birth (mkdir's mode is reduced by
            // the umask, never widened).
            match std::fs::DirBuilder::new().mode(0o700).create(dir) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                Err(e) => {
                    return Err(Error::io(format!("mkdir({}, 0700)", dir.display()), e));
                }
            }
            std::fs::symlink_metadata(dir)
                .map_err(|e| Error::io(format!("lstat({})", dir.display()), e))?
        }
        Err(e) => return Err(Error::io(format!("lstat({})", dir.display()), e)),
    };
    let kind = meta.file_type();
    if kind.is_symlink() {
        return refuse(
            EndpointRule::DirectorySymlink,
            "is a symbolic link (name the directory itself)".into(),
        );
    }
    if !kind.is_dir() {
        return refuse(EndpointRule::NotADirectory, "is not a directory".into());
    }
    let euid = super::creds::euid();
    // Files of every user unmapped in this user namespace read as owned by the overflow uid:
    // a process that is that uid cannot tell its own directory from theirs.
    if super::creds::maybe_overflow_uid(euid) {
        return refuse(
            EndpointRule::OverflowUid { uid: euid },
            format!(
                "this process's uid {euid} is the overflow uid (or /proc/sys/kernel/overflowuid \
             cannot be read): the owner of a directory cannot tell it from other users that \
             have no mapping in its user namespace"
            ),
        );
    }
    if meta.uid() != euid {
        return refuse(
            EndpointRule::DirectoryOwner {
                owner: meta.uid(),
                uid: euid,
            },
            format!(
                "is owned by uid {}, not by this process's uid {euid}",
                meta.uid()
            ),
        );
    }
    let mode = meta.mode() & 0o7777;
    if mode & 0o077 != 0 {
        return refuse(
            EndpointRule::DirectoryMode { mode },
            format!("has mode {mode:04o}: group or others may enter or list it"),
        );
    }
    Ok(())
}

/// Whether a live listener answers at `addr`: `Ok(true)` live (or some other program's socket
/// in use), `Ok(false)` a stale file nobody listens on (`ECONNREFUSED`).
fn answers(addr: &UnixAddr) -> Result<bool> {
    let probe = seqpacket_socket(true)?;
    match connect(probe.as_raw_fd(), addr) {
        // The live listener sees a connection that hangs up at once, which it skips.
        Ok(()) => Ok(true),
        // Backlog full, or a socket of another type that someone is using: live either way.
        Err(Errno::EAGAIN | Errno::EPROTOTYPE) => Ok(true),
        Err(Errno::ECONNREFUSED) => Ok(false),
        Err(e) => Err(Error::errno("connect(probe of an existing socket file)", e)),
    }
}

/// Bind `socket` to the path `path`: check its directory, replace a stale socket file of a dead
/// listener (never a live one's), make the new file 0600, and return the guard that unlinks it.
pub(crate) fn bind_path(socket: &OwnedFd, name: &Name, path: &Path) -> Result<SocketFile> {
    let addr = name.addr()?;
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    check_directory(dir)?;
    match std::fs::symlink_metadata(path) {
        Ok(meta) => {
            use std::os::unix::fs::FileTypeExt;
            if !meta.file_type().is_socket() {
                return Err(Error::InvalidEndpoint {
                    rule: EndpointRule::NotASocket,
                    message: format!(
                        "endpoint path {}: exists and is not a socket; refusing to replace it",
                        path.display()
                    ),
                });
            }
            if answers(&addr)? {
                return Err(in_use(name));
            }
            // A dead listener's file (connect was refused): replace it.
            match std::fs::remove_file(path) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => {
                    return Err(Error::io(
                        format!("unlink(stale socket file {})", path.display()),
                        e,
                    ));
                }
            }
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(Error::io(format!("lstat({})", path.display()), e)),
    }
    match nix::sys::socket::bind(socket.as_raw_fd(), &addr) {
        Ok(()) => {}
        Err(Errno::EADDRINUSE) => return Err(in_use(name)),
        Err(e) => return Err(Error::errno(format!("bind({name})"), e)),
    }
    let meta = std::fs::symlink_metadata(path)
        .map_err(|e| Error::io(format!("lstat({})", path.display()), e))?;
    let file = SocketFile {
        path: path.to_owned(),
        id: (meta.dev(), meta.ino()),
    };
    // bind made the file 0777 & ~umask; the directory kept everyone else out meanwhile.
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .map_err(|e| Error::io(format!("chmod({}, 0600)", path.display()), e))?;
    Ok(file)
}

/// Bind `socket` to an abstract name.
pub(crate) fn bind_abstract(socket: &OwnedFd, name: &Name) -> Result<()> {
    let addr = name.addr()?;
    match nix::sys::socket::bind(socket.as_raw_fd(), &addr) {
        Ok(()) => Ok(()),
        Err(Errno::EADDRINUSE) => Err(in_use(name)),
        Err(e) => Err(Error::errno(format!("bind({name})"), e)),
    }
}

/// The refusal to take a name a live listener holds: an [`Error::Os`] with `EADDRINUSE`.
fn in_use(name: &Name) -> Error {
    Error::Os {
        op: format!("bind({name}): a live listener already serves this name"),
        source: io::Error::from_raw_os_error(libc::EADDRINUSE),
    }
}
