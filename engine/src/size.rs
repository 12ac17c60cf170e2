//! Byte counts written for people: `64MiB`, `64M`, `1.5GB`, `4096`.

use crate::error::Invalid;

/// Parses a byte count: a number with an optional unit, binary (`k`/`KiB`, `m`/`MiB`, `g`/`GiB`,
/// `t`/`TiB`) or decimal (`KB`, `MB`, `GB`, `TB`); no unit, or `B`, is bytes.
pub fn parse(s: &str) -> Result<u64, Invalid> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let v: f64 = num.parse().map_err(|_| Invalid::from(format!("{s:?} is not a size")))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "kb" => 1000,
        "m" | "mib" => 1 << 20,
        "mb" => 1_000_000,
        "g" | "gib" => 1 << 30,
        "gb" => 1_000_000_000,
        "t" | "tib" => 1 << 40,
        "tb" => 1_000_000_000_000,
        other => return Err(Invalid::from(format!("unknown size unit {other:?} in {s:?}"))),
    };
    let bytes = v * mult as f64;
    if bytes >= u64::MAX as f64 {
        return Err(Invalid::from(format!("{s:?} is more bytes than a 64-bit count holds")));
    }
    Ok(bytes as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse("64MiB").unwrap(), 64 << 20);
        assert_eq!(parse("4096").unwrap(), 4096);
        assert_eq!(parse("1.5k").unwrap(), 1536);
        assert_eq!(parse("2TiB").unwrap(), 2 << 40);
        assert_eq!(parse("1GB").unwrap(), 1_000_000_000);
        assert!(parse("12 parsecs").is_err());
        assert!(parse("abc").is_err());
        let e = parse("99999999999999999999GiB").unwrap_err();
        assert!(e.contains("more bytes than a 64-bit count holds"), "{e}");
    }
}
