//! Hand a GPU buffer to a process vmm-core did not start, over TCP with mutual TLS, as
//! peer-protocol messages (docs/protocol.md, version 2: a `CUDA_FABRIC` message on a byte
//! stream), to a Rust or a Python peer, in either direction.
//!
//! ```sh
//! cargo run -p vmm-core --features tls --example fabric_tcp                  # Rust -> Rust
//! cargo run -p vmm-core --features tls --example fabric_tcp -- --peer python # Rust -> Python
//! cargo run -p vmm-core --features tls --example fabric_tcp -- --python-exports # Python -> Rust
//! # with certificates of your own instead of the demo's (see "Certificates" below):
//! cargo run -p vmm-core --features tls --example fabric_tcp -- --certs DIR
//! ```
//!
//! The exporter allocates a buffer with `HandleType::Fabric`, fills it and listens on
//! 127.0.0.1 ([`TlsListener`]); the importer connects ([`TlsConnector`]). Each checks the other's
//! certificate in the TLS handshake by the trust rules of `docs/security.md`: the chain ends at
//! the demo's CA, it is valid now, it has the key usages of its role (`digitalSignature`, and
//! the extended key usage), it is no CA, and it names the peer expected
//! (`importer.vmm.example` / `exporter.vmm.example`). Only then does the exporter write the
//! `FabricDescriptor` ([`StreamWriter::write_descriptor`]); the importer reads it
//! ([`StreamReader::read_message`]: the header is checked before anything more is read, the
//! whole message within a deadline), imports it, checks the pattern, writes its own and
//! replies with a `DATA` message. The exporter keeps its buffer until that reply: a fabric
//! handle does not keep the memory alive.
//!
//! Why TLS even on loopback: a fabric handle is a bearer token (whoever holds its 64 bytes and
//! an IMEX channel maps the memory read-write), and a TCP port, loopback included, is open to
//! every user of the machine: whoever connects first to a plain listener gets the handle. A
//! connector without a certificate the exporter admits gets a TLS alert and nothing else.
//!
//! Certificates: without `--certs`, the demo makes a CA and the two leaves at run time (rcgen,
//! valid for a day) in a fresh 0700 directory. With `--certs DIR`, DIR holds `ca.pem` (the
//! CA both sides trust), `exporter.pem`/`exporter.key` (SAN `exporter.vmm.example`,
//! digitalSignature, serverAuth) and `importer.pem`/`importer.key` (SAN
//! `importer.vmm.example`, digitalSignature, clientAuth), PEM;
//! `--exporter-name` and `--importer-name` change the names expected.
//!
//! The Python side (`examples/python/fabric_tls.py`, found from the current directory, or
//! `--python-script PATH`) uses `python/vmm_ipc_peer/`'s TLS (the standard library's `ssl`)
//! and `python/vmm_ipc_cuda.py` (cuda.bindings).
//!
//! Needs a GPU with fabric support and an IMEX channel; without them it prints one
//! `SKIP fabric_tcp: <reason>` line and exits 0 (`VMM_REQUIRE_GPU=1` makes that a failure).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::Duration;

use vmm_core::cuda::{
    Device, HandleType, ResourceOptions, VirtualMemoryBuffer, VirtualMemoryResource,
    fabric_availability,
};
use vmm_core::peer::PeerMessage;
use vmm_core::peer::stream::{StreamReader, StreamWriter};
use vmm_core::wire::tls::{PeerCheck, TlsConnector, TlsListener, TlsOptions};

const WAIT: Duration = Duration::from_secs(60);
const SIZE: usize = 4 << 20;

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| seed.wrapping_add((i % 251) as u8))
        .collect()
}

fn contents(buf: &VirtualMemoryBuffer) -> vmm_core::Result<Vec<u8>> {
    let mut out = vec![0u8; buf.size()];
    buf.read_at(0, &mut out)?;
    Ok(out)
}

type Failure = Box<dyn std::error::Error>;

/// What the command line asked for.
#[derive(Debug)]
struct Args {
    role: Role,
    certs: Option<PathBuf>,
    exporter_name: String,
    importer_name: String,
    python_script: PathBuf,
}

#[derive(Debug, PartialEq, Eq)]
enum Role {
    /// Export, to a Rust or Python importer this process starts.
    Send { python: bool },
    /// Import from a Python exporter this process starts.
    ImportFromPython,
    /// Import from the exporter at this address (the Rust importer this example starts).
    Receive(SocketAddr),
}

const USAGE: &str = "usage: fabric_tcp [--peer rust|python | --python-exports] [--certs DIR] \
    [--exporter-name NAME] [--importer-name NAME] [--python-script PATH]\n       \
    fabric_tcp receive ADDR --certs DIR [--exporter-name NAME] [--importer-name NAME]";

fn parse(argv: &[String]) -> Result<Args, Failure> {
    let mut args = Args {
        role: Role::Send { python: false },
        certs: None,
        exporter_name: "exporter.vmm.example".into(),
        importer_name: "importer.vmm.example".into(),
        python_script: PathBuf::from("examples/python/fabric_tls.py"),
    };
    let mut rest = argv.iter();
    while let Some(arg) = rest.next() {
        let mut value = |flag: &str| {
            rest.next()
                .cloned()
                .ok_or_else(|| format!("{flag} needs a value\n{USAGE}"))
        };
        match arg.as_str() {
            "receive" => args.role = Role::Receive(value("receive")?.parse()?),
            "--peer" => match value("--peer")?.as_str() {
                "rust" => args.role = Role::Send { python: false },
                "python" => args.role = Role::Send { python: true },
                other => return Err(format!("--peer {other}: rust or python\n{USAGE}").into()),
            },
            "--python-exports" => args.role = Role::ImportFromPython,
            "--certs" => args.certs = Some(value("--certs")?.into()),
            "--exporter-name" => args.exporter_name = value("--exporter-name")?,
            "--importer-name" => args.importer_name = value("--importer-name")?,
            "--python-script" => args.python_script = value("--python-script")?.into(),
            "-h" | "--help" => return Err(USAGE.into()),
            other => return Err(format!("unknown argument {other:?}\n{USAGE}").into()),
        }
    }
    if matches!(args.role, Role::Receive(_)) && args.certs.is_none() {
        return Err(format!("receive needs --certs DIR\n{USAGE}").into());
    }
    Ok(args)
}

fn main() -> ExitCode {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let args = match parse(&argv) {
        Ok(args) => args,
        Err(e) => {
            eprintln!("fabric_tcp: {e}");
            return ExitCode::from(2);
        }
    };
    if let Err(reason) = fabric_availability() {
        eprintln!("SKIP fabric_tcp: {reason}");
        return if std::env::var_os("VMM_REQUIRE_GPU").is_some_and(|v| v == "1") {
            ExitCode::FAILURE
        } else {
            ExitCode::SUCCESS
        };
    }
    let result = run(&args);
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("fabric_tcp: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> Result<(), Failure> {
    // The demo's certificates live as long as this process (the directory is removed on drop).
    let made;
    let certs = match &args.certs {
        Some(dir) => dir.clone(),
        None => {
            made = demo_certs::make(&args.exporter_name, &args.importer_name)?;
            made.path().to_owned()
        }
    };
    match args.role {
        Role::Send { python } => send(args, &certs, python),
        Role::ImportFromPython => import_from_python(args, &certs),
        Role::Receive(addr) => receive(args, &certs, addr),
    }
}

fn exporter_options(args: &Args, certs: &Path) -> Result<TlsOptions, Failure> {
    Ok(TlsOptions::from_pem_files(
        certs.join("exporter.pem"),
        certs.join("exporter.key"),
        certs.join("ca.pem"),
        PeerCheck::names([args.importer_name.as_str()])?,
    )?)
}

fn importer_options(args: &Args, certs: &Path) -> Result<TlsOptions, Failure> {
    Ok(TlsOptions::from_pem_files(
        certs.join("importer.pem"),
        certs.join("importer.key"),
        certs.join("ca.pem"),
        PeerCheck::names([args.exporter_name.as_str()])?,
    )?)
}

fn python(args: &Args, certs: &Path, verb: &str, addr: &str) -> Result<Child, Failure> {
    let child = Command::new("python3")
        .arg(&args.python_script)
        .args([verb, addr])
        .arg(certs)
        .args([&args.exporter_name, &args.importer_name])
        .env("PYTHONPATH", "python")
        .env("PYTHONUNBUFFERED", "1")
        // The exporter's first line says where it listens; the importer's lines pass through.
        .stdout(if verb == "export" {
            Stdio::piped()
        } else {
            Stdio::inherit()
        })
        .spawn()
        .map_err(|e| format!("starting python3 {}: {e}", args.python_script.display()))?;
    Ok(child)
}

fn send(args: &Args, certs: &Path, to_python: bool) -> Result<(), Failure> {
    let device = Device::new(0)?;
    let resource = VirtualMemoryResource::new(
        &device,
        ResourceOptions::default().handle_type(HandleType::Fabric),
    )?;
    let buf = resource.allocate(SIZE)?;
    buf.write_at(0, &pattern(1, buf.size()))?;

    let listener = TlsListener::bind("127.0.0.1:0", &exporter_options(args, certs)?)?;
    let addr = listener.local_addr()?.to_string();
    let mut receiver = if to_python {
        python(args, certs, "import", &addr)?
    } else {
        let mut command = Command::new(std::env::current_exe()?);
        command.args(["receive", &addr, "--certs"]).arg(certs);
        command.args(["--exporter-name", &args.exporter_name]);
        command.args(["--importer-name", &args.importer_name]);
        command.spawn()?
    };
    // Only a connector whose certificate passed every check comes out of accept.
    let mut stream = accept_from(&listener, &mut receiver)?;
    let descriptor = buf.export_fabric()?;
    println!("exporter: {descriptor:?}"); // Debug prints no handle byte
    StreamWriter::new(&mut stream).write_descriptor(&descriptor)?;
    let reply = match StreamReader::new(&mut stream)
        .with_timeout(Some(WAIT))
        .read_message()?
    {
        PeerMessage::Data(reply) => String::from_utf8_lossy(&reply).into_owned(),
        PeerMessage::Descriptor(d) => {
            return Err(format!("the importer sent a descriptor ({d:?}), not a reply").into());
        }
    };
    let status = receiver.wait()?;
    if !status.success() {
        return Err(format!("the importer failed ({status})").into());
    }
    println!("exporter: the importer replied {reply:?}");
    for refused in listener.refused() {
        println!("exporter: refused {refused:?}");
    }
    // Only now may the buffer go: the importer has imported it.
    if contents(&buf)? != pattern(2, buf.size()) {
        return Err("the importer's write is not in the buffer".into());
    }
    println!("exporter: the importer's write is in the buffer");
    Ok(())
}

/// The importer's stream, once it connected with a certificate that passed; an error as soon
/// as the importer process has ended without connecting, or after [`WAIT`].
fn accept_from(
    listener: &TlsListener,
    importer: &mut Child,
) -> Result<vmm_core::wire::tls::TlsStream, Failure> {
    let started = std::time::Instant::now();
    loop {
        match listener.accept(Some(Duration::from_millis(200))) {
            Ok(stream) => return Ok(stream),
            Err(vmm_core::Error::Timeout { .. }) if started.elapsed() < WAIT => {
                if let Some(status) = importer.try_wait()? {
                    return Err(format!("the importer ended ({status}) before it connected").into());
                }
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// Import on `stream`'s peer's word, check its pattern, write ours, reply.
fn import_and_reply(mut stream: vmm_core::wire::tls::TlsStream) -> Result<(), Failure> {
    let descriptor = match StreamReader::new(&mut stream)
        .with_timeout(Some(WAIT))
        .read_message()?
    {
        PeerMessage::Descriptor(d) => d.into_fabric()?,
        PeerMessage::Data(bytes) => {
            return Err(format!("expected a descriptor, got {} bytes of DATA", bytes.len()).into());
        }
    };
    let buf = VirtualMemoryBuffer::import_fabric(&descriptor)?;
    let matched = contents(&buf)? == pattern(1, buf.size());
    buf.write_at(0, &pattern(2, buf.size()))?;
    let reply = if matched {
        "imported, pattern matched"
    } else {
        "imported, pattern NOT matched"
    };
    StreamWriter::new(&mut stream).write_data(reply.as_bytes())?;
    if !matched {
        return Err("the exporter's pattern is not in the buffer".into());
    }
    println!("importer: imported {} bytes, pattern matched", buf.size());
    Ok(())
}

fn receive(args: &Args, certs: &Path, addr: SocketAddr) -> Result<(), Failure> {
    let stream = TlsConnector::new(&importer_options(args, certs)?)?.connect(addr)?;
    import_and_reply(stream)
}

fn import_from_python(args: &Args, certs: &Path) -> Result<(), Failure> {
    use std::io::{BufRead, BufReader};
    let mut exporter = python(args, certs, "export", "127.0.0.1:0")?;
    // The Python exporter prints `LISTENING <port>` once it listens.
    let stdout = exporter
        .stdout
        .take()
        .ok_or("no stdout from the Python exporter")?;
    let mut lines = BufReader::new(stdout).lines();
    let port: u16 = loop {
        match lines.next() {
            Some(line) => {
                let line = line?;
                println!("python: {line}");
                if let Some(port) = line.strip_prefix("LISTENING ") {
                    break port.trim().parse()?;
                }
            }
            None => return Err("the Python exporter ended before it listened".into()),
        }
    };
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let stream = TlsConnector::new(&importer_options(args, certs)?)?.connect(addr)?;
    import_and_reply(stream)?;
    for line in lines {
        println!("python: {}", line?);
    }
    let status = exporter.wait()?;
    if !status.success() {
        return Err(format!("the Python exporter failed ({status})").into());
    }
    Ok(())
}

/// The demo's certificates, made at run time.
mod demo_certs {
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    use std::path::{Path, PathBuf};

    use rcgen::{
        BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose,
        IsCa, KeyPair, KeyUsagePurpose,
    };
    use time::{Duration, OffsetDateTime};

    /// A 0700 directory removed when dropped.
    pub struct Dir(PathBuf);

    impl Dir {
        pub fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn write(dir: &Path, name: &str, text: &str) -> std::io::Result<()> {
        use std::io::Write;
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(dir.join(name))?
            .write_all(text.as_bytes())
    }

    /// A CA and two leaves (valid from an hour ago for a day) in a new directory.
    pub fn make(exporter: &str, importer: &str) -> Result<Dir, Box<dyn std::error::Error>> {
        let path = std::env::temp_dir().join(format!("vmm-fabric-tls-{}", std::process::id()));
        std::fs::DirBuilder::new().mode(0o700).create(&path)?;
        let dir = Dir(path);
        let now = OffsetDateTime::now_utc();
        let mut ca = CertificateParams::new(Vec::<String>::new())?;
        ca.distinguished_name
            .push(DnType::CommonName, "vmm-ipc fabric_tcp demo CA");
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        ca.not_before = now - Duration::hours(1);
        ca.not_after = now + Duration::days(1);
        let ca = CertifiedIssuer::self_signed(ca, KeyPair::generate()?)?;
        write(dir.path(), "ca.pem", &ca.pem())?;
        for (file, name, usage) in [
            ("exporter", exporter, ExtendedKeyUsagePurpose::ServerAuth),
            ("importer", importer, ExtendedKeyUsagePurpose::ClientAuth),
        ] {
            let key = KeyPair::generate()?;
            let mut params = CertificateParams::new(vec![name.to_owned()])?;
            params.distinguished_name.push(DnType::CommonName, name);
            // The trust rules (docs/security.md) of both peers: a leaf signs with its key
            // (`digitalSignature`) and is used for its role only.
            params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
            params.extended_key_usages = vec![usage];
            // Strict X.509 checkers (Python's `ssl` as vmm_ipc_peer sets it) require the
            // authority key identifier.
            params.use_authority_key_identifier_extension = true;
            params.not_before = now - Duration::hours(1);
            params.not_after = now + Duration::days(1);
            let cert = params.signed_by(&key, &ca)?;
            write(dir.path(), &format!("{file}.pem"), &cert.pem())?;
            write(dir.path(), &format!("{file}.key"), &key.serialize_pem())?;
        }
        Ok(dir)
    }
}
