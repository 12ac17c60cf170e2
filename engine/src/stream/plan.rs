//! The plan: pure functions of the manifests, the order settings, the epoch and the resume
//! point. No I/O.

use super::*;

/// One epoch as dealt to this consumer.
pub(super) struct EpochPlan {
    pub(super) epoch: u64,
    pub(super) order: Vec<SampleRef>,
    pub(super) len: u64,
    pub(super) base: EpochProgress,
    pub(super) positions: Vec<u64>,
    /// Positions of the deal already delivered before a consumer resume (the cursor starts
    /// here).
    pub(super) skip: usize,
}

pub(super) fn plan_epoch(shared: &Shared, epoch: u64, base: EpochProgress, skip: usize) -> EpochPlan {
    let order = global_order(&shared.shapes, &shared.cfg.order, epoch);
    let topo = shared.cfg.topology;
    let len = effective_len(order.len() as u64, topo.consumers() as u64, shared.cfg.order.tail);
    let positions = if order.is_empty() {
        Vec::new()
    } else {
        base.positions_for(len, topo.consumer(), topo.consumers())
    };
    EpochPlan {
        epoch,
        order,
        len,
        skip: skip.min(positions.len()),
        base,
        positions,
    }
}
