//! Kubernetes quantities as whole bytes.
//!
//! VRAM budgets and model sizes are written as Kubernetes quantities
//! (`16000Mi`, `80Gi`, `1.5G`, `12e9`, or plain bytes). The engine works in
//! `u64` bytes, so this module converts both ways, exactly: no floats.
//! Fractions of a byte round up, as `resource.Quantity.Value()` does.

use crate::engine::Bytes;

/// Why a string is not a byte quantity.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum QuantityError {
    #[error("empty quantity")]
    Empty,
    #[error(
        "{0:?} is not a quantity: expected a number with an optional unit (Ki, Mi, Gi, Ti, Pi, Ei, k, M, G, T, P, E)"
    )]
    Malformed(String),
    #[error(
        "{input:?} has an unknown unit {unit:?}; use one of Ki, Mi, Gi, Ti, Pi, Ei, k, M, G, T, P, E"
    )]
    UnknownUnit { input: String, unit: String },
    #[error("{0:?} is negative; sizes must be positive")]
    Negative(String),
    #[error("{0:?} is too large (more than 2^64 - 1 bytes)")]
    Overflow(String),
}

/// Parses a Kubernetes quantity into whole bytes (rounded up).
pub fn parse_bytes(input: &str) -> Result<Bytes, QuantityError> {
    let s = input.trim();
    if s.is_empty() {
        return Err(QuantityError::Empty);
    }
    // Fast path for plain byte counts, as in long traces.
    if s.len() <= 19 && s.bytes().all(|b| b.is_ascii_digit()) {
        return s
            .parse()
            .map_err(|_| QuantityError::Overflow(input.to_owned()));
    }
    let malformed = || QuantityError::Malformed(input.to_owned());
    let (negative, rest) = match s.as_bytes()[0] {
        b'-' => (true, &s[1..]),
        b'+' => (false, &s[1..]),
        _ => (false, s),
    };
    let number_len = rest
        .bytes()
        .position(|b| !(b.is_ascii_digit() || b == b'.'))
        .unwrap_or(rest.len());
    let (number, unit) = rest.split_at(number_len);
    let (int_part, frac_part) = number.split_once('.').unwrap_or((number, ""));
    if int_part.is_empty() && frac_part.is_empty() || frac_part.contains('.') {
        return Err(malformed());
    }
    // mantissa / 10^frac_digits, in u128 so 38 significant digits are exact.
    let digits = format!("{int_part}{frac_part}");
    let digits = digits.trim_start_matches('0');
    if digits.len() > 38 {
        return Err(QuantityError::Overflow(input.to_owned()));
    }
    let mantissa: u128 = if digits.is_empty() {
        0
    } else {
        digits.parse().map_err(|_| malformed())?
    };
    if negative && mantissa != 0 {
        return Err(QuantityError::Negative(input.to_owned()));
    }
    // `den` is None past u128: the value is then below one byte (the
    // mantissa has at most 38 digits), and rounds up as any fraction does.
    // (A quantity the CRD admits may have more than 38 fractional digits:
    // `10u128.pow` overflowed, a panic in debug builds.)
    let pow10 = |n: u32| 10u128.checked_pow(n);
    let (mut num, mut den) = (1u128, u32::try_from(frac_part.len()).ok().and_then(pow10));
    match unit {
        "" => {}
        "Ki" | "Mi" | "Gi" | "Ti" | "Pi" | "Ei" => {
            let power = 1 + "KMGTPE".find(&unit[..1]).unwrap_or(0) as u32;
            num = 1u128 << (10 * power);
        }
        "n" => den = den.and_then(|d| d.checked_mul(1_000_000_000)),
        "u" => den = den.and_then(|d| d.checked_mul(1_000_000)),
        "m" => den = den.and_then(|d| d.checked_mul(1_000)),
        "k" | "M" | "G" | "T" | "P" | "E" => {
            let power = 1 + "kMGTPE".find(unit).unwrap_or(0) as u32;
            num = 10u128.pow(3 * power);
        }
        _ if unit.starts_with(['e', 'E']) => {
            let exp: i32 = unit[1..].parse().map_err(|_| malformed())?;
            if exp.unsigned_abs() > 30 {
                return Err(QuantityError::Overflow(input.to_owned()));
            }
            if exp >= 0 {
                num = 10u128.pow(exp as u32);
            } else {
                den = den.and_then(|d| d.checked_mul(pow10(exp.unsigned_abs())?));
            }
        }
        _ if unit.chars().all(|c| c.is_ascii_alphabetic()) => {
            return Err(QuantityError::UnknownUnit {
                input: input.to_owned(),
                unit: unit.to_owned(),
            });
        }
        _ => return Err(malformed()),
    }
    let scaled = mantissa
        .checked_mul(num)
        .ok_or_else(|| QuantityError::Overflow(input.to_owned()))?;
    let Some(den) = den else {
        return Ok(Bytes::from(scaled > 0));
    };
    Bytes::try_from(scaled.div_ceil(den)).map_err(|_| QuantityError::Overflow(input.to_owned()))
}

/// Formats bytes as the shortest exact quantity a person reads easily: a
/// binary unit (`16000Mi`, `21740Mi`, `1.5Gi`), a decimal one (`8G`, not
/// `7812500Ki`), or plain bytes, with at most three decimals, preferring a
/// binary unit on a tie. Exact, so [`parse_bytes`] reads back the same
/// number (status fields are read back).
pub fn format_bytes(bytes: Bytes) -> String {
    const BINARY: [(&str, u128); 6] = [
        ("Ei", 1 << 60),
        ("Pi", 1 << 50),
        ("Ti", 1 << 40),
        ("Gi", 1 << 30),
        ("Mi", 1 << 20),
        ("Ki", 1 << 10),
    ];
    const DECIMAL: [(&str, u128); 6] = [
        ("E", 1_000_000_000_000_000_000),
        ("P", 1_000_000_000_000_000),
        ("T", 1_000_000_000_000),
        ("G", 1_000_000_000),
        ("M", 1_000_000),
        ("k", 1_000),
    ];
    let units = BINARY.iter().chain(&DECIMAL);
    let candidates = units
        .filter(|&&(_, unit)| u128::from(bytes) >= unit)
        .filter_map(|&(suffix, unit)| exact(bytes, unit, suffix));
    // The first of the shortest: larger units, binary ones, come first.
    candidates
        .chain([bytes.to_string()])
        .reduce(|best, c| if c.len() < best.len() { c } else { best })
        .unwrap_or_default()
}

/// Like [`format_bytes`], but a number no unit says in a few characters
/// is shown in the largest binary unit it fills, rounded down to two
/// decimals (`21.23Gi`, not `22795943680` or `22046100Ki`). For status
/// figures people read and nothing reads back exactly (used, peak):
/// rounding down never shows a residency over its budget.
pub fn format_bytes_rounded(bytes: Bytes) -> String {
    // `16000Mi` reads well; `22046100Ki` does not.
    const SHORT: usize = 7;
    let exact = format_bytes(bytes);
    if bytes < 1 << 10 || exact.len() <= SHORT {
        return exact;
    }
    let (suffix, shift) = [
        ("Ei", 60),
        ("Pi", 50),
        ("Ti", 40),
        ("Gi", 30),
        ("Mi", 20),
        ("Ki", 10),
    ]
    .into_iter()
    .find(|&(_, shift)| bytes >> shift > 0)
    .expect("at least 1Ki");
    let hundredths = (u128::from(bytes) * 100) >> shift;
    format!("{}.{:02}{suffix}", hundredths / 100, hundredths % 100)
}

/// `bytes` in `unit`, if at most three decimals say it exactly.
fn exact(bytes: Bytes, unit: u128, suffix: &str) -> Option<String> {
    let b = u128::from(bytes);
    let (whole, rest) = (b / unit, b % unit);
    if (rest * 1000) % unit != 0 {
        return None;
    }
    let thousandths = rest * 1000 / unit;
    if thousandths == 0 {
        return Some(format!("{whole}{suffix}"));
    }
    let fraction = format!("{thousandths:03}");
    Some(format!(
        "{whole}.{}{suffix}",
        fraction.trim_end_matches('0')
    ))
}

/// A duration as the spec writes one (`90s`, `10m`, `1h30m`, `500ms`,
/// `0s`: a keepAlive, a sleep's timeout or delay); `None` if it is not one
/// or is negative.
pub fn parse_duration(s: &str) -> Option<std::time::Duration> {
    let d: k8s_openapi::jiff::SignedDuration = s.trim().parse().ok()?;
    std::time::Duration::try_from(d).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    const MI: u64 = 1 << 20;

    #[test]
    fn parses_the_units_kubernetes_uses() {
        let cases: &[(&str, u64)] = &[
            ("0", 0),
            ("123", 123),
            ("16000Mi", 16000 * MI),
            ("80Gi", 80 << 30),
            ("1Ki", 1024),
            ("1Ei", 1 << 60),
            ("1k", 1000),
            ("1.5G", 1_500_000_000),
            ("12e9", 12_000_000_000),
            ("12E3", 12_000),
            ("1.5Ki", 1536),
            ("0.5", 1),   // a fraction of a byte rounds up
            ("1500m", 2), // 1.5 bytes rounds up
            (" 7Mi ", 7 * MI),
            ("+3", 3),
            ("-0", 0),
            ("18446744073709551615", u64::MAX),
            // More fractional digits than u128 holds as a power of ten
            // (the CRD admits them): a fraction of a byte, rounded up.
            (
                concat!("0.", "0000000000", "0000000000", "0000000000", "0000000001"),
                1,
            ),
            (
                concat!("0.", "0000000000", "0000000000", "0000000000", "0000000000"),
                0,
            ),
            (
                concat!("0.", "0000000000", "0000000000", "0000000001", "n"),
                1,
            ),
            ("1e-30", 1),
        ];
        for &(input, want) in cases {
            assert_eq!(parse_bytes(input), Ok(want), "{input}");
        }
    }

    #[test]
    fn rejects_what_is_not_a_byte_quantity() {
        assert_eq!(parse_bytes(""), Err(QuantityError::Empty));
        assert!(matches!(
            parse_bytes("-5Mi"),
            Err(QuantityError::Negative(_))
        ));
        assert!(matches!(
            parse_bytes("16000MB"),
            Err(QuantityError::UnknownUnit { unit, .. }) if unit == "MB"
        ));
        for bad in ["Mi", "1.2.3", "abc", "1 Mi", "1e", "..", "1e99"] {
            assert!(parse_bytes(bad).is_err(), "{bad} should be rejected");
        }
        assert!(matches!(
            parse_bytes("16Ei"),
            Err(QuantityError::Overflow(_))
        ));
        assert!(matches!(
            parse_bytes("18446744073709551616"),
            Err(QuantityError::Overflow(_))
        ));
    }

    #[test]
    fn formats_the_shortest_exact_unit() {
        assert_eq!(format_bytes(0), "0");
        assert_eq!(format_bytes(1000), "1k");
        assert_eq!(format_bytes(8_000_000_000), "8G", "not 7812500Ki");
        assert_eq!(
            format_bytes(22_795_943_680),
            "22795943680",
            "no unit says it exactly"
        );
        assert_eq!(format_bytes_rounded(22_795_943_680), "21.23Gi");
        assert_eq!(
            format_bytes_rounded(16000 * MI),
            "16000Mi",
            "exact stays exact"
        );
        assert_eq!(format_bytes_rounded(1023), "1023");
        assert_eq!(
            format_bytes_rounded(22_575_206_400),
            "21.02Gi",
            "not 22046100Ki"
        );
        assert_eq!(
            format_bytes_rounded((16 << 30) - 1),
            "15.99Gi",
            "never rounds up past a budget"
        );
        assert_eq!(format_bytes(3 << 29), "1.5Gi");
        assert_eq!(format_bytes(1_250_000_000), "1.25G");
        assert_eq!(format_bytes(16000 * MI), "16000Mi");
        assert_eq!(format_bytes(80 << 30), "80Gi");
        assert_eq!(format_bytes(1536), "1536");
        assert_eq!(format_bytes(1 << 60), "1Ei");
        for b in [
            1u64,
            1023,
            1024,
            10900 * MI,
            u64::MAX,
            3 << 40,
            1_234_567,
            8_000_000_001,
        ] {
            assert_eq!(parse_bytes(&format_bytes(b)), Ok(b));
        }
    }
}
