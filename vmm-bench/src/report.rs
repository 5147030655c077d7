//! The summary: each figure's median next to its baseline's, the ratio and the target, as a
//! Markdown table on stdout and the same rows as JSON under the target directory.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::Serialize;
use vmm_core::cuda::Unavailable;

use crate::record;

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
    fn describe(self) -> String {
        match self {
            Target::None => "-".to_owned(),
            Target::RatioAtMost(r) => format!("<= {r:.2}x"),
            Target::Under(ns) => format!("< {}", format_ns(ns)),
            Target::AddedPerChunkAtMost { ns, .. } => format!("<= +{}/chunk", format_ns(ns)),
        }
    }

    fn verdict(self, figure_ns: f64, baseline_ns: Option<f64>) -> Option<bool> {
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
}

/// `1.23 ms`, `45.6 us`, `789 ns`.
pub fn format_ns(ns: f64) -> String {
    if ns >= 1e9 {
        format!("{:.3} s", ns / 1e9)
    } else if ns >= 1e6 {
        format!("{:.3} ms", ns / 1e6)
    } else if ns >= 1e3 {
        format!("{:.2} us", ns / 1e3)
    } else {
        format!("{ns:.0} ns")
    }
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
                figure: row.figure,
                median_ns: figure.median_ns,
                iterations: figure.iterations,
                baseline: row.baseline,
                baseline_median_ns: baseline.map(|b| b.median_ns),
                baseline_iterations: baseline.map(|b| b.iterations),
                ratio,
            })
        })
        .collect()
}

/// The Markdown table of every row whose figure ran.
fn table(rows: &[JsonRow]) -> String {
    let mut out = String::from(
        "| figure | median | baseline | baseline median | ratio | target | result |\n\
         |---|---:|---|---:|---:|---|---|\n",
    );
    for r in rows {
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} |\n",
            r.figure,
            format_ns(r.median_ns),
            r.baseline,
            r.baseline_median_ns.map_or("-".to_owned(), format_ns),
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
    println!("\n## vmm-bench summary (medians of per-iteration times, one run)\n");
    print!("{}", table(&rows));
    if let Err(reason) = &gpu {
        println!("\nGPU figures skipped: {reason}");
    }
    let fabric_skipped = fabric_skip_reason();
    if let Some(reason) = &fabric_skipped {
        println!("\nFabric figures (gpu-fabric, gpu-fabric-handoff) skipped: {reason}");
    }
    println!();
    if !write_json {
        return;
    }
    let medians_ns = record::keys()
        .into_iter()
        .filter_map(|k| record::summary(&k).map(|s| (k, s.median_ns)))
        .collect();
    let report = JsonReport {
        bench: "vmm-bench",
        quick,
        gpu_skipped: gpu.err().map(|reason| reason.to_string()),
        fabric_skipped,
        note: "medians over every timed iteration (warm-up included) of one run; ratio = \
               figure / baseline",
        rows,
        medians_ns,
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

    #[test]
    fn formats() {
        assert_eq!(format_ns(12.0), "12 ns");
        assert_eq!(format_ns(1500.0), "1.50 us");
        assert_eq!(format_ns(2.5e6), "2.500 ms");
    }
}
