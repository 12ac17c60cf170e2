//! A checksum as a manifest holds it: an xxh3-64, written in the JSON as 16 lowercase hex
//! digits and parsed to a number once, when the manifest is read. Nothing past that boundary
//! handles the text.

use std::fmt;

use serde::{de, Deserialize, Deserializer, Serialize, Serializer};

/// An xxh3-64 checksum (of a shard, a sidecar, a foreign object, a sample index or a shard
/// table). Serialises as 16 lowercase hex digits; anything else is refused when parsed.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Checksum(pub u64);

impl Checksum {
    /// The checksum as a number.
    pub fn get(self) -> u64 {
        self.0
    }

    /// Parses 16 lowercase hex digits (the only form a manifest writes).
    pub fn parse(s: &str) -> Option<Checksum> {
        let digits = s.len() == 16 && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
        digits.then(|| u64::from_str_radix(s, 16).ok().map(Checksum))?
    }
}

impl From<u64> for Checksum {
    fn from(v: u64) -> Checksum {
        Checksum(v)
    }
}

impl PartialEq<u64> for Checksum {
    fn eq(&self, o: &u64) -> bool {
        self.0 == *o
    }
}

impl fmt::Display for Checksum {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

impl fmt::Debug for Checksum {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "\"{:016x}\"", self.0)
    }
}

impl Serialize for Checksum {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Checksum {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Checksum, D::Error> {
        let s = std::borrow::Cow::<str>::deserialize(d)?;
        Checksum::parse(&s).ok_or_else(|| de::Error::custom(format!("checksum {s:?} is not 16 lowercase hex digits")))
    }
}

#[cfg(test)]
mod tests {
    use super::Checksum;

    #[test]
    fn only_sixteen_lowercase_hex_digits_parse_and_they_round_trip() {
        let c = Checksum(0x00ab_cdef_0123_4567);
        let json = serde_json::to_string(&c).unwrap();
        assert_eq!(json, "\"00abcdef01234567\"");
        assert_eq!(serde_json::from_str::<Checksum>(&json).unwrap(), c);
        for bad in [
            "\"00ABCDEF01234567\"",
            "\"abc\"",
            "\"00abcdef012345678\"",
            "\"+0abcdef01234567\"",
            "17",
        ] {
            let e = serde_json::from_str::<Checksum>(bad).unwrap_err().to_string();
            assert!(bad == "17" || e.contains("16 lowercase hex digits"), "{bad}: {e}");
        }
    }
}
