//! The `vmm-memctl` program: `status`, `list`, `metrics` (reading: they change nothing in the
//! service), `sleep`, `wake`, `delete` and `acl` for a region's admins, and `quota` and
//! `release --all` for the service's operators, as text or JSON (`src/bin/vmm-memctl.rs` is a thin `main` over
//! [`main`]).

use std::io::Write;

use vmm_core::wire::endpoint::{Allow, ConnectOptions, Name};

use crate::cli::UsageError;
use crate::client::Client;
use crate::error::MemdError;
use crate::protocol::{Acl, Principal, SleepState, Status};

/// The usage text (`--help`).
pub const USAGE: &str = "\
usage: vmm-memctl [--socket NAME|PATH] [--service-uid UID] [--json] COMMAND

Operate a vmm-memd service (see vmm-memd/README.md).

Commands (status, list and metrics change nothing):
  status          per region you may read: its generations (current, bytes, the pid of each
                  reader's lease, asleep or falling asleep), the writer's pending generation,
                  waiting writers; your uid's quota use; refusals and expired leases since
                  the service started
  list            regions you may read: name, current generation, bytes, and whether it
                  is awake, falling asleep (leases still hold it) or asleep
  metrics         the same in the Prometheus text format
  sleep REGION    put the current generation to a discard sleep: its memory goes once no
                  lease holds it; number, metadata and quota charge stay (its owner, or
                  whom its ACL lets write)
  wake REGION     make an asleep generation's memory again now, zeroed, or call off a sleep
                  still waiting for leases (the same admins)
  delete REGION   delete a region (its owner, or whom its ACL lets delete)
  acl REGION [--read P]... [--write P]... [--delete P]...
                  replace the region's ACL (P: uid:N or gid:N; none: the owner alone); its
                  owner or an operator; kept across restarts
  quota UID BYTES|default
                  set a uid's quota, or give it back the one the service was started with;
                  an operator; kept across restarts
  release --all   delete every region, giving their memory back for good (a stop, a restart
                  and an upgrade of the service keep it); a region a writer is filling or
                  waiting for stays; an operator

The service's operators (vmm-memd --admin-uid/--admin-gid; root by default) also see every
region in status, list and metrics, and may sleep, wake and delete any.

Options:
  --socket NAME|PATH   the service (default: $VMM_MEMD_SOCKET, else @vmm-memd)
  --service-uid UID    the uid the service must run as (default: root or yours)
  --json               print one JSON document on stdout
  -h, --help           this text

Exit status: 0 done; 1 the service refused (why on stderr, and with --json on stdout as
{\"refused\": ...}); 2 usage error; 3 no service there; 4 another failure.";

/// Exit status: the service refused.
pub const EXIT_REFUSED: i32 = 1;
/// Exit status: a usage error.
pub const EXIT_USAGE: i32 = 2;
/// Exit status: no service listens (or it went away).
pub const EXIT_NO_SERVICE: i32 = 3;
/// Exit status: another failure.
pub const EXIT_FAILED: i32 = 4;

/// What `vmm-memctl` is asked to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    /// `status`.
    Status,
    /// `list`.
    List,
    /// `metrics`.
    Metrics,
    /// `delete REGION`.
    Delete(String),
    /// `sleep REGION`.
    Sleep(String),
    /// `wake REGION`.
    Wake(String),
    /// `release --all`.
    ReleaseAll,
    /// `acl REGION ...`.
    Acl(String, Acl),
    /// `quota UID BYTES|default`.
    Quota(u32, Option<u64>),
}

/// A parsed command line.
#[derive(Debug)]
struct Invocation {
    socket: Name,
    service_uid: Option<u32>,
    json: bool,
    command: Command,
}

fn parse(args: &[String]) -> Result<Option<Invocation>, UsageError> {
    let mut socket = std::env::var("VMM_MEMD_SOCKET").unwrap_or_else(|_| "@vmm-memd".into());
    let (mut json, mut service_uid, mut words) = (false, None, Vec::new());
    let (mut acl, mut acl_given) = (Acl::default(), false);
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "-h" | "--help" => return Ok(None),
            "--json" => json = true,
            // A flag of the `release` command (the only way to call it: nothing is released
            // by accident).
            "--all" => words.push(arg.clone()),
            // The `acl` command's entries.
            "--read" | "--write" | "--delete" => {
                let entry = it
                    .next()
                    .ok_or_else(|| UsageError::Value(arg.clone(), "uid:N or gid:N"))?;
                let principal = principal(entry)
                    .ok_or_else(|| UsageError::Value(arg.clone(), "uid:N or gid:N"))?;
                let list = match arg.as_str() {
                    "--read" => &mut acl.read,
                    "--write" => &mut acl.write,
                    _ => &mut acl.delete,
                };
                list.push(principal);
                acl_given = true;
            }
            "--socket" => {
                socket = it
                    .next()
                    .ok_or_else(|| UsageError::Value(arg.clone(), "NAME|PATH"))?
                    .clone()
            }
            "--service-uid" => {
                let uid = it.next().and_then(|u| u.parse().ok());
                service_uid = Some(uid.ok_or_else(|| UsageError::Value(arg.clone(), "UID"))?);
            }
            flag if flag.starts_with('-') => return Err(UsageError::Unknown(flag.to_owned())),
            word => words.push(word.to_owned()),
        }
    }
    let command = match words.as_slice() {
        [c] if c == "status" => Command::Status,
        [c] if c == "list" => Command::List,
        [c] if c == "metrics" => Command::Metrics,
        [c, region] if c == "delete" => Command::Delete(region.clone()),
        [c, region] if c == "sleep" => Command::Sleep(region.clone()),
        [c, region] if c == "wake" => Command::Wake(region.clone()),
        [c, all] if c == "release" && all == "--all" => Command::ReleaseAll,
        [c] if c == "release" => return Err(UsageError::Missing("release's --all")),
        [c, region] if c == "acl" => Command::Acl(region.clone(), acl.clone()),
        [c, uid, bytes] if c == "quota" => {
            let uid = uid
                .parse()
                .map_err(|_| UsageError::Value("quota".into(), "UID"))?;
            let bytes = match bytes.as_str() {
                "default" => None,
                n => Some(
                    n.parse()
                        .map_err(|_| UsageError::Value("quota".into(), "BYTES or default"))?,
                ),
            };
            Command::Quota(uid, bytes)
        }
        [] => return Err(UsageError::Missing("a command")),
        other => return Err(UsageError::Unknown(other.join(" "))),
    };
    if acl_given && !matches!(command, Command::Acl(..)) {
        return Err(UsageError::Unknown(
            "--read/--write/--delete outside `acl`".into(),
        ));
    }
    Ok(Some(Invocation {
        socket: Name::from(socket.as_str()),
        service_uid,
        json,
        command,
    }))
}

/// An ACL entry as the command line gives it: `uid:N` or `gid:N`.
fn principal(text: &str) -> Option<Principal> {
    let (kind, id) = text.split_once(':')?;
    let id = id.parse().ok()?;
    match kind {
        "uid" => Some(Principal::Uid(id)),
        "gid" => Some(Principal::Gid(id)),
        _ => None,
    }
}

/// Run `vmm-memctl` with `args` (without the program name); the exit status.
pub fn main(args: &[String]) -> i32 {
    let invocation = match parse(args) {
        Ok(Some(invocation)) => invocation,
        Ok(None) => {
            println!("{USAGE}");
            return 0;
        }
        Err(e) => {
            eprintln!("vmm-memctl: {e}\n{USAGE}");
            return EXIT_USAGE;
        }
    };
    match run(&invocation) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("vmm-memctl: {e}");
            match e {
                MemdError::Refused(refusal) => {
                    if invocation.json {
                        let doc = serde_json::json!({ "refused": refusal });
                        println!("{doc}");
                    }
                    EXIT_REFUSED
                }
                MemdError::ServiceGone(_) => EXIT_NO_SERVICE,
                _ => EXIT_FAILED,
            }
        }
    }
}

fn run(invocation: &Invocation) -> Result<(), MemdError> {
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    let expect = match invocation.service_uid {
        Some(uid) => Allow::none().uid(uid),
        None => Allow::none().uid(0).uid(me),
    };
    let client = Client::connect_with(
        &invocation.socket,
        &ConnectOptions::default().expect(expect),
    )?;
    let json = invocation.json;
    let mut out = std::io::stdout().lock();
    let to_json =
        |value: serde_json::Value| serde_json::to_string_pretty(&value).unwrap_or_default();
    let text = match &invocation.command {
        Command::Status => {
            let status = client.status()?;
            match json {
                true => to_json(serde_json::json!(status)),
                false => status_text(&status),
            }
        }
        Command::List => {
            let list = client.list()?;
            match json {
                true => to_json(serde_json::json!(list)),
                false => list
                    .iter()
                    .map(|r| {
                        let sleep = sleep_word(r.sleep);
                        format!("{}\t{}\t{}\t{sleep}\n", r.region, r.generation, r.bytes)
                    })
                    .collect(),
            }
        }
        Command::Metrics => {
            let metrics = client.metrics()?;
            match json {
                true => to_json(serde_json::json!({ "metrics": metrics })),
                false => metrics,
            }
        }
        Command::Sleep(region) => {
            let slept = client.sleep_region(region)?;
            let (generation, leases) = (slept.generation, slept.leases);
            match (json, leases) {
                (true, _) => to_json(serde_json::json!({
                    "slept": region, "generation": generation, "leases": leases
                })),
                (false, 0) => format!("{region} generation {generation} asleep: memory freed\n"),
                (false, n) => format!(
                    "{region} generation {generation} falling asleep: memory freed once {n} \
                     leases end\n"
                ),
            }
        }
        Command::Wake(region) => {
            let woke = client.wake_region(region)?;
            let (generation, zeroed) = (woke.generation, woke.zeroed);
            match (json, zeroed) {
                (true, _) => to_json(serde_json::json!({
                    "woke": region, "generation": generation, "zeroed": zeroed
                })),
                (false, true) => format!("{region} generation {generation} awake: zeroed\n"),
                (false, false) => format!(
                    "{region} generation {generation} awake: the sleep was called off, \
                     contents kept\n"
                ),
            }
        }
        Command::ReleaseAll => {
            let released = client.release_all()?;
            let (regions, busy) = (released.regions, released.busy);
            match json {
                true => to_json(serde_json::json!({ "released": regions, "busy": busy })),
                false if busy == 0 => format!("released {regions} regions\n"),
                false => format!(
                    "released {regions} regions; {busy} left (a writer at work or waiting)\n"
                ),
            }
        }
        Command::Acl(region, acl) => {
            client.set_acl(region, acl)?;
            match json {
                true => to_json(serde_json::json!({ "acl": region, "set": acl })),
                false => format!(
                    "{region}: ACL set ({} read, {} write, {} delete)\n",
                    acl.read.len(),
                    acl.write.len(),
                    acl.delete.len()
                ),
            }
        }
        Command::Quota(uid, bytes) => {
            client.set_quota(*uid, *bytes)?;
            match (json, bytes) {
                (true, _) => to_json(serde_json::json!({ "quota": uid, "bytes": bytes })),
                (false, Some(b)) => format!("uid {uid}: quota {b} bytes\n"),
                (false, None) => format!("uid {uid}: quota back to the service's default\n"),
            }
        }
        Command::Delete(region) => {
            client.delete(region)?;
            match json {
                true => to_json(serde_json::json!({ "deleted": region })),
                false => format!("deleted {region}\n"),
            }
        }
    };
    let _ = write!(out, "{text}");
    if json {
        let _ = writeln!(out);
    }
    Ok(())
}

fn status_text(status: &Status) -> String {
    let mut out = format!(
        "uid {}: {} of {} bytes used; {} refusals, {} expired leases since start{}\n",
        status.uid,
        status.used,
        status.quota,
        status.refusals,
        status.expired_leases,
        if status.truncated { " (truncated)" } else { "" }
    );
    for r in &status.regions {
        out += &format!(
            "{} (owner {}, {} waiting writers)\n",
            r.region, r.owner, r.waiting_writers
        );
        for g in &r.generations {
            let readers: Vec<String> = g.readers.iter().map(i32::to_string).collect();
            let state = match (g.current, g.sleep) {
                (true, SleepState::Awake) => " (current)".to_owned(),
                (false, SleepState::Awake) => String::new(),
                (true, sleep) => format!(" (current, {})", sleep_word(sleep)),
                (false, sleep) => format!(" ({})", sleep_word(sleep)),
            };
            out += &format!(
                "  generation {}{state}: {} bytes, {} leases, readers [{}]\n",
                g.generation,
                g.bytes,
                g.readers.len(),
                readers.join(" ")
            );
        }
        if let Some((generation, bytes, pid)) = r.pending {
            out += &format!("  generation {generation} (pending): {bytes} bytes, writer {pid}\n");
        }
    }
    out
}

/// A generation's sleep in words, as `list` and `status` print it.
fn sleep_word(sleep: SleepState) -> &'static str {
    match sleep {
        SleepState::Awake => "awake",
        SleepState::Falling => "falling asleep",
        SleepState::Asleep => "asleep",
    }
}
