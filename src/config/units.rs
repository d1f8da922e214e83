//! Human-friendly quantities in the config file: durations ("20s", "5m"), byte sizes ("1MiB") and
//! rates ("120/min"). Parsing lives here so every key that takes one of them reports errors alike.

use std::time::Duration;

/// Parses a duration such as `"250ms"`, `"20s"`, `"5m"`, `"6h"` or `"7d"` (humantime syntax).
pub(crate) fn parse_duration(text: &str) -> Result<Duration, String> {
    let duration = humantime::parse_duration(text.trim()).map_err(|err| {
        format!("invalid duration {text:?} ({err}); use e.g. \"20s\", \"5m\", \"7d\"")
    })?;
    if duration > LONGEST {
        return Err(format!(
            "{text:?} is longer than 100 years; no duration here needs more"
        ));
    }
    Ok(duration)
}

/// The longest duration a setting takes: far beyond any useful one, and short enough that
/// every deadline and stored time computed from it stays in range (a deadline of now plus
/// thousands of years overflows, and a time past year 9999 has no RFC 3339 form).
const LONGEST: Duration = Duration::from_secs(100 * 366 * 86_400);

/// Parses a byte size such as `"1MiB"`, `"512KiB"`, `"64kB"` or a plain number of bytes.
pub(crate) fn parse_size(text: &str) -> Result<u64, String> {
    let trimmed = text.trim();
    let split = trimmed
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(trimmed.len());
    let (digits, unit) = trimmed.split_at(split);
    let number: u64 = digits
        .parse()
        .map_err(|_| format!("invalid size {text:?}; use e.g. \"1MiB\" or \"65536\""))?;
    let multiplier: u64 = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        "kB" | "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        other => {
            return Err(format!(
                "invalid size unit {other:?} in {text:?}; use B, KiB, MiB, GiB, kB, MB or GB"
            ));
        }
    };
    number
        .checked_mul(multiplier)
        .ok_or_else(|| format!("size {text:?} is too large"))
}

/// A rate limit: at most `count` requests per `period`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Rate {
    pub count: u32,
    pub period: Duration,
}

/// Parses a rate such as `"120/min"`, `"10/s"` or `"1000/hour"`.
pub(crate) fn parse_rate(text: &str) -> Result<Rate, String> {
    let invalid =
        || format!("invalid rate {text:?}; use e.g. \"120/min\", \"10/s\", \"1000/hour\"");
    let (count, unit) = text.trim().split_once('/').ok_or_else(invalid)?;
    let count: u32 = count.trim().parse().map_err(|_| invalid())?;
    if count == 0 {
        return Err(format!(
            "rate {text:?} allows nothing; remove rate_limit instead"
        ));
    }
    let period = match unit.trim() {
        "s" | "sec" | "second" => Duration::from_secs(1),
        "m" | "min" | "minute" => Duration::from_secs(60),
        "h" | "hour" => Duration::from_secs(3600),
        "d" | "day" => Duration::from_secs(86_400),
        _ => return Err(invalid()),
    };
    Ok(Rate { count, period })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("20s"), Ok(Duration::from_secs(20)));
        assert_eq!(parse_duration("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_duration("7d"), Ok(Duration::from_secs(7 * 86_400)));
        assert!(parse_duration("soon").is_err());
        // Deadlines computed from a setting must stay in range: no more than 100 years.
        assert!(parse_duration("100y").is_ok());
        assert!(parse_duration("8000y").is_err());
        assert!(parse_duration("200000000000y").is_err());
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("1MiB"), Ok(1 << 20));
        assert_eq!(parse_size("64kB"), Ok(64_000));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert!(parse_size("1 parsec").is_err());
        assert!(parse_size("99999999999999999999GiB").is_err());
    }

    #[test]
    fn rates() {
        assert_eq!(
            parse_rate("120/min"),
            Ok(Rate {
                count: 120,
                period: Duration::from_secs(60)
            })
        );
        assert!(parse_rate("0/s").is_err());
        assert!(parse_rate("fast").is_err());
    }
}
