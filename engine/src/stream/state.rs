//! What a consumer saves and resumes from, checked against the sources and the order.

use super::*;

/// Samples in one epoch's order (after tail handling) and this consumer's share of them,
/// from the manifests alone: nothing is prefetched and no thread outlives the call.
pub async fn epoch_lengths(cfg: &StreamConfig) -> Result<(u64, u64)> {
    let mut shapes = Vec::with_capacity(cfg.sources.len());
    for sc in &cfg.sources {
        let ds = Dataset::open(&sc.url).await?;
        shapes.push(StreamShape {
            version: ds.manifest().version.clone(),
            counts: ds.manifest().shard_counts(),
            weight: sc.weight,
        });
    }
    let n = checked_epoch_positions(&shapes)?;
    let consumers = cfg.topology.consumers() as u64;
    let len = effective_len(n, consumers, cfg.order.tail);
    let c = cfg.topology.consumer() as u64;
    let mine = if len > c { (len - c).div_ceil(consumers) } else { 0 };
    Ok((len, mine))
}

/// An epoch's positions over `shapes`, refused when the counts overflow. The order is
/// computed position by position, so no size is too large to plan.
pub(super) fn checked_epoch_positions(shapes: &[StreamShape]) -> Result<u64> {
    crate::order::epoch_positions(shapes)
        .ok_or_else(|| Error::invalid("sources", "the sources' sample counts overflow 64 bits"))
}

/// A saved position to resume from.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ResumePoint {
    /// The order's version ([`crate::order::ORDER_VERSION`]) the positions refer to; a state
    /// saved before the field existed is version 1.
    #[serde(default = "crate::order::order_version_1")]
    pub order_version: u32,
    /// Manifest versions of the sources, in order; resuming on other data is refused.
    pub versions: Vec<String>,
    /// The order the progress refers to.
    pub order: OrderSpec,
    /// The job's progress.
    pub progress: EpochProgress,
}

/// One consumer's position, to save and later combine with the other consumers' states.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StreamState {
    /// The order's version ([`crate::order::ORDER_VERSION`]) the positions refer to.
    #[serde(default = "crate::order::order_version_1")]
    pub order_version: u32,
    /// Manifest versions of the sources.
    pub versions: Vec<String>,
    /// The order.
    pub order: OrderSpec,
    /// This consumer.
    pub consumer: usize,
    /// Consumers in the job.
    pub consumers: usize,
    /// The progress the current epoch's positions were dealt from.
    pub base: EpochProgress,
    /// Length of the current epoch's order (tail-adjusted).
    pub len: u64,
    /// Positions of the current deal this consumer has delivered.
    pub delivered: u64,
}

impl StreamState {
    /// The job's progress from the states of all its consumers (taken at the same step).
    /// With one consumer, pass its state alone.
    pub fn job_progress(states: &[StreamState]) -> Result<ResumePoint> {
        let first = states
            .first()
            .ok_or_else(|| Error::invalid("stream states", "none given"))?;
        let c = first.consumers;
        if c == 0 {
            return Err(Error::invalid("stream states", "consumers is 0"));
        }
        first
            .base
            .validate(first.len)
            .map_err(|r| Error::invalid("stream states", r))?;
        let mut delivered = vec![0u64; c];
        let mut seen = vec![false; c];
        for s in states {
            if s.consumers != c
                || s.order_version != first.order_version
                || s.base != first.base
                || s.versions != first.versions
                || s.order != first.order
                || s.len != first.len
            {
                return Err(Error::invalid(
                    "stream states",
                    "they come from different jobs, epochs or deals",
                ));
            }
            if s.consumer >= c {
                return Err(Error::invalid(
                    "stream states",
                    format!("consumer {} of a job of {c} consumers", s.consumer),
                ));
            }
            if std::mem::replace(&mut seen[s.consumer], true) {
                return Err(Error::invalid(
                    "stream states",
                    format!("consumer {} appears twice", s.consumer),
                ));
            }
            let dealt = s.base.deal(s.len, s.consumer, c).len();
            if s.delivered > dealt {
                return Err(Error::invalid(
                    "stream states",
                    format!(
                        "consumer {} delivered {} of the {dealt} positions dealt to it",
                        s.consumer, s.delivered
                    ),
                ));
            }
            delivered[s.consumer] = s.delivered;
        }
        if states.len() != c {
            return Err(Error::invalid(
                "stream states",
                format!("{} states for {c} consumers", states.len()),
            ));
        }
        let mut progress = first.base.advance(first.len, &delivered);
        if progress.consumed >= first.len && progress.ahead.is_empty() {
            progress = EpochProgress {
                epoch: progress.epoch + 1,
                consumed: 0,
                ahead: Vec::new(),
            };
        }
        Ok(ResumePoint {
            order_version: first.order_version,
            versions: first.versions.clone(),
            order: first.order,
            progress,
        })
    }
}

/// Refuses a saved state taken on other data (manifest versions) or under another order.
pub(super) fn check_saved_for(
    what: &str,
    saved_order_version: u32,
    saved_versions: &[String],
    saved_order: &OrderSpec,
    versions: &[String],
    order: &OrderSpec,
) -> Result<()> {
    if saved_order_version != crate::order::ORDER_VERSION {
        return Err(Error::invalid(
            what,
            format!(
                "it was saved under order version {saved_order_version}, and this build computes \
                 order version {}: its positions would name other samples. Start the epoch \
                 again (first_epoch), or finish it with the build that saved it",
                crate::order::ORDER_VERSION
            ),
        ));
    }
    if saved_versions != versions {
        return Err(Error::invalid(
            what,
            format!("it was saved for manifest versions {saved_versions:?}, the sources are now {versions:?}"),
        ));
    }
    if saved_order != order {
        return Err(Error::invalid(
            what,
            "it was saved for a different order (seed, shuffle or partitions)",
        ));
    }
    Ok(())
}

/// Checks a consumer's own saved state against the stream that resumes from it.
pub(super) fn check_consumer_state(
    c: &StreamState,
    versions: &[String],
    order: &OrderSpec,
    topo: Topology,
    len: u64,
) -> Result<()> {
    let what = "resume state (one consumer's)";
    let bad = |why: String| Err(Error::invalid(what, why));
    check_saved_for(what, c.order_version, &c.versions, &c.order, versions, order)?;
    if c.consumer != topo.consumer() || c.consumers != topo.consumers() {
        return bad(format!(
            "it was saved by consumer {} of {}, and this is consumer {} of {}: restore with the \
             same ranks and workers, or resume from the job's state (state_dict gathered over ranks)",
            c.consumer,
            c.consumers,
            topo.consumer(),
            topo.consumers()
        ));
    }
    if c.len != len {
        return bad(format!("its epoch has {} positions, this one {len}", c.len));
    }
    c.base.validate(len).map_err(|r| Error::invalid(what, r))?;
    let dealt = c.base.deal(len, c.consumer, c.consumers).len();
    if c.delivered > dealt {
        return bad(format!(
            "it delivered {} of the {dealt} positions dealt to it",
            c.delivered
        ));
    }
    Ok(())
}
