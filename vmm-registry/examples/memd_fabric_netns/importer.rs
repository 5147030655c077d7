//! Node B: the importer (`importer ENDPOINT DIR MODE`), in the second network namespace. It
//! opens the registry across the veth as `ENGINE` (mutual TLS), prints `ready`, then answers
//! one request per line on stdin with one line, `ok ...` or `err ...`:
//!
//! - `import G SEED SIZES DEVICE`: resolve the region's locator (until its generation is at
//!   least G), check it (handle kind, size, device UUID, exporter name), fetch the descriptor
//!   from its exporter over mutual TLS (the [`Fetcher`] admits only the locator's exporter
//!   name and checks size and device), check the chunks and the tensor metadata, import it
//!   (`import_fabric`, read-only; the host stand-in in host mode), check every byte and each
//!   tensor's bytes, acknowledge, and keep the mapping: `ok imported G resolve_us=..
//!   fetch_us=.. import_us=.. check_us=..` (microseconds);
//! - `gone MS`: until the locator is gone (MS at most): `ok gone after_us=..`;
//! - `absent MS`: whether a locator appears within MS: `ok absent` or `ok present G`;
//! - `same`: whether the locator is the last one imported: `ok same`, `ok changed G`,
//!   `ok absent`;
//! - `stale G`: fetch the locator of generation G imported before: `ok stale serving=..`,
//!   `ok served`, `ok error ...`;
//! - `reread`: the mapping kept, read again: `ok held intact|differs|unreadable ...`.
//!
//! End of stdin ends it.

use std::io::BufRead;
use std::path::Path;
use std::time::{Duration, Instant};

use vmm_core::cuda::{Device, ResourceOptions, VirtualMemoryBuffer, VirtualMemoryResource};
use vmm_memd::ReadOnlyChunk;
use vmm_registry::memd_publish::region_metadata;
use vmm_registry::{
    FetchError, Fetched, Fetcher, HandleKind, Locator, Registry, RegistryConfig, TlsMaterial,
    host_stand_in,
};
use vmm_tests::pki::dns_name;

use crate::child::Failure;
use crate::node_a::{ENGINE, OWNER};
use crate::region::{Committed, Mode, REGION, expected_tensors};
use crate::support::handoff::options_from;
use crate::support::{DOMAIN, SERVER};

/// What an import keeps mapped.
enum Mapping {
    Gpu(VirtualMemoryBuffer),
    Host(Vec<ReadOnlyChunk>),
}

impl Mapping {
    /// Every byte, chunks back to back.
    fn bytes(&self) -> Result<Vec<u8>, Failure> {
        match self {
            Mapping::Gpu(buffer) => {
                let mut out = vec![0u8; buffer.size()];
                buffer.read_at(0, &mut out)?;
                Ok(out)
            }
            Mapping::Host(chunks) => Ok(chunks
                .iter()
                .flat_map(|c| c.as_slice().iter().copied())
                .collect()),
        }
    }
}

/// The importer's state between requests.
struct Importer {
    registry: Registry,
    fetcher: Fetcher,
    mode: Mode,
    /// Device 0's read-only importer (GPU mode), made at start so that an import's time is
    /// the import's, not CUDA's start.
    resource: Option<VirtualMemoryResource>,
    /// Every locator imported, in order.
    history: Vec<Locator>,
    /// The last import, still mapped.
    held: Option<(Committed, Mapping)>,
}

/// The importer's body.
pub fn importer(endpoint: &str, dir: &Path, mode: Mode) -> Result<(), Failure> {
    let started = Instant::now();
    let read = |file: String| std::fs::read(dir.join(file));
    let material = TlsMaterial::from_pem(
        read("ca.pem".into())?,
        read(format!("{ENGINE}.pem"))?,
        read(format!("{ENGINE}.key"))?,
        dns_name(SERVER),
    );
    let config =
        RegistryConfig::new([endpoint], material, DOMAIN, ENGINE).lease_ttl(Duration::from_secs(5));
    let registry = Registry::open(config)?;
    let open_us = started.elapsed().as_micros();
    let started = Instant::now();
    let resource = match mode {
        Mode::Gpu => Some(VirtualMemoryResource::new(
            &Device::new(0)?,
            ResourceOptions::default().read_only(true),
        )?),
        Mode::Host => None,
    };
    println!(
        "ready registry_open_us={open_us} cuda_us={}",
        started.elapsed().as_micros()
    );
    let mut state = Importer {
        registry,
        fetcher: Fetcher::new(
            options_from(dir, ENGINE, &["unused"]),
            Duration::from_secs(30),
        ),
        mode,
        resource,
        history: Vec::new(),
        held: None,
    };
    for line in std::io::stdin().lock().lines() {
        let line = line?;
        let words: Vec<&str> = line.split_whitespace().collect();
        match state.answer(&words) {
            Ok(answer) => println!("ok {answer}"),
            Err(e) => println!("err {}", one_line(&*e)),
        }
    }
    state.registry.close()?;
    Ok(())
}

/// An error and its sources, on one line.
fn one_line(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text.replace('\n', " ")
}

fn millis(words: &[&str]) -> Result<Duration, Failure> {
    match words {
        [ms] => Ok(Duration::from_millis(ms.parse()?)),
        _ => Err("expected one number of milliseconds".into()),
    }
}

impl Importer {
    fn answer(&mut self, words: &[&str]) -> Result<String, Failure> {
        match words {
            ["import", rest @ ..] => self.import(&Committed::parse(rest)?),
            ["gone", rest @ ..] => self.gone(millis(rest)?),
            ["absent", rest @ ..] => self.absent(millis(rest)?),
            ["same"] => self.same(),
            ["stale", generation] => self.stale(generation.parse()?),
            ["reread"] => self.reread(),
            _ => Err(format!("unknown request {words:?}").into()),
        }
    }

    fn import(&mut self, expected: &Committed) -> Result<String, Failure> {
        let started = Instant::now();
        let deadline = started + Duration::from_secs(30);
        let locator = loop {
            match self.registry.resolve(OWNER, REGION)? {
                Some(entry) if entry.locator.generation >= expected.generation => {
                    break entry.locator;
                }
                _ if Instant::now() > deadline => {
                    return Err(format!(
                        "no locator of generation {} within 30 s",
                        expected.generation
                    )
                    .into());
                }
                _ => std::thread::sleep(Duration::from_millis(20)),
            }
        };
        let resolve_us = started.elapsed().as_micros();
        self.check_locator(&locator, expected)?;

        let started = Instant::now();
        let fetched = self.fetcher.fetch(&locator)?;
        let fetch_us = started.elapsed().as_micros();
        if let Err(e) = check_fetched(&fetched, expected) {
            let _ = fetched.import_failed();
            return Err(e);
        }

        let started = Instant::now();
        let mapping = match self.map(&fetched) {
            Ok(mapping) => mapping,
            Err(e) => {
                let _ = fetched.import_failed();
                return Err(e);
            }
        };
        let import_us = started.elapsed().as_micros();

        let started = Instant::now();
        let checked = check_bytes(&mapping, expected);
        let check_us = started.elapsed().as_micros();
        if let Err(e) = checked {
            let _ = fetched.import_failed();
            return Err(e);
        }
        fetched.acknowledge()?;
        self.history.push(locator);
        self.held = Some((expected.clone(), mapping));
        Ok(format!(
            "imported {} resolve_us={resolve_us} fetch_us={fetch_us} import_us={import_us} \
             check_us={check_us} bytes={}",
            expected.generation,
            expected.size()
        ))
    }

    /// The locator names what the writer committed, where node A's publisher serves it.
    fn check_locator(&self, locator: &Locator, expected: &Committed) -> Result<(), Failure> {
        let handle = match self.mode {
            Mode::Gpu => HandleKind::Fabric,
            Mode::Host => HandleKind::HostMemfd,
        };
        let wrong = |what: &str, got: String, want: String| -> Failure {
            format!("the locator's {what} is {got}, not {want}").into()
        };
        if locator.generation != expected.generation {
            return Err(wrong(
                "generation",
                locator.generation.to_string(),
                expected.generation.to_string(),
            ));
        }
        if locator.handle != handle {
            return Err(wrong(
                "handle",
                format!("{:?}", locator.handle),
                format!("{handle:?}"),
            ));
        }
        if locator.size != expected.size() {
            return Err(wrong(
                "size",
                locator.size.to_string(),
                expected.size().to_string(),
            ));
        }
        if locator.device_uuid != expected.device {
            return Err(wrong(
                "device",
                format!("{:?}", locator.device_uuid),
                format!("{:?}", expected.device),
            ));
        }
        if locator.exporter_name != dns_name(OWNER) {
            return Err(wrong(
                "exporter name",
                locator.exporter_name.clone(),
                dns_name(OWNER),
            ));
        }
        Ok(())
    }

    fn map(&self, fetched: &Fetched) -> Result<Mapping, Failure> {
        match &self.resource {
            Some(resource) => Ok(Mapping::Gpu(resource.import_fabric(fetched.descriptor())?)),
            None => Ok(Mapping::Host(host_stand_in::import_read_only(
                fetched.descriptor(),
            )?)),
        }
    }

    fn gone(&self, within: Duration) -> Result<String, Failure> {
        let started = Instant::now();
        while self.registry.resolve(OWNER, REGION)?.is_some() {
            if started.elapsed() > within {
                return Err(format!("still published after {within:?}").into());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(format!("gone after_us={}", started.elapsed().as_micros()))
    }

    fn absent(&self, during: Duration) -> Result<String, Failure> {
        let started = Instant::now();
        while started.elapsed() < during {
            if let Some(entry) = self.registry.resolve(OWNER, REGION)? {
                return Ok(format!("present {}", entry.locator.generation));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok("absent".into())
    }

    fn same(&self) -> Result<String, Failure> {
        Ok(match self.registry.resolve(OWNER, REGION)? {
            None => "absent".into(),
            Some(entry) if Some(&entry.locator) == self.history.last() => "same".into(),
            Some(entry) => format!("changed {}", entry.locator.generation),
        })
    }

    fn stale(&self, generation: u64) -> Result<String, Failure> {
        let locator = self
            .history
            .iter()
            .rev()
            .find(|l| l.generation == generation)
            .ok_or("no locator of that generation was imported")?;
        Ok(match self.fetcher.fetch(locator) {
            Err(FetchError::Stale { serving, .. }) => format!("stale serving={serving:?}"),
            Err(e) => format!("error {}", one_line(&e)),
            Ok(fetched) => {
                let _ = fetched.import_failed();
                "served".into()
            }
        })
    }

    fn reread(&self) -> Result<String, Failure> {
        let (committed, mapping) = self.held.as_ref().ok_or("nothing held")?;
        Ok(match mapping.bytes() {
            Ok(bytes) if bytes == committed.bytes() => {
                format!("held intact generation={}", committed.generation)
            }
            Ok(_) => format!("held differs generation={}", committed.generation),
            Err(e) => format!("held unreadable {}", one_line(&*e)),
        })
    }
}

/// The descriptor's chunks and the tensors that came with it are what the writer committed.
fn check_fetched(fetched: &Fetched, expected: &Committed) -> Result<(), Failure> {
    let chunks: Vec<u64> = fetched
        .descriptor()
        .chunk_sizes()
        .iter()
        .map(|&s| s as u64)
        .collect();
    if chunks != expected.sizes {
        return Err(format!(
            "the descriptor's chunks are {chunks:?}, not {:?}",
            expected.sizes
        )
        .into());
    }
    let tensors = region_metadata(fetched)?;
    if tensors != expected_tensors() {
        return Err(format!("the region's tensors are {tensors:?}").into());
    }
    Ok(())
}

/// Every byte is the writer's, and so is each tensor's, read at its chunk's start plus its
/// offset.
fn check_bytes(mapping: &Mapping, expected: &Committed) -> Result<(), Failure> {
    let bytes = mapping.bytes()?;
    let want = expected.bytes();
    if bytes.len() != want.len() {
        return Err(format!("{} bytes mapped, not {}", bytes.len(), want.len()).into());
    }
    if let Some(at) = bytes.iter().zip(&want).position(|(a, b)| a != b) {
        return Err(format!("byte {at} differs from the writer's").into());
    }
    for (key, tensor) in expected_tensors() {
        let start = expected.chunk_start(tensor.chunk as usize) + tensor.offset as usize;
        let range = start..start + tensor.len as usize;
        if bytes.get(range.clone()) != want.get(range) {
            return Err(format!("tensor {key} differs from the writer's").into());
        }
    }
    Ok(())
}
