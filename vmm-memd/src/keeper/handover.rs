//! The hand-over key: how a service that runs another executable than its keeper (a binary
//! upgraded between a stop and a start) and that keeper recognise each other.
//!
//! Both ends of a keeper connection are of the service's uid (the kernel says so). Of the
//! same executable they trust each other as they are; of two executables they must both
//! prove that they hold the keeper's hand-over key: 32 random bytes the service that started
//! the keeper made, gave it on its stdin, and left in the state directory, in a file only the
//! service's uid can read. The proofs are HMAC-SHA-256 over both ends' fresh nonces, so the
//! key itself never crosses the socket and a proof cannot be replayed. Whoever can read the
//! key can already do all the service's uid can; what the key adds is that a copy of some
//! other program of that uid, which is not handed the state directory, takes nothing.

use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use ring::hmac;
use ring::rand::{SecureRandom, SystemRandom};
use vmm_core::wire::endpoint::Name;

/// Bytes in a hand-over key and in a nonce.
pub const KEY_LEN: usize = 32;

/// A keeper's hand-over key (its `Debug` shows no byte of it).
#[derive(Clone, PartialEq, Eq)]
pub struct HandOverKey([u8; KEY_LEN]);

impl std::fmt::Debug for HandOverKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("HandOverKey(..)")
    }
}

/// What one end proves: which end it is, so that a keeper's proof is no service's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    /// The service.
    Service,
    /// The keeper.
    Keeper,
}

impl HandOverKey {
    /// A fresh random key.
    pub fn random() -> Result<HandOverKey, HandOverError> {
        let mut key = [0u8; KEY_LEN];
        SystemRandom::new()
            .fill(&mut key)
            .map_err(|_| HandOverError::Random)?;
        Ok(HandOverKey(key))
    }

    /// The key in `bytes` (exactly [`KEY_LEN`] of them).
    pub fn from_bytes(bytes: &[u8]) -> Option<HandOverKey> {
        Some(HandOverKey(bytes.try_into().ok()?))
    }

    /// Its bytes (to hand to a keeper being started).
    pub fn bytes(&self) -> &[u8; KEY_LEN] {
        &self.0
    }

    /// `end`'s proof of this key for the exchange of nonces `own` (its own) and `other`.
    pub fn proof(&self, end: End, own: &[u8; KEY_LEN], other: &[u8; KEY_LEN]) -> [u8; 32] {
        let tag = hmac::sign(&self.hmac_key(), &transcript(end, own, other));
        tag.as_ref().try_into().expect("HMAC-SHA-256 is 32 bytes")
    }

    /// Whether `proof` is `end`'s proof of this key for nonces `own` (`end`'s) and `other`
    /// (compared in constant time).
    pub fn verify(
        &self,
        end: End,
        own: &[u8; KEY_LEN],
        other: &[u8; KEY_LEN],
        proof: &[u8; 32],
    ) -> bool {
        hmac::verify(&self.hmac_key(), &transcript(end, own, other), proof).is_ok()
    }

    fn hmac_key(&self) -> hmac::Key {
        hmac::Key::new(hmac::HMAC_SHA256, &self.0)
    }
}

fn transcript(end: End, own: &[u8; KEY_LEN], other: &[u8; KEY_LEN]) -> Vec<u8> {
    let label: &[u8] = match end {
        End::Service => b"vmm-memd hand-over: service",
        End::Keeper => b"vmm-memd hand-over: keeper",
    };
    [label, own, other].concat()
}

/// A fresh random nonce.
pub fn nonce() -> Result<[u8; KEY_LEN], HandOverError> {
    Ok(HandOverKey::random()?.0)
}

/// The directory where a service leaves its keeper's hand-over key: owned by this process's
/// uid, and no one else may read, write or enter it.
#[derive(Debug, Clone)]
pub struct StateDir {
    path: PathBuf,
}

impl StateDir {
    /// `path`, created (mode 0700) if it is not there; refused unless it is a directory (not
    /// a link to one) of this uid that no other uid may use.
    pub fn open(path: &Path) -> Result<StateDir, HandOverError> {
        match std::fs::DirBuilder::new().mode(0o700).create(path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(source) => return Err(io("mkdir", path, source)),
        }
        let meta = std::fs::symlink_metadata(path).map_err(|e| io("lstat", path, e))?;
        let unsafe_because = if !meta.file_type().is_dir() {
            Some(Unsafe::NotADirectory)
        } else {
            owned_privately(&meta)
        };
        match unsafe_because {
            Some(why) => Err(HandOverError::Unsafe {
                path: path.to_owned(),
                why,
            }),
            None => Ok(StateDir {
                path: path.to_owned(),
            }),
        }
    }

    /// Where it is.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The file of the key of the keeper at `keeper` (one per keeper name, so services of
    /// several names can share a directory).
    pub fn key_file(&self, keeper: &Name) -> PathBuf {
        let digest = ring::digest::digest(&ring::digest::SHA256, keeper.to_string().as_bytes());
        let hex: String = digest.as_ref()[..16]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        self.path.join(format!("keeper-{hex}.key"))
    }

    /// The key left for the keeper at `keeper`; `Ok(None)` if there is none. Refused if the
    /// file is a link, not this uid's, readable by another uid, or not a key.
    pub fn read_key(&self, keeper: &Name) -> Result<Option<HandOverKey>, HandOverError> {
        let path = self.key_file(keeper);
        let mut file = match std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&path)
        {
            Ok(file) => file,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => return Err(io("open", &path, source)),
        };
        let meta = file.metadata().map_err(|e| io("fstat", &path, e))?;
        if let Some(why) = owned_privately(&meta) {
            return Err(HandOverError::Unsafe { path, why });
        }
        let mut bytes = Vec::with_capacity(KEY_LEN + 1);
        (&mut file)
            .take(KEY_LEN as u64 + 1)
            .read_to_end(&mut bytes)
            .map_err(|e| io("read", &path, e))?;
        HandOverKey::from_bytes(&bytes)
            .map(Some)
            .ok_or(HandOverError::NotAKey { path })
    }

    /// Leave `key` for the keeper at `keeper`, replacing the key of an earlier one: written
    /// to a fresh file of mode 0600, then renamed over the old one.
    pub fn write_key(&self, keeper: &Name, key: &HandOverKey) -> Result<(), HandOverError> {
        let path = self.key_file(keeper);
        let fresh = path.with_extension(format!("key.{}", std::process::id()));
        let _ = std::fs::remove_file(&fresh);
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&fresh)
            .map_err(|e| io("create", &fresh, e))?;
        file.write_all(key.bytes())
            .and_then(|()| file.sync_all())
            .map_err(|e| io("write", &fresh, e))?;
        std::fs::rename(&fresh, &path).map_err(|e| io("rename", &path, e))
    }
}

/// Why a state directory or key file is not used (`None`: it is this uid's alone).
fn owned_privately(meta: &std::fs::Metadata) -> Option<Unsafe> {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    if meta.uid() != euid {
        return Some(Unsafe::Owner { uid: meta.uid() });
    }
    let mode = meta.permissions().mode() & 0o777;
    (mode & 0o077 != 0).then_some(Unsafe::Mode { mode })
}

fn io(op: &'static str, path: &Path, source: std::io::Error) -> HandOverError {
    HandOverError::Io {
        op,
        path: path.to_owned(),
        source,
    }
}

/// Why a state directory or a key file is not trusted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unsafe {
    /// It belongs to another uid.
    Owner {
        /// Its owner.
        uid: u32,
    },
    /// Another uid may read, write or enter it.
    Mode {
        /// Its permission bits.
        mode: u32,
    },
    /// The state directory is not a directory (a link to one is not either).
    NotADirectory,
}

impl std::fmt::Display for Unsafe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Unsafe::Owner { uid } => write!(f, "it belongs to uid {uid}, not to this one"),
            Unsafe::Mode { mode } => write!(f, "its mode {mode:o} lets other uids in"),
            Unsafe::NotADirectory => f.write_str("it is not a directory"),
        }
    }
}

/// What went wrong with the hand-over key.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HandOverError {
    /// A system call on the state directory or a key file failed.
    #[error("{op} {path}: {source}", path = .path.display())]
    Io {
        /// What was being done.
        op: &'static str,
        /// On what.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The state directory or a key file could be read or changed by another uid.
    #[error("{path} is not used: {why}", path = .path.display())]
    Unsafe {
        /// Which.
        path: PathBuf,
        /// Why.
        why: Unsafe,
    },
    /// A key file does not hold a key ([`KEY_LEN`] bytes).
    #[error("{path} holds no hand-over key", path = .path.display())]
    NotAKey {
        /// Which.
        path: PathBuf,
    },
    /// The system's random source failed.
    #[error("no random bytes from the system")]
    Random,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_proof_holds_for_its_key_its_end_and_its_nonces_only() {
        let key = HandOverKey::random().unwrap();
        let other_key = HandOverKey::random().unwrap();
        let (a, b) = (nonce().unwrap(), nonce().unwrap());
        let proof = key.proof(End::Keeper, &a, &b);
        assert!(key.verify(End::Keeper, &a, &b, &proof));
        assert!(!key.verify(End::Service, &a, &b, &proof), "the other end's");
        assert!(!key.verify(End::Keeper, &b, &a, &proof), "nonces swapped");
        assert!(
            !other_key.verify(End::Keeper, &a, &b, &proof),
            "another key"
        );
        assert_ne!(format!("{key:?}"), format!("{:?}", key.bytes()));
    }

    #[test]
    fn a_key_is_written_privately_and_read_back() {
        let dir = std::env::temp_dir().join(format!("vmm-memd-handover-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let state = StateDir::open(&dir).unwrap();
        let name = Name::from("@handover-test");
        assert!(state.read_key(&name).unwrap().is_none());
        let key = HandOverKey::random().unwrap();
        state.write_key(&name, &key).unwrap();
        assert_eq!(state.read_key(&name).unwrap(), Some(key.clone()));
        let mode = std::fs::metadata(state.key_file(&name))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        // A key file others may read is refused, and so is one that is no key.
        let file = state.key_file(&name);
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(matches!(
            state.read_key(&name),
            Err(HandOverError::Unsafe {
                why: Unsafe::Mode { mode: 0o644 },
                ..
            })
        ));
        std::fs::write(&file, b"short").unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(matches!(
            state.read_key(&name),
            Err(HandOverError::NotAKey { .. })
        ));
        // A directory others may enter is refused.
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert!(matches!(
            StateDir::open(&dir),
            Err(HandOverError::Unsafe {
                why: Unsafe::Mode { mode: 0o755 },
                ..
            })
        ));
        // So is one of another uid (root can give it away here; others cannot).
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } == 0 {
            std::os::unix::fs::chown(&dir, Some(65534), None).unwrap();
            assert!(matches!(
                StateDir::open(&dir),
                Err(HandOverError::Unsafe {
                    why: Unsafe::Owner { uid: 65534 },
                    ..
                })
            ));
            std::os::unix::fs::chown(&dir, Some(0), None).unwrap();
        }
        // So is a link to a good one.
        let link = dir.with_extension("link");
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&dir, &link).unwrap();
        assert!(matches!(
            StateDir::open(&link),
            Err(HandOverError::Unsafe {
                why: Unsafe::NotADirectory,
                ..
            })
        ));
        let _ = std::fs::remove_file(&link);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
