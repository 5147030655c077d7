//! Two nodes, through the registry, on the GPU (issue 32, item 5): a GPU region of a real
//! `vmm-memd`, published by a real `vmm-memd-publish` in one network namespace, found through
//! etcd and imported as fabric handles from another.
//!
//! ```sh
//! sudo cargo run -p vmm-registry --example memd_fabric_netns                  # on the GPU
//! sudo cargo run -p vmm-registry --example memd_fabric_netns -- --host         # host memory
//! ```
//!
//! Two network namespaces joined by a veth pair (10.250.x.1 and .2); in the first ("node A"):
//! etcd (mutual TLS, client certificates) on its veth address, `vmm-memd` (device 0; it starts
//! its keeper), a writer that begins the region on the GPU, fills each chunk through its
//! mapping, puts two tensors and commits, and `vmm-memd-publish` (its own certificate,
//! listening on A's address, admitting only node B's importer). In the second ("node B"): an
//! importer that resolves the locator through etcd, fetches the fabric descriptor from the
//! publisher over mutual TLS across the veth (checking size, device UUID and the tensors),
//! imports it (`import_fabric`, read-only) and checks every byte (`importer.rs`). Then the
//! service is SIGKILLed and started again (`restart.rs`: the GPU locator is withdrawn, and the
//! generation the keeper kept is published and imported again), a new generation is
//! committed and imported,
//! and the publisher stopped (its locator gone at once). Each step's time is printed.
//!
//! The programs are this executable (`vmm-memd`, `vmm-memd-publish` through the pre-`main`
//! hook of `tests/support/memd.rs`; `probe`, `writer` and `importer` as sub-commands), so
//! only it and etcd travel to the GPU machine (`gpu/stage-netns.sh`). The orchestrating
//! process never initialises CUDA (the fabric check runs in a child). `--host` runs the same
//! with a host-memory region handed over as the host stand-in (same machine only): the whole
//! path, on a machine without a GPU.
//!
//! Needs root, `ip` (iproute2), etcd (`$VMM_ETCD_BIN` or on the `PATH`) and, without `--host`,
//! a GPU with fabric support and an IMEX channel; without one of them it prints one
//! `SKIP memd_fabric_netns: <reason>` line on stderr and exits 0 (`VMM_REQUIRE_GPU=1` or
//! `VMM_REQUIRE_ETCD=1`: exits 1). The namespaces and every process in them are removed on
//! every exit path, SIGINT and SIGTERM included; every wait is bounded.

#[path = "../../tests/support/mod.rs"]
mod support;

#[allow(dead_code)]
#[path = "../../tests/support/memd.rs"]
mod memd;

mod child;
mod importer;
mod node_a;
mod region;
mod restart;
mod run;

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::Duration;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use child::{Child, Failure, Spec};
use region::Mode;
use run::Options;
use support::etcd::etcd_binary;
use support::netns::TwoNodes;

const NAME: &str = "memd_fabric_netns";

const USAGE: &str = "usage: memd_fabric_netns [--host] \
                     (probe, writer and importer are its own children)";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let words: Vec<&str> = args.iter().map(String::as_str).collect();
    let result = match words[..] {
        ["probe"] => {
            match vmm_core::cuda::fabric_availability() {
                Ok(()) => println!("fabric ok"),
                Err(reason) => println!("fabric unavailable: {reason}"),
            }
            Ok(())
        }
        ["writer", socket, mode, seed] => {
            Mode::parse(mode).and_then(|mode| node_a::writer(socket, mode, seed.parse()?))
        }
        ["importer", endpoint, dir, mode] => {
            Mode::parse(mode).and_then(|mode| importer::importer(endpoint, Path::new(dir), mode))
        }
        _ => match options(&words) {
            Ok(options) => return orchestrate(options),
            Err(e) => Err(e),
        },
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{NAME}: {e}");
            ExitCode::FAILURE
        }
    }
}

fn options(words: &[&str]) -> Result<Options, Failure> {
    let mut options = Options { mode: Mode::Gpu };
    for word in words {
        match *word {
            "--host" => options.mode = Mode::Host,
            _ => return Err(USAGE.into()),
        }
    }
    Ok(options)
}

fn orchestrate(options: Options) -> ExitCode {
    let (nodes, etcd) = match prepare(options.mode) {
        Ok(prepared) => prepared,
        Err(reason) => return skip(&reason),
    };
    if let Err(e) = child::stop_on_signals() {
        eprintln!("{NAME}: {e}");
        return ExitCode::FAILURE;
    }
    println!(
        "{NAME}: {} mode; node A {} ({}), node B {} ({})",
        options.mode.as_str(),
        nodes.0.a,
        nodes.0.addr_a,
        nodes.0.b,
        nodes.0.addr_b
    );
    match run::run(&nodes.0, &etcd, options) {
        Ok(timings) => {
            println!(
                "{NAME}: passed: published on A, resolved, fetched over mutual TLS and imported \
                 on B; restart and new commit followed"
            );
            println!("{NAME}: timings: {}", timings.summary());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{NAME}: FAILED: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The namespaces and etcd, or why this machine cannot run it.
fn prepare(mode: Mode) -> Result<(Swept, PathBuf), String> {
    let etcd = etcd_binary()
        .ok_or("etcd is not installed (set VMM_ETCD_BIN, or apt-get install etcd-server)")?;
    if !etcd.is_file() {
        return Err(format!("no etcd at {}", etcd.display()));
    }
    if mode == Mode::Gpu {
        fabric_in_a_child()?;
    }
    Ok((Swept(TwoNodes::make()?), etcd))
}

/// Whether a process here can use fabric handles, asked of a child (`probe`), so that this
/// one stays free of CUDA and may start processes.
fn fabric_in_a_child() -> Result<(), String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut command = Command::new(exe);
    command.arg("probe");
    let spec = Spec {
        echo: false,
        stop: Signal::SIGKILL,
        ..Spec::new("probe")
    };
    let mut probe = Child::spawn(spec, command).map_err(|e| e.to_string())?;
    let line = probe
        .expect("fabric ", Duration::from_secs(60))
        .map_err(|e| format!("the fabric check failed: {e}"))?;
    match line.strip_prefix("fabric unavailable: ") {
        Some(reason) => Err(reason.to_owned()),
        None => Ok(()),
    }
}

/// One SKIP line; a failure under `VMM_REQUIRE_GPU=1` or `VMM_REQUIRE_ETCD=1`.
fn skip(reason: &str) -> ExitCode {
    eprintln!("SKIP {NAME}: {reason}");
    let strict = ["VMM_REQUIRE_GPU", "VMM_REQUIRE_ETCD"]
        .iter()
        .any(|v| std::env::var(v).is_ok_and(|v| v == "1"));
    if strict {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

/// The namespaces, swept before they are removed: a process still in one (a keeper whose
/// service was SIGKILLed and not started again, a child a failure left) is SIGKILLed. Every
/// process in them is this run's: their names carry this process's id.
#[derive(Debug)]
struct Swept(TwoNodes);

impl Drop for Swept {
    fn drop(&mut self) {
        for netns in [&self.0.a, &self.0.b] {
            let Ok(out) = Command::new("ip").args(["netns", "pids", netns]).output() else {
                continue;
            };
            for pid in String::from_utf8_lossy(&out.stdout)
                .split_whitespace()
                .filter_map(|p| p.parse::<i32>().ok())
            {
                let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
            }
        }
    }
}
