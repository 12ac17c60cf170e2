//! What a consumer saves and resumes from, checked against the sources and the order.

use super::StreamConfig;
use crate::dataset::Dataset;
use crate::error::Result;
use crate::error::{Error, Invalid};
use crate::order::effective_len;
use crate::order::DealRule;
use crate::order::EpochProgress;
use crate::order::OrderSpec;
use crate::order::SampleRef;
use crate::order::SourceShape;
use crate::order::Topology;
use std::sync::Arc;

/// Samples in one epoch's order (after tail handling), this consumer's share of them and the
/// least share of any of the job's consumers, from the manifests alone: nothing is prefetched
/// and no thread outlives the call.
pub async fn epoch_lengths(cfg: &StreamConfig) -> Result<(u64, u64, u64)> {
    let shapes = source_shapes(cfg).await?;
    let n = checked_epoch_positions(&shapes)?;
    let rule = DealRule::for_job(&cfg.order, &cfg.topology);
    let len = effective_len(n, &rule, cfg.order.tail);
    let start = EpochProgress::default();
    let mine = start.deal(len, cfg.topology.consumer(), &rule).len();
    Ok((len, mine, least_share(&start, len, &rule)))
}

/// The fewest positions `rule` deals any one consumer from `progress` on (an order of `len`).
pub fn least_share(progress: &EpochProgress, len: u64, rule: &DealRule) -> u64 {
    (0..rule.consumers)
        .map(|c| progress.deal(len, c as usize, rule).len())
        .min()
        .unwrap_or(0)
}

/// The order's view of `cfg`'s sources (versions, shard counts, weights), from their
/// manifests alone.
async fn source_shapes(cfg: &StreamConfig) -> Result<Vec<SourceShape>> {
    let mut shapes = Vec::with_capacity(cfg.sources.len());
    for sc in &cfg.sources {
        let ds = Dataset::open(&sc.url).await?;
        let (counts, version) = super::select::source_counts(&ds, cfg.filter.as_deref()).await?;
        shapes.push(SourceShape {
            version,
            counts,
            weight: sc.weight,
        });
    }
    Ok(shapes)
}

/// An epoch's positions over `shapes`, refused when the counts overflow. The order is
/// computed position by position, so no size is too large to plan.
pub(super) fn checked_epoch_positions(shapes: &[SourceShape]) -> Result<u64> {
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
    /// Count and digest of every sample the job delivered in `progress.epoch` so far (the
    /// exactly-once audit; zero in a state saved before it existed, or at an epoch's start).
    #[serde(default)]
    pub audit: Audit,
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
    /// Nodes the job's positions were dealt across ([`DealRule`]; 1, position by position,
    /// in a state saved before the field existed).
    #[serde(default = "one_node")]
    pub nodes: u64,
    /// The progress the current epoch's positions were dealt from.
    pub base: EpochProgress,
    /// Length of the current epoch's order (tail-adjusted).
    pub len: u64,
    /// Positions of the current deal this consumer has delivered.
    pub delivered: u64,
    /// The job's audit at `base` (from the state it resumed from; the same for every
    /// consumer of the deal).
    #[serde(default)]
    pub audit_base: Audit,
    /// Count and digest of the samples this consumer delivered since `base`.
    #[serde(default)]
    pub audit: Audit,
    /// Under aspect-ratio buckets: the samples read but still held in partly filled buckets
    /// (`delivered` and `audit` then stand at the first of them; see [`BucketProgress`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub buckets: Option<BucketProgress>,
}

/// A consumer's place under aspect-ratio buckets (the loader's `buckets`), where batches leave
/// out of read order: it read its deal's positions below `upto`, and yielded all of those from
/// its state's `delivered` on but `pending`, which wait in partly filled buckets. A resumed
/// consumer reads again from `delivered` and refills its buckets with `pending` alone, so it
/// goes on exactly as it would have; a job's state counts the yielded ones as delivered.
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct BucketProgress {
    /// The deal's positions read (an index into this consumer's deal, past `delivered`).
    pub upto: u64,
    /// The deal's positions read and not yet yielded, increasing, from `delivered` on.
    pub pending: Vec<u64>,
    /// Count and digest of the samples yielded between `delivered` and `upto`.
    pub span_audit: Audit,
    /// Batches every consumer yields in this epoch.
    pub batches: u64,
    /// Batches this consumer yielded in it.
    pub emitted: u64,
}

impl BucketProgress {
    /// Checks the progress of a consumer that `delivered` of the `dealt` positions dealt to it:
    /// `pending` increasing, starting at `delivered` and below `upto`, `upto <= dealt`, no more
    /// batches yielded than the epoch has. A saved state can be edited: a bad one is refused.
    pub fn validate(&self, delivered: u64, dealt: u64) -> std::result::Result<(), Invalid> {
        if self.upto < delivered || self.upto > dealt {
            return Err(format!(
                "buckets.upto {} is outside [{delivered}, {dealt}] (delivered, dealt)",
                self.upto
            )
            .into());
        }
        if self.pending.first().is_some_and(|&k| k != delivered) {
            return Err(format!("buckets.pending does not start at delivered {delivered}").into());
        }
        if self.pending.windows(2).any(|w| w[0] >= w[1]) || self.pending.last().is_some_and(|&k| k >= self.upto) {
            return Err(format!("buckets.pending is not increasing below upto {}", self.upto).into());
        }
        if self.pending.is_empty() && self.upto != delivered {
            return Err(format!(
                "buckets.upto {} with nothing pending is not delivered {delivered}",
                self.upto
            )
            .into());
        }
        if self.emitted > self.batches {
            return Err(format!(
                "buckets.emitted {} is over the epoch's {} batches",
                self.emitted, self.batches
            )
            .into());
        }
        Ok(())
    }

    /// The positions of `deal` yielded between `delivered` and `upto` (what a job's state
    /// counts as delivered ahead of its frontier).
    fn yielded(&self, delivered: u64, deal: &crate::order::Deal) -> Vec<u64> {
        (delivered..self.upto)
            .filter(|k| self.pending.binary_search(k).is_err())
            .map(|k| deal.position(k))
            .collect()
    }
}

fn one_node() -> u64 {
    1
}

impl StreamState {
    /// The rule this consumer's positions were dealt by.
    pub fn rule(&self) -> DealRule {
        let strided = DealRule::strided(self.consumers);
        if self.nodes > 1 {
            DealRule {
                nodes: self.nodes,
                partitions: self.order.partitions.max(1) as u64,
                ..strided
            }
        } else {
            strided
        }
    }
}

/// The key of the exactly-once audit's sample hash.
const AUDIT_KEY: u64 = 0x7261_6d6a_6574_4155; // "ramjetAU"

/// An order-independent record of delivered samples, cheap enough to keep always: how many,
/// and the wrapping sum of a keyed 64-bit hash of each one's identity (source, shard, index
/// in the shard). Records add across consumers and across resumes, so a job's is the sum of
/// its consumers'; the epoch's order gives the one it should be. A repeated or skipped
/// sample changes the count; a sample delivered in place of another changes the digest
/// (missed with probability 2^-64).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Audit {
    /// Samples delivered.
    pub count: u64,
    /// Wrapping sum of [`Audit::sample_hash`] over them.
    pub digest: u64,
}

impl Audit {
    /// The hash of one sample's identity.
    pub fn sample_hash(id: SampleRef) -> u64 {
        crate::order::derive(AUDIT_KEY, id.source as u64, ((id.shard as u64) << 32) | id.index as u64)
    }

    /// Records one delivered sample.
    pub fn add(&mut self, id: SampleRef) {
        self.count += 1;
        self.digest = self.digest.wrapping_add(Self::sample_hash(id));
    }

    /// The record of both.
    pub fn merge(self, o: Audit) -> Audit {
        Audit {
            count: self.count.wrapping_add(o.count),
            digest: self.digest.wrapping_add(o.digest),
        }
    }
}

/// What [`audit`] found: whether the samples delivered so far in an epoch are each position
/// of its order exactly once.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct AuditReport {
    /// The epoch audited.
    pub epoch: u64,
    /// Positions of the epoch's order the job's progress says were delivered.
    pub expected: u64,
    /// Samples the consumers counted as delivered.
    pub delivered: u64,
    /// The digest the delivered positions' samples give.
    pub expected_digest: u64,
    /// The digest the consumers carried.
    pub digest: u64,
    /// Positions in the epoch's order.
    pub len: u64,
    /// Every position of the epoch was delivered.
    pub complete: bool,
    /// Each sample the progress covers was delivered exactly once.
    pub exactly_once: bool,
    /// The verdict, in words.
    pub message: String,
}

/// Audits a job's position in an epoch, `point` (from [`StreamState::combine`], or a saved
/// job state): its progress (the positions delivered, by the job's own bookkeeping) against
/// its audit (what the consumers counted as they delivered). The expected record is computed
/// from the epoch's order of `cfg`'s sources, one hash per delivered position. `len` is the
/// epoch's tail-adjusted length when known (a consumer's state records it), else computed
/// for `cfg`'s topology.
pub async fn audit(cfg: &StreamConfig, point: &ResumePoint, len: Option<u64>) -> Result<AuditReport> {
    let (progress, got) = (&point.progress, point.audit);
    let shapes = source_shapes(cfg).await?;
    let versions: Vec<String> = shapes.iter().map(|s| s.version.clone()).collect();
    check_saved_for(
        "audited state",
        point.order_version,
        &point.versions,
        &point.order,
        &versions,
        &cfg.order,
    )?;
    let n = checked_epoch_positions(&shapes)?;
    let rule = DealRule::for_job(&cfg.order, &cfg.topology);
    let len = len.unwrap_or_else(|| effective_len(n, &rule, cfg.order.tail));
    progress
        .validate(len)
        .map_err(|why| Error::invalid("audited state", why))?;
    let order = Arc::new(crate::order::EpochOrder::new(&shapes, &cfg.order, progress.epoch)?);
    let mut want = Audit::default();
    if len > 0 {
        let mut cursor = order.cursor();
        for p in (0..progress.consumed).chain(progress.ahead.iter().copied()) {
            want.add(cursor.at(p)?.0);
        }
    }
    let exactly_once = want == got;
    let message = if exactly_once {
        format!(
            "epoch {}: each of the {} samples delivered so far exactly once{}",
            progress.epoch,
            got.count,
            if want.count == len { " (the whole epoch)" } else { "" }
        )
    } else if got.count > want.count {
        format!(
            "epoch {}: {} samples delivered where the job's progress covers {}: {} delivered more than once",
            progress.epoch,
            got.count,
            want.count,
            got.count - want.count
        )
    } else if got.count < want.count {
        format!(
            "epoch {}: {} samples delivered where the job's progress covers {}: {} skipped",
            progress.epoch,
            got.count,
            want.count,
            want.count - got.count
        )
    } else {
        format!(
            "epoch {}: {} samples delivered as the progress says, but not the same ones (the \
             digests differ): some were repeated and as many skipped",
            progress.epoch, got.count
        )
    };
    Ok(AuditReport {
        epoch: progress.epoch,
        expected: want.count,
        delivered: got.count,
        expected_digest: want.digest,
        digest: got.digest,
        len,
        complete: want.count == len,
        exactly_once,
        message,
    })
}

impl StreamState {
    /// The job's progress from the states of all its consumers (taken at the same step).
    /// With one consumer, pass its state alone.
    pub fn job_progress(states: &[StreamState]) -> Result<ResumePoint> {
        let (mut point, len) = Self::combine(states)?;
        if point.progress.consumed >= len && point.progress.ahead.is_empty() {
            point.progress = EpochProgress {
                epoch: point.progress.epoch + 1,
                consumed: 0,
                ahead: Vec::new(),
            };
            point.audit = Audit::default();
        }
        Ok(point)
    }

    /// The job's position from the states of all its consumers, in their epoch (a finished
    /// epoch stays finished rather than rolling over), and the epoch's length.
    pub fn combine(states: &[StreamState]) -> Result<(ResumePoint, u64)> {
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
        // Positions yielded past a consumer's frontier out of read order (buckets).
        let mut yielded: Vec<u64> = Vec::new();
        for s in states {
            if s.consumers != c
                || s.nodes != first.nodes
                || s.order_version != first.order_version
                || s.base != first.base
                || s.versions != first.versions
                || s.order != first.order
                || s.len != first.len
                || s.audit_base != first.audit_base
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
            let dealt = s.base.deal(s.len, s.consumer, &s.rule()).len();
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
            if let Some(b) = &s.buckets {
                b.validate(s.delivered, dealt)
                    .map_err(|why| Error::invalid("stream states", format!("consumer {}: {why}", s.consumer)))?;
                yielded.extend(b.yielded(s.delivered, &s.base.deal(s.len, s.consumer, &s.rule())));
            }
        }
        if states.len() != c {
            return Err(Error::invalid(
                "stream states",
                format!("{} states for {c} consumers", states.len()),
            ));
        }
        let rule = first.rule();
        if rule.nodes > 1 && (rule.partitions % rule.nodes != 0 || rule.consumers % rule.nodes != 0) {
            return Err(Error::invalid(
                "stream states",
                format!(
                    "dealt across {} nodes, which divide neither the {} partitions nor the {} consumers",
                    rule.nodes, rule.partitions, rule.consumers
                ),
            ));
        }
        let mut progress = first.base.advance(first.len, &delivered, &rule);
        if !yielded.is_empty() {
            progress.ahead.extend(yielded);
            progress.ahead.sort_unstable();
            progress.ahead.dedup();
        }
        let audit = states.iter().fold(first.audit_base, |a, s| {
            a.merge(s.audit)
                .merge(s.buckets.as_ref().map_or_else(Audit::default, |b| b.span_audit))
        });
        Ok((
            ResumePoint {
                order_version: first.order_version,
                versions: first.versions.clone(),
                order: first.order,
                progress,
                audit,
            },
            first.len,
        ))
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
    if let Some(why) = order_difference(saved_order, order) {
        return Err(Error::invalid(
            what,
            format!("it was saved for a different order: {why}"),
        ));
    }
    Ok(())
}

/// Which field of the order a saved state's differs in from the stream's (the first that does),
/// `None` when they are the same order.
fn order_difference(saved: &OrderSpec, now: &OrderSpec) -> Option<String> {
    let field = |name: &str, a: String, b: String| Some(format!("{name} {a} when saved, {b} now"));
    // Every field named, so that a field added to the order is added here (or this fails to build).
    let OrderSpec {
        seed: _,
        shuffle: _,
        partitions: _,
        tail: _,
        shares: _,
    } = saved;
    if saved.seed != now.seed {
        field("seed", saved.seed.to_string(), now.seed.to_string())
    } else if saved.shuffle != now.shuffle {
        field("shuffle", format!("{:?}", saved.shuffle), format!("{:?}", now.shuffle))
    } else if saved.partitions != now.partitions {
        field("partitions", saved.partitions.to_string(), now.partitions.to_string())
    } else if saved.tail != now.tail {
        field("tail", format!("{:?}", saved.tail), format!("{:?}", now.tail))
    } else if saved.shares != now.shares {
        field("shares", format!("{:?}", saved.shares), format!("{:?}", now.shares))
    } else {
        None
    }
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
    let rule = DealRule::for_job(order, &topo);
    if c.consumer != topo.consumer() || c.consumers != topo.consumers() || c.nodes != rule.nodes {
        return bad(format!(
            "it was saved by consumer {} of {} on {} nodes, and this is consumer {} of {} on {} \
             nodes: restore with the same ranks, hosts and workers, or resume from the job's state \
             (state_dict gathered over ranks)",
            c.consumer,
            c.consumers,
            c.nodes,
            topo.consumer(),
            topo.consumers(),
            rule.nodes
        ));
    }
    if c.len != len {
        return bad(format!("its epoch has {} positions, this one {len}", c.len));
    }
    c.base.validate(len).map_err(|r| Error::invalid(what, r))?;
    let dealt = c.base.deal(len, c.consumer, &rule).len();
    if c.delivered > dealt {
        return bad(format!(
            "it delivered {} of the {dealt} positions dealt to it",
            c.delivered
        ));
    }
    Ok(())
}

/// Where a consumer starts, from its settings: its own saved state (`resume_consumer`, checked
/// against the topology and the sources), the job's progress (`resume`), or the start of
/// `first_epoch`. Returns the position, how many of its samples there this consumer already
/// delivered, and the audits to continue from (the job's at the base, this consumer's own).
pub(super) fn starting_point(
    cfg: &StreamConfig,
    shapes: &[SourceShape],
) -> Result<(EpochProgress, usize, ResumedAudit)> {
    let start = match (&cfg.resume_consumer, &cfg.resume) {
        (Some(c), _) => {
            let versions: Vec<String> = shapes.iter().map(|s| s.version.clone()).collect();
            let n = checked_epoch_positions(shapes)?;
            let topo = cfg.topology;
            let len = effective_len(n, &DealRule::for_job(&cfg.order, &topo), cfg.order.tail);
            check_consumer_state(c, &versions, &cfg.order, topo, len)?;
            (
                c.base.clone(),
                c.delivered as usize,
                Some((c.base.clone(), c.audit_base, c.audit)),
            )
        }
        (None, Some(r)) => {
            let versions: Vec<String> = shapes.iter().map(|s| s.version.clone()).collect();
            check_saved_for(
                "resume state",
                r.order_version,
                &r.versions,
                &r.order,
                &versions,
                &cfg.order,
            )?;
            let n = checked_epoch_positions(shapes)?;
            let len = effective_len(n, &DealRule::for_job(&cfg.order, &cfg.topology), cfg.order.tail);
            r.progress
                .validate(len)
                .map_err(|why| Error::invalid("resume state", why))?;
            (
                r.progress.clone(),
                0,
                Some((r.progress.clone(), r.audit, Audit::default())),
            )
        }
        (None, None) => (
            EpochProgress {
                epoch: cfg.first_epoch,
                ..EpochProgress::default()
            },
            0,
            None,
        ),
    };
    checked_epoch_positions(shapes)?;
    Ok(start)
}

/// The audits a resumed consumer continues: its position, the job's audit there, its own since.
pub(super) type ResumedAudit = Option<(EpochProgress, Audit, Audit)>;
