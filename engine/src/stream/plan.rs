//! The plan: pure functions of the manifests, the order settings, the epoch and the resume
//! point. Nothing per sample or per shard (a shard table's block of counts is read when the
//! order first reaches it): positions and samples are computed as they are read.

use super::shared::Shared;
use crate::error::Result;
use crate::order::effective_len;
use crate::order::EpochProgress;
use crate::order::{Deal, DealRule, EpochOrder};
use std::sync::Arc;

/// One epoch as dealt to this consumer.
pub(super) struct EpochPlan {
    pub(super) epoch: u64,
    pub(super) order: Arc<EpochOrder>,
    pub(super) len: u64,
    pub(super) base: EpochProgress,
    pub(super) deal: Deal,
    /// Positions of the deal already delivered before a consumer resume (the cursor starts
    /// here).
    pub(super) skip: usize,
}

impl EpochPlan {
    /// Positions dealt to this consumer this epoch.
    pub(super) fn count(&self) -> usize {
        self.deal.len() as usize
    }
}

pub(super) fn plan_epoch(shared: &Shared, epoch: u64, base: EpochProgress, skip: usize) -> Result<EpochPlan> {
    let order = Arc::new(EpochOrder::new(&shared.shapes, &shared.cfg.order, epoch)?);
    let topo = shared.cfg.topology;
    let rule = DealRule::for_job(&shared.cfg.order, &topo);
    let len = effective_len(order.len(), &rule, shared.cfg.order.tail);
    let deal = if order.is_empty() {
        Deal::empty()
    } else {
        base.deal(len, topo.consumer(), &rule)
    };
    Ok(EpochPlan {
        epoch,
        order,
        len,
        skip: skip.min(deal.len() as usize),
        base,
        deal,
    })
}
