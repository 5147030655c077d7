//! The summary: each figure's median next to its baseline's, the ratio and the target, as a
//! Markdown table on stdout and the same rows as JSON under the target directory. Each median
//! comes with its 10th and 90th percentiles and its count of iterations, and each row says
//! whether figure and baseline ran interleaved.
//!
//! With [`COMPARE_VAR`] naming an earlier run's JSON, the summary also compares every median
//! and every ratio with that run's (see [`crate::compare`]): the check that a rerun of one
//! build confirms a figure.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::Serialize;
use vmm_core::cuda::Unavailable;

pub use crate::units::format_ns;
use crate::{compare, record};

/// Set to the path of an earlier run's [`REPORT_FILE`] to compare this run's medians with it.
pub const COMPARE_VAR: &str = "VMM_BENCH_COMPARE";

/// What a figure is held to.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Target {
    /// No target: shown for information.
    None,
    /// figure / baseline at most this ratio.
    RatioAtMost(f64),
    /// The figure's median under this many nanoseconds (the baseline is shown for context).
    Under(f64),
    /// What the figure adds to its baseline, per chunk, at most this many nanoseconds: for
    /// calls so short (tens of nanoseconds) that a ratio is decided by noise.
    AddedPerChunkAtMost {
        /// The chunks one iteration handles.
        chunks: usize,
        /// The bound on (figure - baseline) / chunks, in nanoseconds.
        ns: f64,
    },
}

impl Target {
    /// As the table's target column writes it (`<= 1.20x`, `< 2.000 ms`).
    pub fn describe(self) -> String {
        match self {
            Target::None => "-".to_owned(),
            Target::RatioAtMost(r) => format!("<= {r:.2}x"),
            Target::Under(ns) => format!("< {}", format_ns(ns)),
            Target::AddedPerChunkAtMost { ns, .. } => format!("<= +{}/chunk", format_ns(ns)),
        }
    }

    /// Whether a figure of median `figure_ns` meets it, next to a baseline of median
    /// `baseline_ns` (`None`: no target, or a ratio without its baseline).
    pub fn verdict(self, figure_ns: f64, baseline_ns: Option<f64>) -> Option<bool> {
        let ratio = baseline_ns.filter(|&b| b > 0.0).map(|b| figure_ns / b);
        match self {
            Target::None => None,
            Target::RatioAtMost(max) => ratio.map(|r| r <= max),
            Target::Under(ns) => Some(figure_ns < ns),
            Target::AddedPerChunkAtMost { chunks, ns } => {
                baseline_ns.map(|b| (figure_ns - b) / chunks.max(1) as f64 <= ns)
            }
        }
    }
}

/// One line of the table: a figure, its baseline (criterion keys `group/id`) and the target.
#[derive(Debug, Clone)]
struct Row {
    figure: String,
    baseline: String,
    target: Target,
}

static ROWS: Mutex<Vec<Row>> = Mutex::new(Vec::new());

/// Why the fabric groups were skipped on a run whose other GPU groups ran.
static FABRIC_SKIPPED: Mutex<Option<String>> = Mutex::new(None);

/// Record that the fabric groups were skipped, and why (the table and the JSON say so).
pub fn fabric_skipped(reason: String) {
    *FABRIC_SKIPPED.lock().unwrap_or_else(|e| e.into_inner()) = Some(reason);
}

/// The reason recorded by [`fabric_skipped`], if any.
pub fn fabric_skip_reason() -> Option<String> {
    FABRIC_SKIPPED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone()
}

/// Add a row (once per figure/baseline pair; repeated calls are ignored).
pub fn row(figure: &str, baseline: &str, target: Target) {
    let mut rows = ROWS.lock().unwrap_or_else(|e| e.into_inner());
    if rows
        .iter()
        .any(|r| r.figure == figure && r.baseline == baseline)
    {
        return;
    }
    rows.push(Row {
        figure: figure.to_owned(),
        baseline: baseline.to_owned(),
        target,
    });
}

#[derive(Debug, Serialize)]
struct JsonRow {
    figure: String,
    median_ns: f64,
    iterations: u64,
    baseline: String,
    baseline_median_ns: Option<f64>,
    baseline_iterations: Option<u64>,
    ratio: Option<f64>,
    target: String,
    pass: Option<bool>,
    // Added after the fields above (which older tooling reads):
    p10_ns: f64,
    p90_ns: f64,
    /// Iterations the median and percentiles come from (at most `record::KEEP`).
    kept: usize,
    baseline_p10_ns: Option<f64>,
    baseline_p90_ns: Option<f64>,
    baseline_kept: Option<usize>,
    /// Figure and baseline ran interleaved, iteration by iteration.
    interleaved: bool,
}

/// One figure's numbers, in the report's `figures` map.
#[derive(Debug, Serialize)]
struct JsonFigure {
    median_ns: f64,
    p10_ns: f64,
    p90_ns: f64,
    iterations: u64,
    kept: usize,
}

#[derive(Debug, Serialize)]
struct JsonReport {
    bench: &'static str,
    quick: bool,
    /// Why the GPU groups were skipped (`null` when they ran).
    gpu_skipped: Option<String>,
    /// Why the fabric groups were skipped while the other GPU groups ran (`null` otherwise).
    fabric_skipped: Option<String>,
    note: &'static str,
    rows: Vec<JsonRow>,
    medians_ns: std::collections::BTreeMap<String, f64>,
    /// Every figure that ran, with its spread and iterations (rows name only those with a
    /// baseline).
    figures: std::collections::BTreeMap<String, JsonFigure>,
}

fn collect() -> Vec<JsonRow> {
    let rows = ROWS.lock().unwrap_or_else(|e| e.into_inner()).clone();
    rows.into_iter()
        .filter_map(|row| {
            let figure = record::summary(&row.figure)?;
            let baseline = record::summary(&row.baseline);
            let ratio = baseline
                .filter(|b| b.median_ns > 0.0)
                .map(|b| figure.median_ns / b.median_ns);
            Some(JsonRow {
                pass: row
                    .target
                    .verdict(figure.median_ns, baseline.map(|b| b.median_ns)),
                target: row.target.describe(),
                interleaved: record::interleaved_with(&row.figure, &row.baseline),
                figure: row.figure,
                median_ns: figure.median_ns,
                iterations: figure.iterations,
                baseline: row.baseline,
                baseline_median_ns: baseline.map(|b| b.median_ns),
                baseline_iterations: baseline.map(|b| b.iterations),
                ratio,
                p10_ns: figure.p10_ns,
                p90_ns: figure.p90_ns,
                kept: figure.kept,
                baseline_p10_ns: baseline.map(|b| b.p10_ns),
                baseline_p90_ns: baseline.map(|b| b.p90_ns),
                baseline_kept: baseline.map(|b| b.kept),
            })
        })
        .collect()
}

/// `p10 - p90` of a figure, as the table shows it.
fn spread(p10_ns: f64, p90_ns: f64) -> String {
    format!("{} - {}", format_ns(p10_ns), format_ns(p90_ns))
}

/// The Markdown table of every row whose figure ran.
fn table(rows: &[JsonRow]) -> String {
    let mut out = String::from(
        "| figure | median | p10 - p90 | iterations | baseline | baseline median | \
         baseline p10 - p90 | baseline iterations | interleaved | ratio | target | result |\n\
         |---|---:|---:|---:|---|---:|---:|---:|---|---:|---|---|\n",
    );
    for r in rows {
        let baseline_spread = match (r.baseline_p10_ns, r.baseline_p90_ns) {
            (Some(p10), Some(p90)) => spread(p10, p90),
            _ => "-".to_owned(),
        };
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            r.figure,
            format_ns(r.median_ns),
            spread(r.p10_ns, r.p90_ns),
            r.iterations,
            r.baseline,
            r.baseline_median_ns.map_or("-".to_owned(), format_ns),
            baseline_spread,
            r.baseline_iterations
                .map_or("-".to_owned(), |n| n.to_string()),
            if r.interleaved { "yes" } else { "no" },
            r.ratio.map_or("-".to_owned(), |x| format!("{x:.3}x")),
            r.target,
            match r.pass {
                Some(true) => "pass",
                Some(false) => "miss",
                None => "-",
            }
        ));
    }
    out
}

/// Where the JSON goes: `$CARGO_TARGET_DIR`, else the nearest ancestor of the executable named
/// `target`, else `$CRITERION_HOME/..` (the GPU machine runs the bench from `.gpu/benches/`
/// with `CRITERION_HOME=.gpu/criterion`), else the current directory.
pub fn output_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("CARGO_TARGET_DIR").filter(|d| !d.is_empty()) {
        return PathBuf::from(dir);
    }
    if let Ok(exe) = std::env::current_exe()
        && let Some(dir) = exe
            .ancestors()
            .find(|d| d.file_name().is_some_and(|n| n == "target"))
    {
        return dir.to_path_buf();
    }
    if let Some(home) = std::env::var_os("CRITERION_HOME").filter(|d| !d.is_empty()) {
        let parent = Path::new(&home).join("..");
        if parent.is_dir() {
            return parent;
        }
    }
    PathBuf::from(".")
}

/// Print the table and, if `write_json`, write [`REPORT_FILE`] under [`output_dir`] (and a copy
/// in `$CRITERION_HOME` when that is set), printing each path written.
/// Does nothing if no figure ran (criterion's `--list`, or a filter that matched nothing).
pub fn finish(quick: bool, gpu: Result<(), Unavailable>, write_json: bool) {
    let rows = collect();
    if rows.is_empty() {
        return;
    }
    println!(
        "\n## vmm-bench summary (medians of per-iteration times, one run; p10 - p90 and \
         iterations beside each)\n"
    );
    print!("{}", table(&rows));
    if let Err(reason) = &gpu {
        println!("\nGPU figures skipped: {reason}");
    }
    let fabric_skipped = fabric_skip_reason();
    if let Some(reason) = &fabric_skipped {
        println!("\nFabric figures (gpu-fabric, gpu-fabric-handoff) skipped: {reason}");
    }
    let summaries: Vec<(String, record::Summary)> = record::keys()
        .into_iter()
        .filter_map(|k| record::summary(&k).map(|s| (k, s)))
        .collect();
    if let Some(path) = std::env::var_os(COMPARE_VAR).filter(|p| !p.is_empty()) {
        let now: Vec<(String, f64)> = summaries
            .iter()
            .map(|(k, s)| (k.clone(), s.median_ns))
            .collect();
        match compare::load(Path::new(&path)) {
            Ok(before) => {
                let ratios: Vec<compare::Ratio> = rows
                    .iter()
                    .filter_map(|r| {
                        Some(compare::Ratio {
                            figure: r.figure.clone(),
                            baseline: r.baseline.clone(),
                            ratio: r.ratio?,
                        })
                    })
                    .collect();
                print!("\n{}", compare::tables(&before, &now, &ratios));
            }
            Err(e) => eprintln!("vmm-bench: {COMPARE_VAR}: {e}"),
        }
    }
    println!();
    if !write_json {
        return;
    }
    let medians_ns = summaries
        .iter()
        .map(|(k, s)| (k.clone(), s.median_ns))
        .collect();
    let figures = summaries
        .into_iter()
        .map(|(k, s)| {
            let figure = JsonFigure {
                median_ns: s.median_ns,
                p10_ns: s.p10_ns,
                p90_ns: s.p90_ns,
                iterations: s.iterations,
                kept: s.kept,
            };
            (k, figure)
        })
        .collect();
    let report = JsonReport {
        bench: "vmm-bench",
        quick,
        gpu_skipped: gpu.err().map(|reason| reason.to_string()),
        fabric_skipped,
        note: "medians, p10 and p90 over the kept timed iterations (warm-up included, at most \
               100000 by reservoir sampling: `kept`) of one run; `iterations` counts every \
               timed iteration; ratio = figure / baseline; `interleaved`: figure and baseline \
               ran in one loop, iteration by iteration",
        rows,
        medians_ns,
        figures,
    };
    let json = match serde_json::to_string_pretty(&report) {
        Ok(json) => json + "\n",
        Err(e) => return eprintln!("vmm-bench: could not encode the report: {e}"),
    };
    let mut paths = vec![output_dir().join(REPORT_FILE)];
    // The GPU machine's run.sh brings back only $CRITERION_HOME (as criterion.tar.gz): keep a
    // copy there too.
    if let Some(home) = std::env::var_os("CRITERION_HOME").filter(|d| !d.is_empty()) {
        paths.push(Path::new(&home).join(REPORT_FILE));
    }
    for path in paths {
        if let Some(dir) = path.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        match std::fs::write(&path, &json) {
            Ok(()) => println!("wrote {}", path.display()),
            Err(e) => eprintln!("vmm-bench: could not write {}: {e}", path.display()),
        }
    }
}

/// The JSON report's file name.
pub const REPORT_FILE: &str = "vmm-bench-report.json";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets() {
        // figure 11 / baseline 10 = 1.1x; 13 / 10 = 1.3x.
        assert_eq!(
            Target::RatioAtMost(1.2).verdict(11.0, Some(10.0)),
            Some(true)
        );
        assert_eq!(
            Target::RatioAtMost(1.2).verdict(13.0, Some(10.0)),
            Some(false)
        );
        assert_eq!(Target::RatioAtMost(1.2).verdict(13.0, None), None);
        assert_eq!(Target::Under(1e6).verdict(2e6, None), Some(false));
        assert_eq!(Target::None.verdict(1.0, Some(9.0)), None);
        // 16 chunks: 445 ns against 357 ns adds 5.5 ns a chunk.
        let added = Target::AddedPerChunkAtMost {
            chunks: 16,
            ns: 150.0,
        };
        assert_eq!(added.verdict(445.0, Some(357.0)), Some(true));
        assert_eq!(
            added.verdict(357.0 + 16.0 * 151.0, Some(357.0)),
            Some(false)
        );
        assert_eq!(added.verdict(445.0, None), None);
        assert_eq!(added.describe(), "<= +150 ns/chunk");
    }
}
