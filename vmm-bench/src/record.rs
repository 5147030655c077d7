//! Per-iteration timings, kept by the bench itself so the report's medians do not depend on
//! criterion's output files.
//!
//! Every figure is measured with `iter_custom` through [`measure`]: each iteration times only
//! the operation (setup and teardown run outside the clock), and the time is recorded under the
//! figure's key. Medians are over every recorded iteration, warm-up included (criterion gives
//! no hook to tell them apart; the first, cold iteration does not move a median). At most
//! [`KEEP`] iterations per figure are kept, by reservoir sampling, so a fast figure's millions
//! of iterations cost bounded memory without biasing the median. The 10th and 90th percentiles
//! come from the same kept sample: how wide a figure's spread is says whether one run's median
//! can be trusted.
//!
//! Figures measured together ([`measure_interleaved`]) are remembered as such, so the report
//! can say which ratios come from interleaved runs.

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

/// For each figure measured interleaved, the other figures of its set.
static PARTNERS: Mutex<BTreeMap<String, Vec<String>>> = Mutex::new(BTreeMap::new());

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
    measure_interleaved(&mut [(key_a, &mut op_a), (key_b, &mut op_b)], iters)
}

/// Record `times` under `key` as iterations of that figure: for figures an operation times
/// besides the one it returns (each reader's time in a round of concurrent readers, say).
pub fn record(key: &str, times: &[Duration]) {
    let mut all = samples();
    let entry = all.entry(key.to_owned()).or_default();
    for t in times {
        entry.push(t.as_nanos() as u64);
    }
}

/// One figure of an interleaved set: its key and its operation.
pub type Interleaved<'a> = (&'a str, &'a mut dyn FnMut() -> Duration);

/// Run `iters` interleaved iterations of a set of figures (a figure and its baselines): each
/// iteration runs every one once, the first of them rotating from one iteration to the next
/// (for two: alternating), so that drift falls on all alike. Records each under its key and
/// remembers the set (see [`interleaved_with`]); returns the sum of all.
pub fn measure_interleaved(ops: &mut [Interleaved<'_>], iters: u64) -> Duration {
    let n = ops.len();
    let mut times: Vec<Vec<u64>> = (0..n)
        .map(|_| Vec::with_capacity(iters.min(1 << 16) as usize))
        .collect();
    let mut total = Duration::ZERO;
    for i in 0..iters {
        for j in 0..n {
            let which = (i as usize + j) % n;
            let t = (ops[which].1)();
            total += t;
            times[which].push(t.as_nanos() as u64);
        }
    }
    note_interleaved(&ops.iter().map(|(key, _)| *key).collect::<Vec<_>>());
    let mut all = samples();
    for ((key, _), times) in ops.iter().zip(times) {
        let entry = all.entry((*key).to_owned()).or_default();
        for t in times {
            entry.push(t);
        }
    }
    total
}

/// Remember that `keys` are measured in one interleaved set: for figures an interleaved
/// operation records besides its own (a split of its time, say).
pub fn note_interleaved(keys: &[&str]) {
    let mut partners = PARTNERS.lock().unwrap_or_else(|e| e.into_inner());
    for key in keys {
        let others = keys
            .iter()
            .filter(|other| *other != key)
            .map(|other| (*other).to_owned());
        let entry = partners.entry((*key).to_owned()).or_default();
        for other in others {
            if !entry.contains(&other) {
                entry.push(other);
            }
        }
    }
}

/// Whether figures `a` and `b` were measured in one interleaved set.
pub fn interleaved_with(a: &str, b: &str) -> bool {
    PARTNERS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(a)
        .is_some_and(|others| others.iter().any(|o| o == b))
}

/// A figure's median, spread and how many iterations it ran (`None` if it did not run).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Summary {
    /// Median of the kept per-iteration times, in nanoseconds.
    pub median_ns: f64,
    /// 10th percentile of the kept per-iteration times, in nanoseconds.
    pub p10_ns: f64,
    /// 90th percentile of the kept per-iteration times, in nanoseconds.
    pub p90_ns: f64,
    /// Iterations recorded (warm-up included).
    pub iterations: u64,
    /// Iterations kept (at most [`KEEP`]): the sample the median and percentiles come from.
    pub kept: usize,
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
        p10_ns: percentile(&sorted, 0.10),
        p90_ns: percentile(&sorted, 0.90),
        iterations: s.seen,
        kept: sorted.len(),
    })
}

/// Every key recorded, in order.
pub fn keys() -> Vec<String> {
    samples().keys().cloned().collect()
}

/// The `q` quantile (0 to 1) of a sorted, non-empty sample, interpolated linearly between the
/// two nearest ranks (so `percentile(s, 0.5)` is the median).
fn percentile(sorted: &[u64], q: f64) -> f64 {
    let position = q.clamp(0.0, 1.0) * (sorted.len() - 1) as f64;
    let (below, above) = (position.floor() as usize, position.ceil() as usize);
    let weight = position - below as f64;
    sorted[below] as f64 * (1.0 - weight) + sorted[above] as f64 * weight
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
    fn percentiles() {
        let sample: Vec<u64> = (0..=100).collect();
        assert_eq!(percentile(&sample, 0.10), 10.0);
        assert_eq!(percentile(&sample, 0.90), 90.0);
        assert_eq!(percentile(&sample, 0.5), median(&sample));
        // Between ranks: 0.1 * 9 = 0.9 of the way from 10 to 20.
        assert_eq!(percentile(&[10, 20], 0.9), 19.0);
        assert_eq!(percentile(&[7], 0.1), 7.0);
        for sample in [vec![1, 2, 3, 10], vec![1, 5, 9]] {
            assert_eq!(percentile(&sample, 0.5), median(&sample));
        }
    }

    #[test]
    fn summaries_have_the_spread() {
        let mut next = 0;
        measure("test/spread", 11, || {
            next += 10;
            Duration::from_nanos(next)
        });
        let s = summary("test/spread").unwrap();
        assert_eq!((s.p10_ns, s.median_ns, s.p90_ns), (20.0, 60.0, 100.0));
        assert_eq!((s.iterations, s.kept), (11, 11));
    }

    #[test]
    fn interleaved_sets_rotate_and_are_remembered() {
        let order = std::cell::RefCell::new(Vec::new());
        let mut a = || {
            order.borrow_mut().push('a');
            Duration::from_nanos(1)
        };
        let mut b = || {
            order.borrow_mut().push('b');
            Duration::from_nanos(2)
        };
        let mut c = || {
            order.borrow_mut().push('c');
            Duration::from_nanos(3)
        };
        let total = measure_interleaved(
            &mut [
                ("test/set-a", &mut a),
                ("test/set-b", &mut b),
                ("test/set-c", &mut c),
            ],
            3,
        );
        assert_eq!(total, Duration::from_nanos(18));
        assert_eq!(order.into_inner(), "abcbcacab".chars().collect::<Vec<_>>());
        for key in ["test/set-a", "test/set-b", "test/set-c"] {
            assert_eq!(summary(key).unwrap().iterations, 3);
        }
        assert!(interleaved_with("test/set-a", "test/set-c"));
        assert!(interleaved_with("test/set-c", "test/set-b"));
        assert!(!interleaved_with("test/set-a", "test/set-a"));
        assert!(!interleaved_with("test/set-a", "test/measure"));
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
        assert!(interleaved_with("test/pair-a", "test/pair-b"));
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
