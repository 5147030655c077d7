//! The `vmm-memd-publish` program: its command line, signals and exit statuses
//! (`src/bin/vmm-memd-publish.rs` calls [`main`]; tests run it in a child process too).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use vmm_core::wire::endpoint::{Allow, ConnectOptions, Name};
use vmm_core::wire::tls::{PeerCheck, TlsOptions};

use crate::config::{RegistryConfig, TlsMaterial};

use super::publish_error::PublishError;
use super::publisher::MemdPublisher;
use super::publisher_config::{PublisherConfig, Regions};

/// Exit status: stopped by SIGINT or SIGTERM (the lease revoked: every locator gone).
pub const EXIT_STOPPED: i32 = 0;
/// Exit status: the service was gone past the bound. (An etcd outage, or a registry lease
/// etcd says is gone, ends nothing: the registry rides out the one and republishes under a
/// new lease after the other.)
pub const EXIT_LOST: i32 = 1;
/// Exit status: a usage error.
pub const EXIT_USAGE: i32 = 2;
/// Exit status: could not start (service, etcd, TLS files, listener).
pub const EXIT_START: i32 = 3;

const USAGE: &str = "\
usage: vmm-memd-publish --etcd HOST:PORT --ca FILE --cert FILE --key FILE --etcd-name NAME
                        --domain NAME --owner NAME --exporter-name NAME --admit NAME
                        [options]

Publishes the regions of a vmm-memd service in the registry (etcd), so that engines on other
nodes find them, and hands their descriptors to admitted importers over mutual TLS. It is a
client of the service: it publishes what the service lets its uid read, no more.

  --socket NAME|PATH   the service's socket (default: $VMM_MEMD_SOCKET, else @vmm-memd)
  --service-uid UID    the uid the service must run as (default: root or yours)
  --etcd HOST:PORT     an etcd endpoint, spoken to over TLS only (repeatable)
  --ca FILE            the CA (PEM) that signs etcd's and the importers' certificates
  --cert FILE          this publisher's certificate (PEM): its common name is the etcd user,
  --key FILE           its DNS name the exporter's name; and its key
  --etcd-name NAME     the name etcd's certificate carries
  --domain NAME        the registry domain
  --owner NAME         the owner prefix to publish under (the etcd user's)
  --exporter-name NAME the name importers check this publisher's certificate against
  --admit NAME         an importer's certificate name to admit (repeatable)
  --listen ADDR        where importers connect (default 0.0.0.0:0)
  --advertise ADDR     the address locators carry (default: the listener's)
  --region NAME        a region to publish (repeatable; default: every readable one)
  --poll-ms MS         how often to ask the service what it holds (default 1000)
  --lease-ttl-s S      the registry lease's TTL in seconds (default 10)
  --reconnect-ms MS    how long the service may be gone before giving up (default 60000)
  -h, --help           this text

Prints `listening ADDR lease ID` once started, then one line per change on stdout
(published, updated, unpublished, served, failed, service-gone, reconnected; and when etcd
says the registry lease is gone: `unpublished R lease-lost`, `lease ID` for the new lease,
`republished R G`). An etcd outage is ridden out: the lease is kept alive until etcd returns.
Exit status: 0 stopped by SIGINT or SIGTERM (its locators removed at once), 1 the service
gone past --reconnect-ms, 2 usage error, 3 could not start.";

/// A usage error.
#[derive(Debug, thiserror::Error)]
enum UsageError {
    #[error("{0} needs a value ({1})")]
    Value(String, &'static str),
    #[error("unknown option {0}")]
    Unknown(String),
    #[error("missing {0}")]
    Missing(&'static str),
}

/// The command line, parsed.
#[derive(Debug, Default)]
struct Args {
    socket: Option<String>,
    service_uid: Option<u32>,
    etcd: Vec<String>,
    ca: Option<PathBuf>,
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
    etcd_name: Option<String>,
    domain: Option<String>,
    owner: Option<String>,
    exporter_name: Option<String>,
    admit: Vec<String>,
    listen: Option<SocketAddr>,
    advertise: Option<SocketAddr>,
    regions: Vec<String>,
    poll: Option<Duration>,
    ttl: Option<Duration>,
    reconnect: Option<Duration>,
}

fn parse(args: &[String]) -> Result<Option<Args>, UsageError> {
    let mut parsed = Args::default();
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        let mut value = |what: &'static str| {
            it.next()
                .cloned()
                .ok_or_else(|| UsageError::Value(arg.clone(), what))
        };
        let number = |text: String, what| {
            text.parse::<u64>()
                .map_err(|_| UsageError::Value(arg.clone(), what))
        };
        let address = |text: String| {
            text.parse::<SocketAddr>()
                .map_err(|_| UsageError::Value(arg.clone(), "IP:PORT"))
        };
        match arg.as_str() {
            "-h" | "--help" => return Ok(None),
            "--socket" => parsed.socket = Some(value("NAME|PATH")?),
            "--service-uid" => {
                let uid = number(value("UID")?, "UID")?;
                let uid = u32::try_from(uid).map_err(|_| UsageError::Value(arg.clone(), "UID"))?;
                parsed.service_uid = Some(uid);
            }
            "--etcd" => parsed.etcd.push(value("HOST:PORT")?),
            "--ca" => parsed.ca = Some(value("FILE")?.into()),
            "--cert" => parsed.cert = Some(value("FILE")?.into()),
            "--key" => parsed.key = Some(value("FILE")?.into()),
            "--etcd-name" => parsed.etcd_name = Some(value("NAME")?),
            "--domain" => parsed.domain = Some(value("NAME")?),
            "--owner" => parsed.owner = Some(value("NAME")?),
            "--exporter-name" => parsed.exporter_name = Some(value("NAME")?),
            "--admit" => parsed.admit.push(value("NAME")?),
            "--listen" => parsed.listen = Some(address(value("IP:PORT")?)?),
            "--advertise" => parsed.advertise = Some(address(value("IP:PORT")?)?),
            "--region" => parsed.regions.push(value("NAME")?),
            "--poll-ms" => {
                let ms = number(value("MS")?, "MS")?;
                parsed.poll = Some(Duration::from_millis(ms.max(1)));
            }
            "--lease-ttl-s" => parsed.ttl = Some(Duration::from_secs(number(value("S")?, "S")?)),
            "--reconnect-ms" => {
                parsed.reconnect = Some(Duration::from_millis(number(value("MS")?, "MS")?))
            }
            other => return Err(UsageError::Unknown(other.to_owned())),
        }
    }
    let required: [(&'static str, bool); 9] = [
        ("--etcd", parsed.etcd.is_empty()),
        ("--ca", parsed.ca.is_none()),
        ("--cert", parsed.cert.is_none()),
        ("--key", parsed.key.is_none()),
        ("--etcd-name", parsed.etcd_name.is_none()),
        ("--domain", parsed.domain.is_none()),
        ("--owner", parsed.owner.is_none()),
        ("--exporter-name", parsed.exporter_name.is_none()),
        ("--admit", parsed.admit.is_empty()),
    ];
    if let Some((name, _)) = required.iter().find(|(_, missing)| *missing) {
        return Err(UsageError::Missing(name));
    }
    Ok(Some(parsed))
}

/// Why the program could not start: one of the files, or the publisher.
#[derive(Debug, thiserror::Error)]
enum StartError {
    #[error("reading {path:?}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the exporter's TLS options")]
    Tls(#[source] vmm_core::Error),
    #[error(transparent)]
    Publisher(PublishError),
}

fn config(args: Args) -> Result<PublisherConfig, StartError> {
    let read = |path: &PathBuf| {
        std::fs::read(path).map_err(|source| StartError::Read {
            path: path.clone(),
            source,
        })
    };
    // `parse` made sure of every required option.
    let (ca, cert, key) = (
        args.ca.unwrap_or_default(),
        args.cert.unwrap_or_default(),
        args.key.unwrap_or_default(),
    );
    let material = TlsMaterial::from_pem(
        read(&ca)?,
        read(&cert)?,
        read(&key)?,
        args.etcd_name.unwrap_or_default(),
    );
    let mut registry = RegistryConfig::new(
        args.etcd,
        material,
        args.domain.unwrap_or_default(),
        args.owner.unwrap_or_default(),
    );
    if let Some(ttl) = args.ttl {
        registry = registry.lease_ttl(ttl);
    }
    let admit = PeerCheck::names(args.admit.iter().map(String::as_str)).map_err(StartError::Tls)?;
    let exporter = TlsOptions::from_pem_files(&cert, &key, &ca, admit).map_err(StartError::Tls)?;
    let socket = args
        .socket
        .or_else(|| std::env::var("VMM_MEMD_SOCKET").ok())
        .unwrap_or_else(|| "@vmm-memd".into());
    let expect = match args.service_uid {
        Some(uid) => Allow::none().uid(uid),
        None => Allow::same_user().uid(0),
    };
    let mut config = PublisherConfig::new(
        Name::from(socket.as_str()),
        registry,
        exporter,
        args.listen
            .unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], 0))),
        args.exporter_name.unwrap_or_default(),
    );
    config.connect = ConnectOptions::default().expect(expect);
    config.advertise = args.advertise;
    if !args.regions.is_empty() {
        config.regions = Regions::Named(args.regions);
    }
    if let Some(poll) = args.poll {
        config.poll = poll;
    }
    if let Some(reconnect) = args.reconnect {
        config.reconnect_within = reconnect;
    }
    Ok(config)
}

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_stop(_: nix::libc::c_int) {
    // An atomic store is async-signal-safe.
    STOP.store(true, Ordering::SeqCst);
}

/// Run the program with `args` (without the program name); the exit status.
pub fn main(args: &[String]) -> i32 {
    let args = match parse(args) {
        Ok(Some(args)) => args,
        Ok(None) => {
            println!("{USAGE}");
            return EXIT_STOPPED;
        }
        Err(e) => {
            eprintln!("vmm-memd-publish: {e}\n{USAGE}");
            return EXIT_USAGE;
        }
    };
    let handler = nix::sys::signal::SigHandler::Handler(on_stop);
    for signal in [
        nix::sys::signal::Signal::SIGINT,
        nix::sys::signal::Signal::SIGTERM,
    ] {
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        if let Err(e) = unsafe { nix::sys::signal::signal(signal, handler) } {
            eprintln!("vmm-memd-publish: cannot handle {signal}: {e}");
            return EXIT_START;
        }
    }
    let started = config(args).and_then(|c| MemdPublisher::start(c).map_err(StartError::Publisher));
    let mut publisher = match started {
        Ok(publisher) => publisher,
        Err(e) => {
            eprintln!("vmm-memd-publish: cannot start: {}", chain(&e));
            return EXIT_START;
        }
    };
    println!(
        "listening {} lease {}",
        publisher.local_addr(),
        publisher.registry().lease_id()
    );
    let ran = publisher.run(&STOP, |event| println!("{event}"));
    match ran {
        Ok(()) => match publisher.close() {
            Ok(()) => EXIT_STOPPED,
            Err(e) => {
                // The lease expires by itself within its TTL.
                eprintln!("vmm-memd-publish: stopping: {}", chain(&e));
                EXIT_STOPPED
            }
        },
        Err(e) => {
            eprintln!("vmm-memd-publish: {}", chain(&e));
            EXIT_LOST
        }
    }
}

/// An error and its sources, on one line.
fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(words: &str) -> Vec<String> {
        words.split_whitespace().map(str::to_owned).collect()
    }

    const FULL: &str = "--etcd 127.0.0.1:2379 --ca ca.pem --cert a.pem --key a.key \
        --etcd-name etcd.example --domain d --owner a --exporter-name a.example --admit b.example";

    #[test]
    fn usage_errors_are_typed() {
        assert!(matches!(parse(&args("--help")), Ok(None)));
        assert!(matches!(parse(&args(FULL)), Ok(Some(_))));
        assert!(matches!(
            parse(&args("--etcd")),
            Err(UsageError::Value(flag, _)) if flag == "--etcd"
        ));
        assert!(matches!(
            parse(&args(&format!("{FULL} --poll-ms soon"))),
            Err(UsageError::Value(flag, "MS")) if flag == "--poll-ms"
        ));
        assert!(matches!(
            parse(&args(&format!("{FULL} --listen nowhere"))),
            Err(UsageError::Value(..))
        ));
        assert!(matches!(
            parse(&args(&format!("{FULL} --frobnicate"))),
            Err(UsageError::Unknown(_))
        ));
        assert!(matches!(
            parse(&args(&FULL.replace("--admit b.example", ""))),
            Err(UsageError::Missing("--admit"))
        ));
        assert_eq!(main(&args("--bogus")), EXIT_USAGE);
    }
}
