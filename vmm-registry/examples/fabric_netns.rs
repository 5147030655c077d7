//! A fabric export in one network namespace, found through the registry and imported in
//! another (issue 27, item 8, "on the H200"): the GPU run of `tests/netns.rs`.
//!
//! ```sh
//! sudo cargo run -p vmm-registry --example fabric_netns
//! ```
//!
//! It makes two network namespaces joined by a veth pair (10.250.x.1 and .2), runs etcd (mutual
//! TLS, client certificates) in the first on its address, and re-executes itself twice:
//!
//! - `exporter` in the first namespace allocates a buffer with `HandleType::Fabric` on device
//!   0, fills it, offers its fabric descriptor on an [`ExportServer`] (admitting only the
//!   importer's certificate name), and publishes its locator (address, certificate name, size,
//!   device UUID, `HandleKind::Fabric`, generation 1);
//! - `importer` in the second resolves the locator through etcd, fetches the descriptor over
//!   mutual TLS across the veth ([`Fetcher`]: it admits only the locator's exporter name, and
//!   checks the size and device UUID), imports it (`VirtualMemoryBuffer::import_fabric`),
//!   checks the exporter's pattern, writes its own, and acknowledges;
//! - the exporter checks the importer's pattern in its buffer.
//!
//! The namespaces are removed at the end, also on failure. Certificates are made at run time
//! (`vmm_tests::pki`). Needs a GPU with fabric support and an IMEX channel, root, `ip`
//! (iproute2) and etcd (`$VMM_ETCD_BIN` or on the `PATH`); without one of them it prints one
//! `SKIP fabric_netns: <reason>` line and exits 0 (`VMM_REQUIRE_GPU=1` makes that a failure).

#[path = "../tests/support/mod.rs"]
mod support;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{ExitCode, Stdio};
use std::time::{Duration, Instant};

use vmm_core::cuda::{
    Device, HandleType, ResourceOptions, VirtualMemoryBuffer, VirtualMemoryResource,
    fabric_availability,
};
use vmm_registry::{
    ExportServer, ExportedObject, Fetcher, HandleKind, Locator, Outcome, Registry, RegistryConfig,
    TlsMaterial,
};
use vmm_tests::pattern;
use vmm_tests::pki::{Pki, dns_name};

use support::etcd::{Etcd, TempDir, etcd_binary};
use support::handoff::options_from;
use support::netns::{KillOnDrop, TwoNodes};
use support::{DOMAIN, SERVER, etcd_tls, write_material};

const SIZE: usize = 4 << 20;
const WAIT: Duration = Duration::from_secs(60);

type Failure = Box<dyn std::error::Error>;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.iter().map(String::as_str).collect::<Vec<_>>()[..] {
        ["exporter", endpoint, dir, bind] => exporter(endpoint, Path::new(dir), bind),
        ["importer", endpoint, dir] => importer(endpoint, Path::new(dir)),
        [] => match prepare() {
            Ok(nodes) => orchestrate(&nodes),
            Err(reason) => return skip(&reason),
        },
        _ => Err("usage: fabric_netns (no arguments; the roles are its own children)".into()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("fabric_netns: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The two namespaces, or why this machine cannot run it.
fn prepare() -> Result<TwoNodes, String> {
    fabric_availability().map_err(|reason| reason.to_string())?;
    if etcd_binary().is_none() {
        return Err("etcd is not installed (apt-get install etcd-server)".into());
    }
    TwoNodes::make()
}

/// One SKIP line; a failure under `VMM_REQUIRE_GPU=1`.
fn skip(reason: &str) -> ExitCode {
    println!("SKIP fabric_netns: {reason}");
    if std::env::var_os("VMM_REQUIRE_GPU").is_some_and(|v| v == "1") {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

/// Run etcd and the two roles in `nodes`; the namespaces are the caller's to remove.
fn orchestrate(nodes: &TwoNodes) -> Result<(), Failure> {
    let pki = Pki::new("fabric-netns");
    let dir = TempDir::new("fabric-netns");
    let binary = etcd_binary().ok_or("etcd went away")?;
    let etcd = Etcd::start_in(&binary, etcd_tls(&pki, &dir), &nodes.a, nodes.addr_a.into());
    let endpoint = etcd.endpoint();
    write_material(&pki, &dir.0, "exporter");
    write_material(&pki, &dir.0, "importer");
    let exe = std::env::current_exe()?;
    let dir_arg = dir.0.display().to_string();
    let bind = SocketAddr::new(nodes.addr_a.into(), 0).to_string();

    let mut exporter = KillOnDrop(
        TwoNodes::command(&nodes.a, &exe)
            .args(["exporter", &endpoint, &dir_arg, &bind])
            .stdout(Stdio::piped())
            .spawn()?,
    );
    let mut lines = BufReader::new(exporter.0.stdout.take().ok_or("no stdout")?).lines();
    let mut said = |what: &str| -> Result<(), Failure> {
        for line in lines.by_ref() {
            let line = line?;
            println!("exporter: {line}");
            if line.starts_with(what) {
                return Ok(());
            }
        }
        Err(format!("the exporter ended before it said {what:?}").into())
    };
    said("published")?;
    let mut importer = KillOnDrop(
        TwoNodes::command(&nodes.b, &exe)
            .args(["importer", &endpoint, &dir_arg])
            .spawn()?,
    );
    let started = Instant::now();
    let status = loop {
        if let Some(status) = importer.0.try_wait()? {
            break status;
        }
        if started.elapsed() > WAIT {
            return Err("the importer did not finish in time".into());
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    if !status.success() {
        return Err(format!("the importer failed ({status})").into());
    }
    said("acknowledged pattern-2")?;
    println!(
        "fabric_netns: {} ({}) -> {} ({}): published, resolved, fetched over mutual TLS, \
         imported, acknowledged",
        nodes.a, nodes.addr_a, nodes.b, nodes.addr_b
    );
    Ok(())
}

/// A registry client called `name`, with its material from `dir`.
fn registry(endpoint: &str, dir: &Path, name: &str) -> Result<Registry, Failure> {
    let read = |file: String| std::fs::read(dir.join(file));
    let material = TlsMaterial::from_pem(
        read("ca.pem".into())?,
        read(format!("{name}.pem"))?,
        read(format!("{name}.key"))?,
        dns_name(SERVER),
    );
    Ok(Registry::open(RegistryConfig::new(
        [endpoint],
        material,
        DOMAIN,
        name,
    ))?)
}

fn contents(buf: &VirtualMemoryBuffer) -> Result<Vec<u8>, Failure> {
    let mut out = vec![0u8; buf.size()];
    buf.read_at(0, &mut out)?;
    Ok(out)
}

fn exporter(endpoint: &str, dir: &Path, bind: &str) -> Result<(), Failure> {
    let device = Device::new(0)?;
    let resource = VirtualMemoryResource::new(
        &device,
        ResourceOptions::default().handle_type(HandleType::Fabric),
    )?;
    let buf = resource.allocate(SIZE)?;
    buf.write_at(0, &pattern(1, buf.size()))?;
    let server = ExportServer::bind(
        bind,
        &options_from(dir, "exporter", &["importer"]),
        Duration::from_secs(30),
    )?;
    let object = ExportedObject::Region("kv".into());
    server.offer(object.clone(), 1, buf.export_fabric()?);
    let registry = registry(endpoint, dir, "exporter")?;
    registry.publish(
        "kv",
        &Locator {
            owner: "exporter".into(),
            exporter_addr: server.local_addr(),
            exporter_name: dns_name("exporter"),
            object,
            size: buf.size() as u64,
            device_uuid: Some(device.uuid_string()),
            handle: HandleKind::Fabric,
            generation: 1,
        },
    )?;
    println!("published at {}", server.local_addr());
    let started = Instant::now();
    while started.elapsed() < WAIT {
        let Some(served) = server.next_served(Duration::from_millis(200)) else {
            continue;
        };
        println!("served {} -> {:?}", served.importer, served.outcome);
        if let Outcome::Acknowledged = served.outcome {
            // Only now may the buffer go: the importer said it imported.
            let seen = contents(&buf)? == pattern(2, buf.size());
            println!(
                "acknowledged {}",
                if seen { "pattern-2" } else { "NOT-pattern-2" }
            );
            return if seen {
                registry.close().map_err(Into::into)
            } else {
                Err("the importer's write is not in the buffer".into())
            };
        }
    }
    Err("no importer acknowledged in time".into())
}

fn importer(endpoint: &str, dir: &Path) -> Result<(), Failure> {
    let registry = registry(endpoint, dir, "importer")?;
    let started = Instant::now();
    let entry = loop {
        if let Some(entry) = registry.resolve("exporter", "kv")? {
            break entry;
        }
        if started.elapsed() > WAIT {
            return Err("the exporter's locator never came".into());
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let fetcher = Fetcher::new(
        options_from(dir, "importer", &["unused"]),
        Duration::from_secs(30),
    );
    let fetched = fetcher.fetch(&entry.locator)?;
    let buf = match VirtualMemoryBuffer::import_fabric(fetched.descriptor()) {
        Ok(buf) => buf,
        Err(e) => {
            let _ = fetched.import_failed();
            return Err(e.into());
        }
    };
    let matched = contents(&buf)? == pattern(1, buf.size());
    buf.write_at(0, &pattern(2, buf.size()))?;
    fetched.acknowledge()?;
    if !matched {
        return Err("the exporter's pattern is not in the imported buffer".into());
    }
    println!(
        "importer: imported {} bytes from {}, pattern matched",
        buf.size(),
        entry.locator.exporter_addr
    );
    Ok(())
}
