//! The consistent-hash ring: which daemon owns which shard, and how membership changes.

use std::collections::BTreeSet;

use ramjet_engine::cache::ShardId;
use xxhash_rust::xxh3::xxh3_64;

/// Virtual nodes per member by default: keeps the largest share within a few percent of 1/N.
pub const VNODES_DEFAULT: usize = 160;

/// A ring over a set of members (`host:port` names). Each member places `vnodes` points; a
/// key belongs to the member of the first point at or after the key's hash.
#[derive(Debug, Clone)]
pub struct Ring {
    version: u64,
    members: Vec<String>,
    points: Vec<(u64, u32)>,
}

impl Ring {
    /// A ring over `members` (deduplicated and sorted, so every host builds the same ring).
    pub fn new(version: u64, members: impl IntoIterator<Item = String>, vnodes: usize) -> Ring {
        let members: Vec<String> = members.into_iter().collect::<BTreeSet<_>>().into_iter().collect();
        let mut points = Vec::with_capacity(members.len() * vnodes);
        for (i, m) in members.iter().enumerate() {
            for v in 0..vnodes.max(1) {
                points.push((xxh3_64(format!("{m}#{v}").as_bytes()), i as u32));
            }
        }
        points.sort_unstable();
        Ring {
            version,
            members,
            points,
        }
    }

    /// Version: bumped on every applied membership change.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// Members, sorted.
    pub fn members(&self) -> &[String] {
        &self.members
    }

    /// The member owning `key`, or `None` for an empty ring.
    pub fn owner_of_hash(&self, key: u64) -> Option<&str> {
        if self.points.is_empty() {
            return None;
        }
        let i = self.points.partition_point(|p| p.0 < key);
        let (_, m) = self.points[if i == self.points.len() { 0 } else { i }];
        Some(&self.members[m as usize])
    }

    /// The member owning a shard.
    pub fn owner(&self, id: ShardId) -> Option<&str> {
        self.owner_of_hash(key_hash(id))
    }
}

/// A shard's position on the ring: a hash of its content identity, so the same shard in two
/// datasets has one owner.
pub fn key_hash(id: ShardId) -> u64 {
    let mut b = [0u8; 16];
    b[..8].copy_from_slice(&id.checksum.to_le_bytes());
    b[8..].copy_from_slice(&id.bytes.to_le_bytes());
    xxh3_64(&b)
}

/// The ring in use plus a pending membership change. While frozen (a training run is inside
/// an epoch), changes wait; the last freeze released applies the newest pending one.
#[derive(Debug)]
pub struct Membership {
    ring: Ring,
    pending: Option<Vec<String>>,
    freezes: u32,
    vnodes: usize,
}

impl Membership {
    /// Starts at version 1 with `members`.
    pub fn new(members: Vec<String>, vnodes: usize) -> Membership {
        Membership {
            ring: Ring::new(1, members, vnodes),
            pending: None,
            freezes: 0,
            vnodes,
        }
    }

    /// The ring in use.
    pub fn ring(&self) -> &Ring {
        &self.ring
    }

    /// Whether changes are held back.
    pub fn frozen(&self) -> bool {
        self.freezes > 0
    }

    /// A membership change waiting for the last unfreeze.
    pub fn pending(&self) -> Option<&[String]> {
        self.pending.as_deref()
    }

    /// Proposes a member set. Applied at once unless frozen; a set equal to the current one
    /// changes nothing. Returns whether the ring changed now.
    pub fn propose(&mut self, members: Vec<String>) -> bool {
        let set: BTreeSet<String> = members.into_iter().collect();
        if set.iter().eq(self.ring.members.iter()) {
            self.pending = None;
            return false;
        }
        if self.frozen() {
            self.pending = Some(set.into_iter().collect());
            return false;
        }
        self.ring = Ring::new(self.ring.version + 1, set, self.vnodes);
        true
    }

    /// Holds the ring version (counted: every freeze needs its unfreeze).
    pub fn freeze(&mut self) {
        self.freezes += 1;
    }

    /// Releases one freeze; the last one applies a pending change. Returns whether the ring
    /// changed.
    pub fn unfreeze(&mut self) -> bool {
        self.freezes = self.freezes.saturating_sub(1);
        match (self.freezes, self.pending.take()) {
            (0, Some(m)) => self.propose(m),
            (_, p) => {
                self.pending = p;
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(n: u64) -> Vec<ShardId> {
        (0..n)
            .map(|i| ShardId {
                checksum: xxh3_64(&i.to_le_bytes()),
                bytes: 1 << 26,
            })
            .collect()
    }

    fn names(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("10.0.0.{i}:7341")).collect()
    }

    #[test]
    fn shares_are_near_one_over_n() {
        let ring = Ring::new(1, names(4), VNODES_DEFAULT);
        let keys = ids(40_000);
        for m in ring.members() {
            let share = keys.iter().filter(|k| ring.owner(**k) == Some(m.as_str())).count() as f64 / keys.len() as f64;
            assert!((share - 0.25).abs() < 0.05, "{m} owns {share:.3}");
        }
    }

    #[test]
    fn a_change_moves_only_the_changed_nodes_keys() {
        let keys = ids(20_000);
        for n in [3usize, 8] {
            let before = Ring::new(1, names(n), VNODES_DEFAULT);
            // A node joins: only keys now owned by it move, about 1/(n+1) of them.
            let after = Ring::new(2, names(n + 1), VNODES_DEFAULT);
            let newcomer = &names(n + 1)[n];
            let mut moved = 0;
            for k in &keys {
                let (a, b) = (before.owner(*k).unwrap(), after.owner(*k).unwrap());
                if a != b {
                    assert_eq!(b, newcomer, "a key moved between two unchanged nodes");
                    moved += 1;
                }
            }
            let frac = moved as f64 / keys.len() as f64;
            let expect = 1.0 / (n + 1) as f64;
            assert!(
                (frac - expect).abs() < 0.35 * expect,
                "join of node {n}: moved {frac:.3}, expected ~{expect:.3}"
            );
            // A node leaves: only its keys move.
            let gone = &names(n)[0];
            let left = Ring::new(3, names(n).into_iter().skip(1), VNODES_DEFAULT);
            for k in &keys {
                let (a, b) = (before.owner(*k).unwrap(), left.owner(*k).unwrap());
                assert!(a == b || a == gone, "a key of a remaining node moved");
            }
        }
    }

    #[test]
    fn every_host_builds_the_same_ring_whatever_the_list_order() {
        let mut r = names(5);
        let a = Ring::new(1, r.clone(), 64);
        r.reverse();
        let b = Ring::new(1, r, 64);
        for k in ids(1000) {
            assert_eq!(a.owner(k), b.owner(k));
        }
    }

    #[test]
    fn freeze_holds_the_version_until_the_last_unfreeze() {
        let mut m = Membership::new(names(3), 16);
        assert_eq!(m.ring().version(), 1);
        m.freeze();
        m.freeze();
        assert!(!m.propose(names(4)));
        assert_eq!(m.ring().version(), 1);
        assert_eq!(m.pending().map(|p| p.len()), Some(4));
        assert!(!m.unfreeze());
        assert_eq!(m.ring().version(), 1);
        assert!(m.unfreeze());
        assert_eq!(m.ring().version(), 2);
        assert_eq!(m.ring().members().len(), 4);
        assert!(!m.propose(names(4)), "an unchanged set is not a change");
        assert_eq!(m.ring().version(), 2);
        assert_eq!(Ring::new(1, Vec::new(), 8).owner(ids(1)[0]), None);
    }
}
