//! A rerun's check: this run's medians next to an earlier run's (its `vmm-bench-report.json`),
//! with the change and whether it is within [`AGREE`]; then the same for each row's ratio
//! (figure / baseline). Two runs of one build whose figures agree within that are what a
//! figure needs before its ratio is worth quoting. Where the machine's load moves between runs,
//! interleaved figures move together and their ratios still agree.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::units::format_ns;

/// The largest relative change of a median between two runs of one build that still counts as
/// agreement (15%).
pub const AGREE: f64 = 0.15;

/// Why an earlier report could not be read.
#[derive(Debug, thiserror::Error)]
pub enum CompareError {
    /// The file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The report's path.
        path: PathBuf,
        /// What the read said.
        source: std::io::Error,
    },
    /// The file is not a report (no `medians_ns` object of numbers).
    #[error("{path} is not a vmm-bench report: {source}")]
    Parse {
        /// The report's path.
        path: PathBuf,
        /// What the JSON parser said.
        source: serde_json::Error,
    },
}

#[derive(Debug, Deserialize)]
struct EarlierReport {
    medians_ns: BTreeMap<String, f64>,
    #[serde(default)]
    rows: Vec<EarlierRow>,
}

#[derive(Debug, Deserialize)]
struct EarlierRow {
    figure: String,
    baseline: String,
    ratio: Option<f64>,
}

/// One row's ratio: figure / baseline (of the medians).
#[derive(Debug, Clone, PartialEq)]
pub struct Ratio {
    /// The figure's key.
    pub figure: String,
    /// The baseline's key.
    pub baseline: String,
    /// figure / baseline.
    pub ratio: f64,
}

/// What an earlier report says: its medians by figure key, and its rows' ratios.
#[derive(Debug, Clone, Default)]
pub struct Earlier {
    /// Medians in nanoseconds, by figure key.
    pub medians_ns: BTreeMap<String, f64>,
    /// Each row's ratio (rows without one are left out).
    pub ratios: Vec<Ratio>,
}

/// The medians and ratios of the report at `path`.
pub fn load(path: &Path) -> Result<Earlier, CompareError> {
    let text = std::fs::read_to_string(path).map_err(|source| CompareError::Read {
        path: path.to_owned(),
        source,
    })?;
    let report: EarlierReport =
        serde_json::from_str(&text).map_err(|source| CompareError::Parse {
            path: path.to_owned(),
            source,
        })?;
    let ratios = report
        .rows
        .into_iter()
        .filter_map(|row| {
            Some(Ratio {
                ratio: row.ratio?,
                figure: row.figure,
                baseline: row.baseline,
            })
        })
        .collect();
    Ok(Earlier {
        medians_ns: report.medians_ns,
        ratios,
    })
}

/// `now / before - 1`, or `None` where `before` is not positive.
pub fn change(before: f64, now: f64) -> Option<f64> {
    (before > 0.0).then(|| now / before - 1.0)
}

/// Whether two medians agree within [`AGREE`] (of the earlier one).
pub fn agrees(before: f64, now: f64) -> bool {
    before > 0.0 && (now - before).abs() <= AGREE * before
}

/// The Markdown tables of every median, then every ratio, of this run that `before` has too,
/// each with a count line.
pub fn tables(before: &Earlier, medians: &[(String, f64)], ratios: &[Ratio]) -> String {
    format!(
        "{}\n{}",
        table(&before.medians_ns, medians),
        ratio_table(&before.ratios, ratios)
    )
}

/// The Markdown table of every figure of `now` that `before` has too, and a count line.
pub fn table(before: &BTreeMap<String, f64>, now: &[(String, f64)]) -> String {
    let mut out = String::from(
        "## compared with the earlier run\n\n\
         | figure | earlier median | this median | change | within 15% |\n\
         |---|---:|---:|---:|---|\n",
    );
    let (mut compared, mut agreeing) = (0, 0);
    for (key, now_ns) in now {
        let Some(&before_ns) = before.get(key) else {
            continue;
        };
        compared += 1;
        let agree = agrees(before_ns, *now_ns);
        agreeing += usize::from(agree);
        out.push_str(&format!(
            "| {key} | {} | {} | {} | {} |\n",
            format_ns(before_ns),
            format_ns(*now_ns),
            change(before_ns, *now_ns).map_or("-".to_owned(), |c| format!("{:+.1}%", c * 100.0)),
            if agree { "yes" } else { "no" }
        ));
    }
    out.push_str(&format!(
        "\n{agreeing} of {compared} figures agree with the earlier run within 15%.\n"
    ));
    out
}

/// The Markdown table of every ratio of `now` whose row `before` has too, and a count line.
pub fn ratio_table(before: &[Ratio], now: &[Ratio]) -> String {
    let mut out = String::from(
        "## ratios compared with the earlier run\n\n\
         | figure | baseline | earlier ratio | this ratio | change | within 15% |\n\
         |---|---|---:|---:|---:|---|\n",
    );
    let (mut compared, mut agreeing) = (0, 0);
    for r in now {
        let Some(earlier) = before
            .iter()
            .find(|b| b.figure == r.figure && b.baseline == r.baseline)
        else {
            continue;
        };
        compared += 1;
        let agree = agrees(earlier.ratio, r.ratio);
        agreeing += usize::from(agree);
        out.push_str(&format!(
            "| {} | {} | {:.3}x | {:.3}x | {} | {} |\n",
            r.figure,
            r.baseline,
            earlier.ratio,
            r.ratio,
            change(earlier.ratio, r.ratio)
                .map_or("-".to_owned(), |c| format!("{:+.1}%", c * 100.0)),
            if agree { "yes" } else { "no" }
        ));
    }
    out.push_str(&format!(
        "\n{agreeing} of {compared} ratios agree with the earlier run within 15%.\n"
    ));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agreement_is_relative_to_the_earlier_run() {
        assert!(agrees(100.0, 115.0));
        assert!(agrees(100.0, 85.0));
        assert!(!agrees(100.0, 116.0));
        assert!(!agrees(0.0, 1.0));
        assert_eq!(change(200.0, 100.0), Some(-0.5));
    }

    #[test]
    fn the_table_counts_what_both_runs_have() {
        let before = BTreeMap::from([("g/a".to_owned(), 100.0), ("g/b".to_owned(), 100.0)]);
        let now = [
            ("g/a".to_owned(), 110.0),
            ("g/b".to_owned(), 200.0),
            ("g/new".to_owned(), 5.0),
        ];
        let table = table(&before, &now);
        assert!(
            table.contains("| g/a | 100 ns | 110 ns | +10.0% | yes |"),
            "{table}"
        );
        assert!(
            table.contains("| g/b | 100 ns | 200 ns | +100.0% | no |"),
            "{table}"
        );
        assert!(!table.contains("g/new"), "{table}");
        assert!(table.contains("1 of 2 figures agree"), "{table}");
    }

    #[test]
    fn ratios_are_compared_row_by_row() {
        let ratio = |figure: &str, ratio| Ratio {
            figure: figure.to_owned(),
            baseline: "g/base".to_owned(),
            ratio,
        };
        let before = [ratio("g/a", 1.0), ratio("g/b", 2.0)];
        let now = [ratio("g/a", 1.1), ratio("g/b", 1.0), ratio("g/c", 3.0)];
        let table = ratio_table(&before, &now);
        assert!(
            table.contains("| g/a | g/base | 1.000x | 1.100x | +10.0% | yes |"),
            "{table}"
        );
        assert!(
            table.contains("| g/b | g/base | 2.000x | 1.000x | -50.0% | no |"),
            "{table}"
        );
        assert!(!table.contains("g/c"), "{table}");
        assert!(table.contains("1 of 2 ratios agree"), "{table}");
    }

    #[test]
    fn a_missing_or_foreign_file_is_a_typed_error() {
        let dir = std::env::temp_dir().join(format!("vmm-bench-compare-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert!(matches!(
            load(&dir.join("absent.json")),
            Err(CompareError::Read { .. })
        ));
        let foreign = dir.join("foreign.json");
        std::fs::write(&foreign, "{\"rows\": []}").unwrap();
        assert!(matches!(load(&foreign), Err(CompareError::Parse { .. })));
        let good = dir.join("good.json");
        std::fs::write(
            &good,
            "{\"medians_ns\": {\"g/a\": 12.5}, \"rows\": [{\"figure\": \"g/a\", \
             \"baseline\": \"g/b\", \"ratio\": 1.5}, {\"figure\": \"g/a\", \"baseline\": \
             \"g/c\", \"ratio\": null}]}",
        )
        .unwrap();
        let earlier = load(&good).unwrap();
        assert_eq!(earlier.medians_ns["g/a"], 12.5);
        assert_eq!(
            earlier.ratios,
            [Ratio {
                figure: "g/a".into(),
                baseline: "g/b".into(),
                ratio: 1.5
            }]
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
