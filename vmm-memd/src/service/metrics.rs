//! The service's metrics in the Prometheus text exposition format (version 0.0.4), rendered
//! from what the caller may see ([`Status`]): per region only regions it may read, and the
//! service's counters. Region names are `[A-Za-z0-9._/-]`, so label values need no escaping.

use std::fmt::Write;

use crate::protocol::{SleepState, Status};

/// The metrics text, at most `cap` bytes: regions are left out from the end until it fits.
pub(crate) fn render(status: &Status, cap: usize) -> String {
    let mut status = status.clone();
    loop {
        let text = render_all(&status);
        if text.len() <= cap || status.regions.pop().is_none() {
            return text;
        }
    }
}

fn family(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

fn render_all(status: &Status) -> String {
    let mut out = String::new();
    let regions = &status.regions;
    let per_region = |out: &mut String, name, help, value: &dyn Fn(usize) -> u64| {
        family(out, name, "gauge", help);
        for (i, r) in regions.iter().enumerate() {
            let _ = writeln!(out, "{name}{{region=\"{}\"}} {}", r.region, value(i));
        }
    };
    per_region(
        &mut out,
        "vmm_memd_region_generation",
        "The current generation of a region (0: none committed).",
        &|i| {
            regions[i]
                .generations
                .iter()
                .find(|g| g.current)
                .map_or(0, |g| g.generation)
        },
    );
    per_region(
        &mut out,
        "vmm_memd_region_bytes",
        "Bytes of a region's committed generations still held.",
        &|i| regions[i].generations.iter().map(|g| g.bytes).sum(),
    );
    per_region(
        &mut out,
        "vmm_memd_region_generations_held",
        "Committed generations of a region still held (current, retained, leased).",
        &|i| regions[i].generations.len() as u64,
    );
    per_region(
        &mut out,
        "vmm_memd_region_leases",
        "Readers' leases on a region's generations.",
        &|i| {
            regions[i]
                .generations
                .iter()
                .map(|g| g.readers.len() as u64)
                .sum()
        },
    );
    per_region(
        &mut out,
        "vmm_memd_region_pending_bytes",
        "Bytes of a region's generation being written (0: no writer).",
        &|i| regions[i].pending.map_or(0, |(_, bytes, _)| bytes),
    );
    per_region(
        &mut out,
        "vmm_memd_region_waiting_writers",
        "Writers waiting for a region's writer slot.",
        &|i| u64::from(regions[i].waiting_writers),
    );
    per_region(
        &mut out,
        "vmm_memd_region_asleep",
        "1 when a region's current generation sleeps (its memory let go), else 0.",
        &|i| {
            let current = regions[i].generations.iter().find(|g| g.current);
            u64::from(current.is_some_and(|g| g.sleep == SleepState::Asleep))
        },
    );
    per_region(
        &mut out,
        "vmm_memd_region_asleep_bytes",
        "Bytes of a region's generations asleep (charged to the quota, memory let go).",
        &|i| {
            regions[i]
                .generations
                .iter()
                .filter(|g| g.sleep == SleepState::Asleep)
                .map(|g| g.bytes)
                .sum()
        },
    );
    let uid = status.uid;
    family(
        &mut out,
        "vmm_memd_quota_used_bytes",
        "gauge",
        "Bytes the caller's uid holds.",
    );
    let _ = writeln!(
        out,
        "vmm_memd_quota_used_bytes{{uid=\"{uid}\"}} {}",
        status.used
    );
    family(
        &mut out,
        "vmm_memd_quota_bytes",
        "gauge",
        "The caller's uid's quota.",
    );
    let _ = writeln!(
        out,
        "vmm_memd_quota_bytes{{uid=\"{uid}\"}} {}",
        status.quota
    );
    family(
        &mut out,
        "vmm_memd_refusals_total",
        "counter",
        "Requests refused since the service started.",
    );
    let _ = writeln!(out, "vmm_memd_refusals_total {}", status.refusals);
    family(
        &mut out,
        "vmm_memd_expired_leases_total",
        "counter",
        "Leases ended by their TTL since the service started.",
    );
    let _ = writeln!(
        out,
        "vmm_memd_expired_leases_total {}",
        status.expired_leases
    );
    out
}
