//! The hand-off's parts in tests: vmm-core TLS options for a named side, an exporter that
//! serves the stand-in, and its locator.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use vmm_core::cuda::FabricDescriptor;
use vmm_core::wire::tls::{PeerCheck, TlsIdentity, TlsOptions};
use vmm_registry::{ExportServer, ExportedObject, Fetcher, HandleKind, Locator};
use vmm_tests::pki::{Pki, dns_name};

use super::issue;

/// The size of the stand-in buffer.
pub const SIZE: usize = 1 << 20;

/// How long one hand-off message may take in tests.
pub const MESSAGE: Duration = Duration::from_secs(5);

/// The object every hand-off test exports.
pub fn object() -> ExportedObject {
    ExportedObject::Region("kv".into())
}

/// One side's options: a certificate called `name` from `pki`, admitting `peers` by name.
pub fn options(pki: &Pki, name: &str, peers: &[&str]) -> TlsOptions {
    let leaf = issue(pki, name);
    let identity = TlsIdentity::from_pem(leaf.cert_pem.as_bytes(), leaf.key_pem.as_bytes())
        .expect("a test identity");
    TlsOptions::new(identity, vec![pki.ca_der()], allow(peers))
        .expect("test options")
        .handshake_timeout(MESSAGE)
}

/// Options from PEM files in `dir` (`<name>.pem`, `<name>.key`, `ca.pem`), for a child.
pub fn options_from(dir: &Path, name: &str, peers: &[&str]) -> TlsOptions {
    TlsOptions::from_pem_files(
        dir.join(format!("{name}.pem")),
        dir.join(format!("{name}.key")),
        dir.join("ca.pem"),
        allow(peers),
    )
    .expect("options from files")
    .handshake_timeout(MESSAGE)
}

fn allow(peers: &[&str]) -> PeerCheck {
    PeerCheck::names(peers.iter().map(|p| dns_name(p))).expect("allowed names")
}

/// A fetcher with a certificate called `name` from `pki`.
pub fn fetcher(pki: &Pki, name: &str) -> Fetcher {
    // The allow-list is each locator's; this one is replaced.
    Fetcher::new(options(pki, name, &["nobody"]), MESSAGE)
}

/// An exporter called `name` serving on `bind`, admitting `importers`.
pub fn server(options: &TlsOptions, bind: SocketAddr) -> ExportServer {
    ExportServer::bind(bind, options, MESSAGE).expect("serve")
}

/// The locator of `object()` at `generation`, served at `addr` by the exporter called
/// `exporter` (owner `owner`).
pub fn locator_at(owner: &str, exporter: &str, addr: SocketAddr, generation: u64) -> Locator {
    Locator {
        owner: owner.into(),
        exporter_addr: addr,
        exporter_name: dns_name(exporter),
        object: object(),
        size: SIZE as u64,
        device_uuid: None,
        handle: HandleKind::HostMemfd,
        generation,
    }
}

/// Fetch `locator`, import the stand-in, check the exporter's pattern, write ours and
/// acknowledge: the importer's whole side.
pub fn fetch_and_import(
    fetcher: &Fetcher,
    locator: &Locator,
) -> Result<(), vmm_registry::FetchError> {
    let fetched = fetcher.fetch(locator)?;
    let buf = super::stand_in::import(fetched.descriptor()).expect("map the stand-in");
    assert_eq!(
        buf.to_vec(),
        vmm_tests::pattern(1, SIZE),
        "the exporter's pattern"
    );
    buf.write_at(0, &vmm_tests::pattern(2, SIZE))
        .expect("write ours");
    fetched.acknowledge()
}

/// Offer `descriptor` as `object()` at `generation`.
pub fn offer(server: &ExportServer, generation: u64, descriptor: FabricDescriptor) {
    server.offer(object(), generation, descriptor);
}

/// Set in an exporter child: `<etcd endpoint> <material directory> <bind address>`.
pub const CHILD_ENV: &str = "VMM_REGISTRY_TEST_HANDOFF_EXPORTER";

/// The exporter child's body, run where [`CHILD_ENV`] is set (a no-op elsewhere): open the
/// registry as `exporter` (TTL 2 s), export the stand-in, serve it to `importer` only,
/// publish its locator, print `published`, then one line per hand-off
/// (`acknowledged pattern-2` once the importer's write is in the memory), until killed.
pub fn exporter_child() {
    use std::time::Instant;
    use vmm_registry::{Outcome, Registry, RegistryConfig, TlsMaterial};

    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    let parts: Vec<&str> = spec.split(' ').collect();
    let [endpoint, dir, bind] = parts[..] else {
        panic!("{CHILD_ENV}: <endpoint> <dir> <bind>");
    };
    let dir = Path::new(dir);
    let read = |file: &str| std::fs::read(dir.join(file)).expect("read material");
    let material = TlsMaterial::from_pem(
        read("ca.pem"),
        read("exporter.pem"),
        read("exporter.key"),
        dns_name(super::SERVER),
    );
    let config = RegistryConfig::new([endpoint], material, super::DOMAIN, "exporter")
        .lease_ttl(Duration::from_secs(2));
    let registry = Registry::open(config).expect("the child opens the registry");
    let (buf, descriptor, _fd) = super::stand_in::export(SIZE);
    let server = server(
        &options_from(dir, "exporter", &["importer"]),
        bind.parse().expect("a bind address"),
    );
    offer(&server, 1, descriptor);
    registry
        .publish(
            "kv",
            &locator_at("exporter", "exporter", server.local_addr(), 1),
        )
        .expect("the child publishes");
    println!("published");
    let until = Instant::now() + Duration::from_secs(60);
    while Instant::now() < until {
        match server.next_served(Duration::from_millis(100)) {
            Some(served) if matches!(served.outcome, Outcome::Acknowledged) => {
                let seen = buf.to_vec() == vmm_tests::pattern(2, SIZE);
                println!(
                    "acknowledged {}",
                    if seen { "pattern-2" } else { "NOT-pattern-2" }
                );
            }
            Some(served) => println!("served {:?}", served.outcome),
            None => {}
        }
    }
    panic!("the exporter child was not killed");
}

/// The lines a child prints.
pub type ChildLines = std::io::Lines<std::io::BufReader<std::process::ChildStdout>>;

/// The exporter child started by `command` (the test binary, or a wrapper that runs it),
/// with its material in `dir` (`exporter.pem`, `exporter.key`, `ca.pem`), publishing through
/// `endpoint` and serving on `bind`; returned once it printed `published`, with its stdout's
/// lines.
pub fn start_exporter(
    mut command: std::process::Command,
    dir: &Path,
    endpoint: &str,
    bind: SocketAddr,
) -> (std::process::Child, ChildLines) {
    use std::io::BufRead;
    let mut child = command
        .args([
            "--exact",
            "exporter_child",
            "--nocapture",
            "--test-threads=1",
            "-q",
        ])
        .env(CHILD_ENV, format!("{endpoint} {} {bind}", dir.display()))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit())
        .spawn()
        .expect("start the exporter child");
    let mut lines = std::io::BufReader::new(child.stdout.take().expect("its stdout")).lines();
    let published = lines
        .by_ref()
        .map_while(Result::ok)
        .any(|line| line.trim() == "published");
    assert!(published, "the exporter child ended without publishing");
    (child, lines)
}

/// The next line of the child's that starts with `prefix`, or a panic.
pub fn expect_line(lines: &mut ChildLines, prefix: &str) -> String {
    lines
        .map_while(Result::ok)
        .find(|line| line.starts_with(prefix))
        .unwrap_or_else(|| panic!("the exporter child never said {prefix:?}"))
}

/// Set in an importer child: `<etcd endpoint> <material directory>`.
pub const IMPORTER_ENV: &str = "VMM_REGISTRY_TEST_HANDOFF_IMPORTER";

/// The importer child's body, run where [`IMPORTER_ENV`] is set (a no-op elsewhere): open the
/// registry as `importer`, resolve `exporter`'s `kv` (waiting up to 10 s for it), fetch it
/// over mutual TLS, map the stand-in, check the exporter's pattern, write ours, acknowledge,
/// and print `imported from <exporter address>`.
pub fn importer_child() {
    use std::time::Instant;
    use vmm_registry::{Registry, RegistryConfig, TlsMaterial};

    let Ok(spec) = std::env::var(IMPORTER_ENV) else {
        return;
    };
    let parts: Vec<&str> = spec.split(' ').collect();
    let [endpoint, dir] = parts[..] else {
        panic!("{IMPORTER_ENV}: <endpoint> <dir>");
    };
    let dir = Path::new(dir);
    let read = |file: &str| std::fs::read(dir.join(file)).expect("read material");
    let material = TlsMaterial::from_pem(
        read("ca.pem"),
        read("importer.pem"),
        read("importer.key"),
        dns_name(super::SERVER),
    );
    let config = RegistryConfig::new([endpoint], material, super::DOMAIN, "importer")
        .lease_ttl(Duration::from_secs(2));
    let registry = Registry::open(config).expect("the importer opens the registry");
    let deadline = Instant::now() + Duration::from_secs(10);
    let entry = loop {
        if let Some(entry) = registry.resolve("exporter", "kv").expect("resolve") {
            break entry;
        }
        assert!(
            Instant::now() < deadline,
            "the exporter's locator never came"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let fetcher = Fetcher::new(options_from(dir, "importer", &["nobody"]), MESSAGE);
    fetch_and_import(&fetcher, &entry.locator).expect("fetch, import, acknowledge");
    println!("imported from {}", entry.locator.exporter_addr);
}
