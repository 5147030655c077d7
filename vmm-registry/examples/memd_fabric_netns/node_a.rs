//! Node A, all in the first network namespace: the memory service (`vmm-memd`, which starts
//! its keeper), a writer that commits a generation of the region, and the publisher
//! (`vmm-memd-publish`). The programs are this executable: started with `PROGRAM_VAR` set, the
//! pre-`main` hook of `tests/support/memd.rs` plays them (the keeper inherits the variable).
//! The service listens on an abstract socket, which belongs to the namespace: its clients
//! (writer, publisher, this process's readiness check) connect from inside it.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use vmm_core::cuda::Device;
use vmm_core::wire::endpoint::Name;
use vmm_memd::protocol::Backend;
use vmm_memd::{BeginOptions, Client, MemdError};
use vmm_tests::pki::dns_name;

use crate::child::{Child, Failure, Spec, check_interrupted};
use crate::memd::PROGRAM_VAR;
use crate::region::{CHUNK, CHUNKS, Committed, Mode, REGION, chunk_bytes, tensors};
use crate::support::netns::{TwoNodes, within};
use crate::support::{DOMAIN, SERVER};

/// The publisher's certificate name: its etcd user, the owner it publishes under, and (as
/// `<name>.vmm.test`) the exporter name importers check.
pub const OWNER: &str = "node-a";

/// The importer's certificate name, the one the publisher admits.
pub const ENGINE: &str = "engine-b";

/// `program` (this executable playing it) in namespace `netns`.
fn program(netns: &str, exe: &Path, program: &str) -> Command {
    let mut command = TwoNodes::command(netns, exe);
    command.env(PROGRAM_VAR, program).env(
        "VMM_MEMD_LOG",
        std::env::var("VMM_MEMD_LOG").unwrap_or_else(|_| "warn".into()),
    );
    command
}

/// The running service.
#[derive(Debug)]
pub struct Service {
    child: Child,
    netns: String,
    exe: PathBuf,
    pub socket: String,
}

impl Service {
    /// Start it in `netns`; how long until it accepted a client.
    pub fn start(netns: &str, exe: &Path) -> Result<(Service, Duration), Failure> {
        let socket = format!("@vmm-memd-fabric-netns-{}", std::process::id());
        let mut service = Service {
            child: Service::spawn(netns, exe, &socket)?,
            netns: netns.to_owned(),
            exe: exe.to_owned(),
            socket,
        };
        let up = service.wait_up()?;
        Ok((service, up))
    }

    fn spawn(netns: &str, exe: &Path, socket: &str) -> Result<Child, Failure> {
        let mut command = program(netns, exe, "vmm-memd");
        // A keeper left alone (the service SIGKILLed and never started again) lets the
        // memory go 20 s later; the run's end sweeps the namespace sooner.
        command
            .args(["--socket", socket, "--quota-bytes", "1073741824"])
            .args(["--keeper-linger-ms", "20000"]);
        Child::spawn(Spec::new("vmm-memd"), command)
    }

    /// Until a client connects from inside the namespace (10 s at most).
    fn wait_up(&mut self) -> Result<Duration, Failure> {
        let started = Instant::now();
        let name = Name::from(self.socket.as_str());
        loop {
            let connected = within(&self.netns, || match Client::connect(&name) {
                Ok(_) => Ok(true),
                Err(MemdError::ServiceGone(_)) => Ok(false),
                Err(e) => Err(e.to_string()),
            })?;
            if connected {
                return Ok(started.elapsed());
            }
            if let Ok(status) = self.child.wait(Duration::ZERO) {
                return Err(format!("vmm-memd exited at start ({status})").into());
            }
            if started.elapsed() > Duration::from_secs(10) {
                return Err("vmm-memd did not accept a client within 10 s".into());
            }
            check_interrupted()?;
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// SIGKILL it (its keeper keeps the committed generations) and reap it.
    pub fn kill(&mut self) -> Result<(), Failure> {
        self.child.kill()
    }

    /// Start it again on the same socket; how long until it accepted a client.
    pub fn restart(&mut self) -> Result<Duration, Failure> {
        self.child = Service::spawn(&self.netns, &self.exe, &self.socket)?;
        self.wait_up()
    }
}

/// Commit generation N+1 of the region written with `seed` (a writer child in `netns`).
pub fn write(
    netns: &str,
    exe: &Path,
    service: &Service,
    mode: Mode,
    seed: u8,
) -> Result<Committed, Failure> {
    let mut command = TwoNodes::command(netns, exe);
    command.args(["writer", &service.socket, mode.as_str(), &seed.to_string()]);
    let mut writer = Child::spawn(
        Spec {
            stop: nix::sys::signal::Signal::SIGKILL,
            ..Spec::new("writer")
        },
        command,
    )?;
    let line = writer.expect("committed ", Duration::from_secs(60))?;
    let status = writer.wait(Duration::from_secs(10))?;
    if !status.success() {
        return Err(format!("the writer failed ({status})").into());
    }
    let words: Vec<&str> = line.split_whitespace().skip(1).collect();
    Committed::parse(&words)
}

/// The writer's body (`writer SOCKET MODE SEED`): begin the region on device 0 (or in host
/// memory), fill each chunk through the writer's own mapping, put the tensors, commit, and
/// print `committed G SEED SIZES DEVICE`.
pub fn writer(socket: &str, mode: Mode, seed: u8) -> Result<(), Failure> {
    let client = Client::connect(&Name::from(socket))?;
    let committed = match mode {
        Mode::Gpu => write_gpu(&client, seed)?,
        Mode::Host => write_host(&client, seed)?,
    };
    println!("committed {}", committed.words());
    Ok(())
}

fn write_gpu(client: &Client, seed: u8) -> Result<Committed, Failure> {
    let device = Device::new(0)?;
    let options = BeginOptions {
        backend: Backend::Gpu {
            uuid: *device.uuid(),
        },
        ..BeginOptions::default()
    };
    let mut writer = client.begin(REGION, &[CHUNK; CHUNKS], options)?;
    let gpu = writer.gpu().ok_or("the service made no GPU chunks")?;
    if !gpu.fabric() {
        return Err("the service's chunks are not fabric-shareable (an IMEX channel?)".into());
    }
    let sizes = gpu.chunk_sizes().to_vec();
    for (i, &len) in sizes.iter().enumerate() {
        let offset = gpu.chunk_offset(i).ok_or("a chunk without an offset")?;
        gpu.buffer().write_at(
            usize::try_from(offset)?,
            &chunk_bytes(seed, i, usize::try_from(len)?),
        )?;
    }
    for (key, meta) in tensors() {
        writer.put(key, meta);
    }
    Ok(Committed {
        generation: writer.commit()?,
        seed,
        sizes,
        device: Some(vmm_registry::gpu_uuid(device.uuid())),
    })
}

fn write_host(client: &Client, seed: u8) -> Result<Committed, Failure> {
    let mut writer = client.begin(REGION, &[CHUNK; CHUNKS], BeginOptions::default())?;
    for i in 0..CHUNKS {
        writer
            .chunk(i)
            .write_at(0, &chunk_bytes(seed, i, usize::try_from(CHUNK)?))?;
    }
    for (key, meta) in tensors() {
        writer.put(key, meta);
    }
    Ok(Committed {
        generation: writer.commit()?,
        seed,
        sizes: vec![CHUNK; CHUNKS],
        device: None,
    })
}

/// Start the publisher of `service`'s region in `netns`: etcd at `endpoint` over mutual TLS
/// with its own certificate (`OWNER`, from `dir`), listening for importers on `listen`
/// (the namespace's veth address), admitting only `ENGINE`; returned once it listens.
pub fn start_publisher(
    netns: &str,
    exe: &Path,
    service: &Service,
    endpoint: &str,
    dir: &Path,
    listen: IpAddr,
) -> Result<Child, Failure> {
    let file = |name: String| dir.join(name).display().to_string();
    let mut command = program(netns, exe, "vmm-memd-publish");
    command
        .args(["--socket", &service.socket])
        .args(["--etcd", endpoint])
        .args(["--ca", &file("ca.pem".into())])
        .args(["--cert", &file(format!("{OWNER}.pem"))])
        .args(["--key", &file(format!("{OWNER}.key"))])
        .args(["--etcd-name", &dns_name(SERVER)])
        .args(["--domain", DOMAIN, "--owner", OWNER])
        .args(["--exporter-name", &dns_name(OWNER)])
        .args(["--admit", &dns_name(ENGINE)])
        .args(["--listen", &SocketAddr::new(listen, 0).to_string()])
        .args(["--region", REGION, "--poll-ms", "100"])
        .args(["--lease-ttl-s", "5", "--reconnect-ms", "30000"]);
    let mut publisher = Child::spawn(Spec::new("publisher"), command)?;
    publisher.expect("listening ", Duration::from_secs(20))?;
    Ok(publisher)
}
