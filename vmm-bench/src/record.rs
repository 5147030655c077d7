//! Per-iteration timings, kept by the bench itself so the report's medians do not depend on
//! criterion's output files.
//!
//! Every figure is measured with `iter_custom` through [`measure`]: each iteration times only
//! the operation (setup and teardown run outside the clock), and the time is recorded under the
//! figure's key. Medians are over every recorded iteration, warm-up included (criterion gives
//! no hook to tell them apart; the first, cold iteration does not move a median). At most
//! [`KEEP`] iterations per figure are kept, by reservoir sampling, so a fast figure's millions
//! of iterations cost bounded memory without biasing the median.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

/// Iterations kept per figure.
pub const KEEP: usize = 100_000;

#[derive(Debug, Default)]
struct Samples {
    kept: Vec<u64>,
    seen: u64,
    rng: u64,
}

impl Samples {
    fn push(&mut self, nanos: u64) {
        self.seen += 1;
        if self.kept.len() < KEEP {
            self.kept.push(nanos);
            return;
        }
        // xorshift64: deterministic, good enough to pick which kept sample to replace.
        if self.rng == 0 {
            self.rng = 0x9E37_79B9_7F4A_7C15;
        }
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        let slot = self.rng % self.seen;
        if (slot as usize) < KEEP {
            self.kept[slot as usize] = nanos;
        }
    }
}

static SAMPLES: Mutex<BTreeMap<String, Samples>> = Mutex::new(BTreeMap::new());

fn samples() -> std::sync::MutexGuard<'static, BTreeMap<String, Samples>> {
    SAMPLES.lock().unwrap_or_else(|e| e.into_inner())
}

/// Run `iters` iterations of `op`, which returns the time of the part it measures; record each
/// under `key` and return the sum (what `iter_custom` wants).
pub fn measure(key: &str, iters: u64, mut op: impl FnMut() -> Duration) -> Duration {
    let mut times = Vec::with_capacity(iters.min(1 << 16) as usize);
    let mut total = Duration::ZERO;
    for _ in 0..iters {
        let t = op();
        total += t;
        times.push(t.as_nanos() as u64);
    }
    let mut all = samples();
    let entry = all.entry(key.to_owned()).or_default();
    for t in times {
        entry.push(t);
    }
    total
}

/// Run `iters` interleaved iterations of a figure and its baseline: each iteration runs both,
/// in alternating order, so that drift (clocks, other load, the driver's caches) falls on both
/// alike and their ratio stays honest. Records each under its key; returns the sum of both.
pub fn measure_pair(
    (key_a, mut op_a): (&str, impl FnMut() -> Duration),
    (key_b, mut op_b): (&str, impl FnMut() -> Duration),
    iters: u64,
) -> Duration {
    let mut times_a = Vec::with_capacity(iters.min(1 << 16) as usize);
    let mut times_b = Vec::with_capacity(iters.min(1 << 16) as usize);
    let mut total = Duration::ZERO;
    for i in 0..iters {
        let (a, b) = if i % 2 == 0 {
            let a = op_a();
            (a, op_b())
        } else {
            let b = op_b();
            (op_a(), b)
        };
        total += a + b;
        times_a.push(a.as_nanos() as u64);
        times_b.push(b.as_nanos() as u64);
    }
    let mut all = samples();
    for (key, times) in [(key_a, times_a), (key_b, times_b)] {
        let entry = all.entry(key.to_owned()).or_default();
        for t in times {
            entry.push(t);
        }
    }
    total
}

/// A figure's median and how many iterations it ran (`None` if it did not run).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Summary {
    /// Median of the kept per-iteration times, in nanoseconds.
    pub median_ns: f64,
    /// Iterations recorded (warm-up included).
    pub iterations: u64,
}

/// The summary of `key`, if it ran.
pub fn summary(key: &str) -> Option<Summary> {
    let all = samples();
    let s = all.get(key)?;
    if s.kept.is_empty() {
        return None;
    }
    let mut sorted = s.kept.clone();
    sorted.sort_unstable();
    Some(Summary {
        median_ns: median(&sorted),
        iterations: s.seen,
    })
}

/// Every key recorded, in order.
pub fn keys() -> Vec<String> {
    samples().keys().cloned().collect()
}

fn median(sorted: &[u64]) -> f64 {
    let n = sorted.len();
    if n % 2 == 1 {
        sorted[n / 2] as f64
    } else {
        (sorted[n / 2 - 1] as f64 + sorted[n / 2] as f64) / 2.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians() {
        assert_eq!(median(&[1, 2, 3]), 2.0);
        assert_eq!(median(&[1, 2, 3, 10]), 2.5);
    }

    #[test]
    fn measure_records_every_iteration() {
        let total = measure("test/measure", 5, || Duration::from_nanos(10));
        assert_eq!(total, Duration::from_nanos(50));
        let s = summary("test/measure").unwrap();
        assert_eq!(s.iterations, 5);
        assert_eq!(s.median_ns, 10.0);
    }

    #[test]
    fn pairs_record_both_figures_every_iteration() {
        let total = measure_pair(
            ("test/pair-a", || Duration::from_nanos(10)),
            ("test/pair-b", || Duration::from_nanos(30)),
            4,
        );
        assert_eq!(total, Duration::from_nanos(160));
        assert_eq!(summary("test/pair-a").unwrap().median_ns, 10.0);
        assert_eq!(summary("test/pair-b").unwrap().iterations, 4);
    }

    #[test]
    fn reservoir_is_bounded() {
        let mut s = Samples::default();
        for i in 0..(KEEP as u64 * 2) {
            s.push(i);
        }
        assert_eq!(s.kept.len(), KEEP);
        assert_eq!(s.seen, KEEP as u64 * 2);
    }
}
