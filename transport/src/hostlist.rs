//! Slurm hostlist expressions: `node[01-04,07],gpu7,rack[1-2]-n[1-3]`.

use crate::error::Error;

/// Expands a hostlist into host names, in order. Zero-padded ranges keep their width
/// (`n[08-10]` → `n08 n09 n10`). Errors name the offending part.
pub fn expand(list: &str) -> Result<Vec<String>, Error> {
    let mut out = Vec::new();
    for item in split_top(list)? {
        let item = item.trim();
        if item.is_empty() {
            continue;
        }
        let mut names = vec![String::new()];
        let mut rest = item;
        while !rest.is_empty() {
            match rest.find('[') {
                None => {
                    for n in &mut names {
                        n.push_str(rest);
                    }
                    rest = "";
                }
                Some(open) => {
                    let close = rest[open..]
                        .find(']')
                        .map(|c| open + c)
                        .ok_or_else(|| Error::Invalid(format!("hostlist {item:?}: '[' without ']'")))?;
                    let prefix = &rest[..open];
                    let alts = ranges(&rest[open + 1..close])
                        .map_err(|e| Error::Invalid(format!("hostlist {item:?}: {e}")))?;
                    if names.len().saturating_mul(alts.len()) > HOSTS_MAX {
                        return Err(Error::Invalid(format!(
                            "hostlist {item:?} expands to more than {HOSTS_MAX} hosts"
                        )));
                    }
                    names = names
                        .iter()
                        .flat_map(|n| alts.iter().map(move |a| format!("{n}{prefix}{a}")))
                        .collect();
                    rest = &rest[close + 1..];
                }
            }
        }
        out.extend(names);
    }
    Ok(out)
}

/// Hosts one expression may name.
const HOSTS_MAX: usize = 65_536;

/// Splits at commas outside brackets.
pub fn split_top(s: &str) -> Result<Vec<&str>, Error> {
    let (mut depth, mut start, mut out) = (0i32, 0, Vec::new());
    for (i, c) in s.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth -= 1,
            ',' if depth == 0 => {
                out.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
        if !(0..=1).contains(&depth) {
            return Err(Error::Invalid(format!("hostlist {s:?}: unbalanced or nested brackets")));
        }
    }
    if depth != 0 {
        return Err(Error::Invalid(format!("hostlist {s:?}: '[' without ']'")));
    }
    out.push(&s[start..]);
    Ok(out)
}

/// `01-04,07` → `01 02 03 04 07`.
fn ranges(body: &str) -> Result<Vec<String>, Error> {
    let mut out = Vec::new();
    for part in body.split(',') {
        let part = part.trim();
        let (a, b) = part.split_once('-').unwrap_or((part, part));
        let bad = || Error::Invalid(format!("bad range {part:?}"));
        if a.is_empty() || !a.bytes().all(|c| c.is_ascii_digit()) || !b.bytes().all(|c| c.is_ascii_digit()) {
            return Err(bad());
        }
        let (lo, hi): (u64, u64) = (a.parse().map_err(|_| bad())?, b.parse().map_err(|_| bad())?);
        if hi < lo || hi - lo >= HOSTS_MAX as u64 {
            return Err(bad());
        }
        let width = if a.starts_with('0') { a.len() } else { 0 };
        out.extend((lo..=hi).map(|n| format!("{n:0width$}")));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::expand;

    #[test]
    fn expands_slurm_syntax() {
        assert_eq!(
            expand("node[01-04,07]").unwrap(),
            ["node01", "node02", "node03", "node04", "node07"]
        );
        assert_eq!(expand("a,b[1-2],c").unwrap(), ["a", "b1", "b2", "c"]);
        assert_eq!(expand("n[8-10]").unwrap(), ["n8", "n9", "n10"]);
        assert_eq!(expand("n[08-10]").unwrap(), ["n08", "n09", "n10"]);
        assert_eq!(expand("r[1-2]-g[1-2]").unwrap(), ["r1-g1", "r1-g2", "r2-g1", "r2-g2"]);
        assert_eq!(expand("single").unwrap(), ["single"]);
        assert_eq!(expand("").unwrap(), Vec::<String>::new());
    }

    #[test]
    fn rejects_malformed_lists() {
        for bad in ["n[1-", "n[a-b]", "n[3-1]", "n[[1]]", "n]1[", "n[0-99999999]", "n[-3]"] {
            assert!(expand(bad).is_err(), "{bad:?} was accepted");
        }
    }
}
