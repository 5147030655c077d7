//! The internal protocol: every message between a parent, its children and the forkserver,
//! one type per direction of each socket (which end may send which is `ends`'s to enforce).
//!
//! - At exec, parent -> child: the role variable, a [`Role`] ([`Role::encode`],
//!   [`Role::parse`]).
//! - A child's channel: parent -> child [`Order`]s, child -> parent [`Report`]s (the
//!   forkserver sends a child's [`Report::Exited`] on it too).
//! - A pool worker's task socket: parent -> worker [`Call`]s, nothing back.
//! - The forkserver's request channel: parent -> server [`ForkRequest`]s, server -> parent
//!   [`ForkReply`]s.
//!
//! How a call ended is one [`Outcome`], whether a single-use child or a pool worker ran it.
//! Both processes run the same executable (a [`Call`] checks it: `layout`), so the encoding
//! (postcard, fds beside the bytes) is theirs to change together.

use serde::{Deserialize, Serialize};

use crate::Error;
use crate::error::StartMethod;
use crate::error::{ExitStatus, NotRunStage};

/// The largest CUDA ordinal a warm child's role (and so `VMM_WARM_DEVICES`) may name (a
/// larger one is refused, `EnvRule::TooLarge`): more than any machine has, and it bounds what
/// a warm child tries. Here, with the role that carries the ordinals, below the warm pool.
pub const MAX_DEVICE_ORDINAL: usize = 63;

/// The most ordinals a warm child's role (and `VMM_WARM_DEVICES`'s list) may have (more is
/// refused, `EnvRule::TooMany`): every ordinal up to [`MAX_DEVICE_ORDINAL`] once.
pub const MAX_DEVICES: usize = MAX_DEVICE_ORDINAL + 1;

/// The environment variable that tells a process started by vmm-core its [`Role`], its
/// channel's fd and its parent's pid: the first message to a child, given at exec. Its value is
/// [`Role::encode`]'s, and only [`Role::parse`] reads it.
pub(crate) const ROLE_VAR: &str = "VMM_IPC_CHILD";

/// The longest role value [`Role::parse`] reads: a warm child's, with [`MAX_DEVICES`] ordinals
/// of two digits each, fits several times over.
pub(crate) const MAX_ROLE_LEN: usize = 512;

/// What a process vmm-core starts by exec is to be. (A forkserver child is forked, not
/// exec'd: it needs no role; a pool worker starts as a child of its pool's method and becomes
/// one on its [`Order::Serve`].)
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Role {
    /// A single-use child (spawn): it waits for its order.
    Spawn,
    /// The forkserver.
    Forkserver,
    /// A warm child: it initialises CUDA for these device ordinals (possibly none), says it is
    /// [`Report::Ready`], and waits for its order.
    Warm { devices: Vec<usize> },
}

impl Role {
    /// Its name, as the role variable and diagnostics spell it.
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Role::Spawn => "spawn",
            Role::Forkserver => "forkserver",
            Role::Warm { .. } => "warm",
        }
    }

    /// The role variable's value for this role, the child's channel at fd `channel` and its
    /// parent `parent`: `spawn:<fd>:<pid>`, `forkserver:<fd>:<pid>` or
    /// `warm:<fd>:<pid>:<devices>` (comma-separated, possibly none).
    pub(crate) fn encode(&self, channel: i32, parent: u32) -> String {
        let name = self.name();
        match self {
            Role::Spawn | Role::Forkserver => format!("{name}:{channel}:{parent}"),
            Role::Warm { devices } => {
                let devices: Vec<String> = devices.iter().map(usize::to_string).collect();
                format!("{name}:{channel}:{parent}:{}", devices.join(","))
            }
        }
    }

    /// Read a role variable's value: the role, the channel's fd (3 or above) and the parent's
    /// pid (above 1). `None` for anything [`encode`](Self::encode) does not write: a value
    /// longer than [`MAX_ROLE_LEN`], not UTF-8, an unknown role, a number that does not parse
    /// or is out of range, extra fields, or a device list with an entry that is not an ordinal
    /// up to [`MAX_DEVICE_ORDINAL`] or with more than [`MAX_DEVICES`] entries.
    pub(crate) fn parse(value: &[u8]) -> Option<(Role, i32, u32)> {
        if value.len() > MAX_ROLE_LEN {
            return None;
        }
        let value = std::str::from_utf8(value).ok()?;
        let mut parts = value.splitn(4, ':');
        let kind = parts.next()?;
        let fd: i32 = number(parts.next()?)?;
        let parent: u32 = number(parts.next()?)?;
        let role = match (kind, parts.next()) {
            ("spawn", None) => Role::Spawn,
            ("forkserver", None) => Role::Forkserver,
            ("warm", Some(devices)) => Role::Warm {
                devices: parse_devices(devices)?,
            },
            _ => return None,
        };
        (fd > 2 && parent > 1 && parent <= i32::MAX as u32).then_some((role, fd, parent))
    }
}

/// A warm child's devices as [`Role::encode`] lists them (`0,1`; empty for none).
fn parse_devices(list: &str) -> Option<Vec<usize>> {
    if list.is_empty() {
        return Some(Vec::new());
    }
    let mut devices = Vec::new();
    for entry in list.split(',') {
        let device: usize = number(entry)?;
        if devices.len() == MAX_DEVICES || device > MAX_DEVICE_ORDINAL {
            return None;
        }
        devices.push(device);
    }
    Some(devices)
}

/// A decimal number as [`Role::encode`] writes one: digits only (`parse` alone would take a
/// sign), no leading zero, and in range for `T`.
fn number<T: std::str::FromStr>(digits: &str) -> Option<T> {
    let canonical = !digits.is_empty()
        && digits.bytes().all(|b| b.is_ascii_digit())
        && (digits == "0" || !digits.starts_with('0'));
    canonical.then(|| digits.parse().ok()).flatten()
}

/// Parent -> child, on the child's channel: the one message type a parent sends a child. The
/// first that is not a [`Ping`](Order::Ping) is sent once the parent holds the child (the child
/// waits for it), and is the last.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum Order {
    /// Run one function and exit; the argument's fds ride along.
    Once(Start),
    /// Become a [`Pool`](super::Pool) worker: warm up, say [`Report::Serving`], then run
    /// [`Call`]s from its task socket until the pool closes it.
    Serve(Serve),
    /// Are you alive? A waiting warm child answers [`Report::Pong`] and waits on. The warm
    /// pool asks before it hands a child out, since a killed child's pidfd and channel can stay
    /// quiet for as long as its teardown takes (a CUDA context's can take hundreds of ms), while
    /// only a live child can answer.
    Ping,
}

/// What a single-use child runs. It carries no environment: a child gets its environment
/// where it is made (at exec, or from the forkserver as it forks), never from a message.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Start {
    pub call: Call,
    pub method: StartMethod,
}

/// A function to run in a child: a single-use child's ([`Start`]), or a pool task (alone on
/// a worker's task socket, the argument's fds riding along).
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Call {
    /// Offset of `sys::layout_probe` in the parent, to check that the child runs the same image.
    pub layout: isize,
    /// Offset of the entry point (`remote::registered`); the child calls it only if it is in
    /// its entry table (`entries::find`).
    pub entry: isize,
    /// The argument, postcard with fds out of band.
    pub args: Payload,
}

/// How a pool worker prepares. The message carries one fd: the worker's end of its task
/// socket, where its tasks ([`Call`]s) arrive (the pool keeps a reference to it too: see `pool`).
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Serve {
    /// The CUDA devices (ordinals) whose primary context the worker retains before it serves.
    pub devices: Vec<usize>,
}

/// A serialised argument or result. Its `Debug` shows only its length: what it holds is the
/// user's data, possibly a bearer token (a fabric handle), and a message shows up in
/// diagnostics (a report out of turn, say).
#[derive(Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub(crate) struct Payload(pub Vec<u8>);

impl std::fmt::Debug for Payload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "<{} bytes>", self.0.len())
    }
}

impl std::ops::Deref for Payload {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.0
    }
}

/// Child -> parent, on the child's channel (the forkserver, which keeps a copy of the child's
/// end, sends `Exited` there too): the one message type a child sends.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum Report {
    /// A warm child has initialised CUDA (or found none to initialise) and waits for its
    /// [`Order`].
    Ready,
    /// The child reached its entry and read its start message (a start message it could not
    /// take is reported next, as `Finished(NotRun)`).
    Started,
    /// A call ended (or could not run): a single-use child's (it exits next; its function
    /// returns `()`, so a `Returned` payload is empty), or a pool worker's task (with
    /// `Returned`, the message's fds are the result's; after `Panicked` the worker exits, after
    /// the others it serves on).
    Finished(Outcome),
    /// The forkserver reaped the child.
    Exited(ExitStatus),
    /// A pool worker is warm and waits for tasks.
    Serving,
    /// The answer to [`Order::Ping`]: this child is alive and still waits for its order.
    Pong,
}

/// How a call (a single-use child's function, or one pool task) ended, as the child reports
/// it: the one outcome type, for both kinds of child.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum Outcome {
    /// The function returned this result (postcard, fds out of band; empty for `()`).
    Returned(Payload),
    /// The function returned, but its result could not be sent (an fd-backed value that could
    /// not be serialised, more fds than a message carries): the error, as raised.
    Unsendable(Error),
    /// The function panicked; the child exits next.
    Panicked {
        message: String,
        location: Option<String>,
    },
    /// The function could not run (its entry point is not registered, its argument could not
    /// be received, say): the child's own error.
    NotRun { stage: NotRunStage, error: Error },
}

/// Parent -> forkserver: fork a child. Fds: the child's channel, its stdout, its stderr.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct ForkRequest {
    pub parent: i32,
    /// Environment variables the forked child sets before it waits for its start message
    /// (checked by `launch::check_env` in the parent; the server skips any that is not valid).
    pub env: Vec<(String, String)>,
}

/// Forkserver -> parent. `Forked` carries a pidfd for the child when the kernel has pidfds.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum ForkReply {
    Ready {
        pid: i32,
    },
    Forked {
        pid: i32,
    },
    /// The request was refused ([`Error::Protocol`]) or `fork()` failed ([`Error::Os`], say
    /// `EAGAIN` at a process limit): the server's error, as it raised it.
    Failed(Error),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_never_show_the_bytes_they_carry() {
        // A stand-in for a fabric handle: 64 bytes of a pattern no other field shows.
        let secret = vec![0xA7u8; 64];
        let shown = [
            format!(
                "{:?}",
                Report::Finished(Outcome::Returned(Payload(secret.clone())))
            ),
            format!(
                "{:?}",
                Order::Once(Start {
                    call: Call {
                        layout: 1,
                        entry: 2,
                        args: Payload(secret.clone()),
                    },
                    method: StartMethod::Spawn,
                })
            ),
            format!(
                "{:?}",
                Call {
                    layout: 1,
                    entry: 2,
                    args: Payload(secret.clone()),
                }
            ),
        ];
        for shown in shown {
            assert!(shown.contains("<64 bytes>"), "{shown}");
            assert!(!shown.contains("167") && !shown.contains("a7"), "{shown}");
        }
    }

    #[test]
    fn every_role_survives_its_encoding() {
        let all_devices: Vec<usize> = (0..=MAX_DEVICE_ORDINAL).rev().collect();
        for role in [
            Role::Spawn,
            Role::Forkserver,
            Role::Warm { devices: vec![] },
            Role::Warm {
                devices: vec![0, 3, 3],
            },
            Role::Warm {
                devices: all_devices,
            },
        ] {
            let value = role.encode(1023, i32::MAX as u32);
            assert!(value.len() <= MAX_ROLE_LEN, "{value}");
            assert_eq!(
                Role::parse(value.as_bytes()),
                Some((role, 1023, i32::MAX as u32)),
                "{value}"
            );
        }
        assert_eq!(Role::Spawn.encode(3, 10), "spawn:3:10");
        assert_eq!(
            Role::Warm {
                devices: vec![0, 1]
            }
            .encode(4, 10),
            "warm:4:10:0,1"
        );
    }

    #[test]
    fn malformed_role_values_are_refused() {
        let long = format!("warm:4:10:{}", "0,".repeat(10_000));
        let overlong = format!("spawn:3:{}", "1".repeat(MAX_ROLE_LEN));
        let too_many = format!("warm:4:10:{}", vec!["1"; MAX_DEVICES + 1].join(","));
        for value in [
            "",
            "spawn",
            "spawn:3",
            "spawn:x:10",
            "spawn:3:x",
            "spawn:2:10",
            "spawn:-1:10",
            "spawn:3:1",
            "spawn:3:-10",
            "spawn:3:2147483648",
            "spawn:3:99999999999999999999",
            "spawn:+3:10",
            "spawn:03:10",
            "spawn:3:010",
            "warm:4:10:01",
            "spawn:3:10:extra",
            "spawn:3:10:",
            "forkserver:3:10:extra",
            "other:3:10",
            "Spawn:3:10",
            // A warm child's devices are always written, possibly none.
            "warm:4:10",
            "warm:4:10:0,x,1",
            "warm:4:10:0,,1",
            "warm:4:10:0,",
            "warm:4:10:+1",
            "warm:4:10: 1",
            "warm:4:10:1,64",
            "warm:4:10:1,64,18446744073709551615,-1,63",
            "warm:4:10:18446744073709551616",
            &too_many,
            &long,
            &overlong,
        ] {
            assert_eq!(
                Role::parse(value.as_bytes()),
                None,
                "{value:?} was accepted"
            );
        }
        assert_eq!(Role::parse(b"spawn:3:\xff"), None);
        assert_eq!(Role::parse(b"spawn:3:10"), Some((Role::Spawn, 3, 10)));
        assert_eq!(
            Role::parse(b"forkserver:5:10"),
            Some((Role::Forkserver, 5, 10))
        );
        assert_eq!(
            Role::parse(b"warm:4:10:"),
            Some((Role::Warm { devices: vec![] }, 4, 10))
        );
        assert_eq!(
            Role::parse(b"warm:4:10:0,1,63"),
            Some((
                Role::Warm {
                    devices: vec![0, 1, 63]
                },
                4,
                10
            ))
        );
        let most = format!("warm:4:10:{}", vec!["63"; MAX_DEVICES].join(","));
        assert!(matches!(
            Role::parse(most.as_bytes()),
            Some((Role::Warm { devices }, 4, 10)) if devices.len() == MAX_DEVICES
        ));
    }
}
