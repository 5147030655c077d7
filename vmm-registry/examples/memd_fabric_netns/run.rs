//! The run, step by step, with each step's time: etcd up in node A's namespace, the service
//! up, a generation committed, the publisher's locator published, node B's importer resolving,
//! fetching, importing and checking it; then the service's restart (`restart.rs`), a new
//! commit followed, and the publisher's clean stop.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use vmm_tests::pki::Pki;

use crate::child::{Child, Failure, Spec, clock};
use crate::node_a::{self, ENGINE, OWNER, Service};
use crate::region::{Committed, Mode, REGION};
use crate::support::etcd::{Etcd, TempDir};
use crate::support::netns::TwoNodes;
use crate::support::{etcd_tls, write_material};

/// What the command line chose.
#[derive(Debug, Clone, Copy)]
pub struct Options {
    pub mode: Mode,
}

/// Each step's time, printed as it is noted.
#[derive(Debug, Default)]
pub struct Timings(Vec<(String, Duration)>);

impl Timings {
    pub fn note(&mut self, step: &str, took: Duration) {
        println!(
            "[{:8.3}] time {step}: {:.3} ms",
            clock(),
            took.as_secs_f64() * 1e3
        );
        self.0.push((step.to_owned(), took));
    }

    /// The importer's own times in its answer (`resolve_us=..` and the like, in
    /// microseconds), noted as `<what> (<label>)`.
    pub fn note_answer(&mut self, label: &str, answer: &str) {
        for (key, value) in answer.split_whitespace().filter_map(|w| w.split_once('=')) {
            if let (Some(what), Ok(us)) = (key.strip_suffix("_us"), value.parse::<u64>()) {
                self.note(&format!("{what} ({label})"), Duration::from_micros(us));
            }
        }
    }

    /// The `<key>=<microseconds>` of an answer, noted as `step`.
    pub fn note_us(&mut self, step: &str, answer: &str, key: &str) -> Result<(), Failure> {
        let us = answer
            .split_whitespace()
            .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
            .ok_or_else(|| format!("no {key}= in {answer:?}"))?;
        self.note(step, Duration::from_micros(us.parse()?));
        Ok(())
    }

    pub fn summary(&self) -> String {
        let steps: Vec<String> = self
            .0
            .iter()
            .map(|(step, took)| format!("{step}={:.3}ms", took.as_secs_f64() * 1e3))
            .collect();
        steps.join(", ")
    }
}

/// Everything the run holds. On every exit path its fields are dropped in the order they are
/// declared: node B's importer, the publisher (which revokes its lease while etcd still
/// runs), the service (SIGTERM lets its keeper go), etcd, the files.
#[derive(Debug)]
pub struct Run<'n> {
    pub importer: Option<Child>,
    pub publisher: Option<Child>,
    pub service: Service,
    pub etcd: Etcd,
    pub dir: TempDir,
    pub nodes: &'n TwoNodes,
    pub options: Options,
    pub exe: PathBuf,
    pub timings: Timings,
    /// What was committed, in order.
    pub commits: Vec<Committed>,
}

/// The whole run; its timings.
pub fn run(nodes: &TwoNodes, etcd_binary: &Path, options: Options) -> Result<Timings, Failure> {
    let mut run = Run::start(nodes, etcd_binary, options)?;
    run.publish_and_import()?;
    run.restart()?;
    run.next_commit()?;
    run.stop()?;
    Ok(std::mem::take(&mut run.timings))
}

impl<'n> Run<'n> {
    /// etcd (mutual TLS) in node A's namespace on its veth address, the certificates, the
    /// service.
    fn start(
        nodes: &'n TwoNodes,
        etcd_binary: &Path,
        options: Options,
    ) -> Result<Run<'n>, Failure> {
        let mut timings = Timings::default();
        let pki = Pki::new("memd-fabric-netns");
        let dir = TempDir::new("memd-fabric-netns");
        let started = Instant::now();
        let etcd = Etcd::start_in(
            etcd_binary,
            etcd_tls(&pki, &dir),
            &nodes.a,
            nodes.addr_a.into(),
        );
        timings.note("etcd up", started.elapsed());
        write_material(&pki, &dir.0, OWNER);
        write_material(&pki, &dir.0, ENGINE);
        let exe = std::env::current_exe()?;
        let (service, up) = Service::start(&nodes.a, &exe)?;
        timings.note("vmm-memd up", up);
        Ok(Run {
            nodes,
            options,
            exe,
            timings,
            dir,
            etcd,
            service,
            publisher: None,
            importer: None,
            commits: Vec::new(),
        })
    }

    pub fn publisher(&mut self) -> Result<&mut Child, Failure> {
        self.publisher.as_mut().ok_or_else(|| "no publisher".into())
    }

    pub fn importer(&mut self) -> Result<&mut Child, Failure> {
        self.importer.as_mut().ok_or_else(|| "no importer".into())
    }

    /// Commit a generation written with `seed` on node A.
    pub fn commit(&mut self, seed: u8) -> Result<Committed, Failure> {
        let started = Instant::now();
        let committed = node_a::write(
            &self.nodes.a,
            &self.exe,
            &self.service,
            self.options.mode,
            seed,
        )?;
        self.timings.note(
            &format!("commit generation {}", committed.generation),
            started.elapsed(),
        );
        self.commits.push(committed.clone());
        Ok(committed)
    }

    /// Node B imports `committed` (see importer.rs); the publisher reports the hand-off
    /// acknowledged, by an importer at node B's address.
    pub fn import(&mut self, committed: &Committed, label: &str) -> Result<(), Failure> {
        let request = format!("import {}", committed.words());
        let answer = self.importer()?.ask(&request, Duration::from_secs(120))?;
        self.timings.note_answer(label, &answer);
        let served = format!("served {REGION} {} to ", committed.generation);
        let from = format!("{served}{}:", self.nodes.addr_b);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = self.publisher()?.expect(&served, left)?;
            // The refusal of an earlier fetch of this generation (a stale locator) may be
            // reported first.
            if line.contains(" refused ") {
                continue;
            }
            if !line.starts_with(&from) || !line.ends_with(" acknowledged") {
                return Err(
                    format!("the publisher reports {line:?}, not {from}...acknowledged").into(),
                );
            }
            return Ok(());
        }
    }

    /// A generation committed on A, the publisher started and its locator published, node B's
    /// importer started, and the region imported there.
    fn publish_and_import(&mut self) -> Result<(), Failure> {
        let first = self.commit(1)?;
        let started = Instant::now();
        let endpoint = self.etcd.endpoint();
        let publisher = node_a::start_publisher(
            &self.nodes.a,
            &self.exe,
            &self.service,
            &endpoint,
            &self.dir.0,
            self.nodes.addr_a.into(),
        )?;
        self.timings.note("publisher listening", started.elapsed());
        let publisher = self.publisher.insert(publisher);
        publisher.expect(
            &format!("published {REGION} {}", first.generation),
            Duration::from_secs(20),
        )?;
        self.timings.note("publish seen", started.elapsed());

        let started = Instant::now();
        let mut command = TwoNodes::command(&self.nodes.b, &self.exe);
        command.args(["importer", &endpoint, &self.dir.0.display().to_string()]);
        command.arg(self.options.mode.as_str());
        let spec = Spec {
            talk: true,
            stop: Signal::SIGKILL,
            ..Spec::new("importer")
        };
        let importer = self.importer.insert(Child::spawn(spec, command)?);
        let ready = importer.expect("ready ", Duration::from_secs(60))?;
        self.timings.note("importer ready", started.elapsed());
        self.timings.note_answer("importer start", &ready);
        self.import(&first, "first import")
    }

    /// A new generation, written after the restart: followed by the publisher, imported by
    /// node B; the first generation's locator is stale.
    fn next_commit(&mut self) -> Result<(), Failure> {
        let first = self.commits[0].generation;
        let next = self.commit(2)?;
        let started = Instant::now();
        let g = next.generation;
        self.publisher()?.expect_any(
            &[
                &format!("published {REGION} {g}"),
                &format!("updated {REGION} {g}"),
            ],
            Duration::from_secs(10),
        )?;
        self.timings
            .note("new generation published", started.elapsed());
        self.import(&next, "new generation")?;
        let stale = self
            .importer()?
            .ask(&format!("stale {first}"), Duration::from_secs(30))?;
        if stale != format!("stale serving=Some({g})") {
            return Err(format!("generation {first}'s locator fetched: {stale}").into());
        }
        Ok(())
    }

    /// The publisher stopped with SIGTERM: it exits 0 and its locator is gone at once (its
    /// lease revoked), as node B sees; node B's mapping still reads the last generation.
    fn stop(&mut self) -> Result<(), Failure> {
        let held = self.importer()?.ask("reread", Duration::from_secs(30))?;
        if !held.starts_with("held intact") {
            return Err(format!("node B's mapping of the last generation: {held}").into());
        }
        let publisher = self.publisher()?;
        publisher.signal(Signal::SIGTERM)?;
        let status = publisher.wait(Duration::from_secs(10))?;
        if !status.success() {
            return Err(format!("the publisher stopped with {status}").into());
        }
        let gone = self.importer()?.ask("gone 3000", Duration::from_secs(10))?;
        self.timings.note_us(
            "locator gone at node B (publisher SIGTERMed)",
            &gone,
            "after_us",
        )?;
        let importer = self.importer()?;
        importer.close_stdin();
        let status = importer.wait(Duration::from_secs(10))?;
        if !status.success() {
            return Err(format!("the importer ended with {status}").into());
        }
        Ok(())
    }
}
