//! How the summary and the comparison write a time.

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats() {
        assert_eq!(format_ns(12.0), "12 ns");
        assert_eq!(format_ns(1500.0), "1.50 us");
        assert_eq!(format_ns(2.5e6), "2.500 ms");
    }
}
