//! Where a node's daemon reads a shard that a cut between two nodes' windows splits (both
//! nodes read it) under a node-affine deal of a sticky order (docs/order.md, "Node-affine").

/// The route of a split shard ([`super::StreamConfig::split_shards`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SplitShards {
    /// The node of the shard's first partition (its reader) reads it from the origin; every
    /// other node's daemon asks the reader's daemon, found by the job's heartbeats. The origin
    /// serves it once and no third node receives it (`RAMJET_SPLIT_SHARDS=reader`, the
    /// default).
    #[default]
    Reader,
    /// Through the shard's ring owner: the origin serves it once, at the price of a shard
    /// more into an owner that reads none of it (`RAMJET_SPLIT_SHARDS=owner`).
    Owner,
    /// Each node reads it from the origin (`RAMJET_SPLIT_SHARDS=origin`).
    Origin,
}

impl SplitShards {
    /// The route `RAMJET_SPLIT_SHARDS` names; unset, the default. An unknown value is warned
    /// about, naming it, and the default taken.
    pub fn from_env() -> SplitShards {
        let Ok(v) = std::env::var("RAMJET_SPLIT_SHARDS") else {
            return SplitShards::default();
        };
        Self::parse(&v).unwrap_or_else(|| {
            tracing::warn!(
                "RAMJET_SPLIT_SHARDS={v:?} is none of reader, owner, origin; reading split shards through their reader"
            );
            SplitShards::default()
        })
    }

    /// `reader`, `owner` or `origin`.
    pub fn parse(v: &str) -> Option<SplitShards> {
        match v.trim() {
            "reader" => Some(SplitShards::Reader),
            "owner" => Some(SplitShards::Owner),
            "origin" => Some(SplitShards::Origin),
            _ => None,
        }
    }
}

/// How this node's daemon asks for one split shard of its share.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SplitVia {
    /// Through its ring owner.
    Owner,
    /// Through the daemon of this node of the job's deal (the shard's reader).
    Reader(u32),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_three_routes_parse_and_nothing_else() {
        assert_eq!(SplitShards::parse(" reader"), Some(SplitShards::Reader));
        assert_eq!(SplitShards::parse("owner"), Some(SplitShards::Owner));
        assert_eq!(SplitShards::parse("origin\n"), Some(SplitShards::Origin));
        assert_eq!(SplitShards::parse("peer"), None);
        assert_eq!(SplitShards::default(), SplitShards::Reader);
    }
}
