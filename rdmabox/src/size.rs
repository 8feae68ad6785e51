//! Human sizes for flags: "4096", "64K", "928KiB", "7M", "8G".

/// Parses a byte count with an optional binary unit (K, M, G, T; "KB" and "KiB" alike);
/// the error says what was wrong, for a flag parser to show.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("bad size {s:?}: expected a number with an optional K, M, G or T"))?;
    let mult: u64 = match unit.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 1,
        "K" | "KB" | "KIB" => 1 << 10,
        "M" | "MB" | "MIB" => 1 << 20,
        "G" | "GB" | "GIB" => 1 << 30,
        "T" | "TB" | "TIB" => 1 << 40,
        other => {
            return Err(format!(
                "bad size {s:?}: unknown unit {other:?} (use K, M, G or T)"
            ))
        }
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("size {s:?} is too large"))
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("64K").unwrap(), 64 << 10);
        assert_eq!(parse_size("928KiB").unwrap(), 928 << 10);
        assert_eq!(parse_size("8g").unwrap(), 8 << 30);
        assert!(parse_size("").is_err());
        assert!(parse_size("12X").is_err());
        assert!(parse_size("-1").is_err());
        assert!(parse_size("99999999999T").is_err());
    }
}
