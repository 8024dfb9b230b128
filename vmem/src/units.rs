//! Byte sizes as people write them: `64K`, `256KiB`, `2M`, `40GiB`, `4096`.

use crate::error::{Result, VmemError};

/// Parses a size with an optional binary suffix (K, M, G, T, with or without `iB`/`B`).
pub fn parse_bytes(s: &str) -> Result<u64> {
    let t = s.trim();
    let digits = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, suffix) = t.split_at(digits);
    let bad = || {
        VmemError::InvalidConfig(format!(
            "cannot read size {} (e.g. 64K, 2M, 40GiB)",
            quoted(s)
        ))
    };
    let n: u64 = num.parse().map_err(|_| bad())?;
    let shift = match suffix
        .trim()
        .to_ascii_uppercase()
        .trim_end_matches("IB")
        .trim_end_matches('B')
    {
        "" => 0,
        "K" => 10,
        "M" => 20,
        "G" => 30,
        "T" => 40,
        _ => return Err(bad()),
    };
    n.checked_mul(1u64 << shift)
        .ok_or(VmemError::SizeOverflow("size"))
}

/// Formats bytes compactly: `64K`, `2M`, `1.5G`.
pub fn format_bytes(b: u64) -> String {
    const UNITS: [(&str, u64); 4] = [
        ("T", 1 << 40),
        ("G", 1 << 30),
        ("M", 1 << 20),
        ("K", 1 << 10),
    ];
    for (u, v) in UNITS {
        if b >= v {
            return if b.is_multiple_of(v) {
                format!("{}{u}", b / v)
            } else {
                format!("{:.2}{u}", b as f64 / v as f64)
            };
        }
    }
    format!("{b}")
}

/// Most characters of a value a message quotes (see [`quoted`]).
pub const QUOTED_CHARS: usize = 40;

/// `s` quoted as `{:?}` would, cut to [`QUOTED_CHARS`] characters and marked with `...` when
/// longer: a message names a value without echoing megabytes of it.
pub fn quoted(s: &str) -> String {
    match s.char_indices().nth(QUOTED_CHARS) {
        None => format!("{s:?}"),
        Some((end, _)) => format!("{:?}...", &s[..end]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_round_trip() {
        assert_eq!(parse_bytes("64K").unwrap(), 65536);
        assert_eq!(parse_bytes("256KiB").unwrap(), 262_144);
        assert_eq!(parse_bytes("2MB").unwrap(), 2 << 20);
        assert_eq!(parse_bytes("40GiB").unwrap(), 40 << 30);
        assert_eq!(parse_bytes("4096").unwrap(), 4096);
        assert!(parse_bytes("2X").is_err());
        assert!(parse_bytes("").is_err());
        assert!(parse_bytes("99999999999T").is_err());
        assert_eq!(format_bytes(2 << 20), "2M");
        assert_eq!(format_bytes(1536 << 20), "1.50G");
        assert_eq!(format_bytes(100), "100");
    }

    #[test]
    fn long_values_are_cut_where_quoted() {
        assert_eq!(quoted("ab"), "\"ab\"");
        let long = "é".repeat(100_000);
        let q = quoted(&long);
        assert_eq!(q, format!("{:?}...", "é".repeat(QUOTED_CHARS)));
        let e = parse_bytes(&long).unwrap_err().to_string();
        assert!(e.len() < 200, "{e}");
    }
}
