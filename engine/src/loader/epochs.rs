//! A dataset object's walk over epochs, across iterations: which epoch the next iteration
//! reads, where in it the iteration starts (its beginning, the job's saved progress, or this
//! consumer's own saved state), when an iteration ends, and the state to save after any batch.
//!
//! One [`Loader`](super::Loader) runs across epochs (`epochs: None`) and is kept while the
//! dataset is iterated again for the next epoch under the same topology; a new one starts when
//! the epoch the caller asks for, or the topology, is not the one the running loader is in.
//! The language bindings drive this and decide nothing themselves.

use serde_json::{json, Value};

use super::Batch;
use crate::error::{Error, Result};
use crate::order::{OrderSpec, Shuffle, Topology};
use crate::stream::{ResumePoint, StreamConfig, StreamState};

/// The version of the saved state ([`Epochs::worker_state`], [`Epochs::job_state`]).
pub const SAVED_STATE_VERSION: u64 = 1;

/// A saved position as it was given (its text, returned unchanged by the saved state) and parsed.
#[derive(Debug, Clone)]
struct Saved<T> {
    text: String,
    value: T,
}

/// Where a dataset object is in its epochs. See the module's documentation.
#[derive(Debug, Clone, Default)]
pub struct Epochs {
    /// The epoch the next iteration reads.
    epoch: u64,
    /// The job's progress to start from (a loaded state), until a batch is yielded.
    resume: Option<Saved<ResumePoint>>,
    /// This consumer's own state to continue from (a worker's loaded state), likewise.
    resume_consumer: Option<Saved<StreamState>>,
    /// Every consumer's own state, from a job state saved under aspect-ratio buckets: a start
    /// under the same topology continues from its own ([`Epochs::start`]), likewise.
    resume_consumers: Option<Vec<Saved<StreamState>>>,
    /// This consumer's state after the last batch it yielded.
    state: Option<StreamState>,
    /// The epoch the running loader is in and the topology it was started for.
    running: Option<(u64, Topology)>,
    /// The run's canonical partitions when the user gave none ([`Epochs::settle_partitions`]):
    /// set by the first start or by a loaded state, then kept for the rest of the run.
    partitions: Option<usize>,
}

/// What to do with a batch the loader handed out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Yield it; the iteration goes on.
    Yield,
    /// Yield it; it is the epoch's last for this consumer, so the iteration ends after it.
    YieldLast,
    /// It belongs to the next epoch (a consumer resumed with nothing left of its epoch): keep
    /// it for the next iteration, and end this one now.
    Defer,
    /// Nothing to yield: the epoch ended without a batch for this consumer
    /// ([`super::Next::EpochEnd`]), so the iteration ends now.
    End,
}

impl Epochs {
    /// At the start of epoch 0.
    pub fn new() -> Self {
        Self::default()
    }

    /// The epoch the next iteration reads.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Selects the epoch the next iteration reads, from its start. Setting the epoch a loaded
    /// state belongs to keeps that state (the usual loop, `for epoch in range(start, n)`,
    /// continues mid-epoch); setting another drops it.
    pub fn set_epoch(&mut self, epoch: u64) {
        if epoch != self.epoch {
            self.epoch = epoch;
            self.resume = None;
            self.resume_consumer = None;
            self.resume_consumers = None;
            self.state = None;
        }
    }

    /// Whether a new loader must start for an iteration under `topology` (none runs, or the
    /// running one is in another epoch or was started for another topology).
    pub fn needs_start(&self, topology: &Topology) -> bool {
        self.running != Some((self.epoch, *topology))
    }

    /// The canonical partitions the run reads under `topology` when the user gave none: the
    /// run's own once it has them (its first start, or a loaded state's), else the job's node
    /// count (`world / LOCAL_WORLD_SIZE`) under a shard-block shuffle, else 1. So a job started
    /// on `n` nodes deals each node its share, and keeps its order when it resumes on a node
    /// count dividing `n` (docs/order.md, "The one-order promise").
    pub fn job_partitions(&self, order: &OrderSpec, topology: &Topology) -> usize {
        self.partitions.unwrap_or(match order.shuffle {
            Shuffle::ShardBlock { .. } => topology.nodes().max(1),
            _ => 1,
        })
    }

    /// Sets `cfg.order.partitions` to [`Epochs::job_partitions`] when the user gave none
    /// (`cfg.partitions_from_job`); records nothing.
    pub fn settle_partitions(&self, cfg: &mut StreamConfig) {
        if cfg.partitions_from_job {
            cfg.order.partitions = self.job_partitions(&cfg.order, &cfg.topology);
        }
    }

    /// The run's partitions when the user gave none and the run has them.
    pub fn partitions(&self) -> Option<usize> {
        self.partitions
    }

    /// Sets where a new loader starts (the epoch, a loaded state if any, and the run's
    /// partitions) in `cfg`, and records it as the running one.
    pub fn start(&mut self, cfg: &mut StreamConfig) {
        self.settle_partitions(cfg);
        if cfg.partitions_from_job {
            self.partitions = Some(cfg.order.partitions);
        }
        cfg.epochs = None;
        cfg.first_epoch = self.epoch;
        cfg.resume = self.resume.as_ref().map(|s| s.value.clone());
        cfg.resume_consumer = self.resume_consumer.as_ref().map(|s| s.value.clone());
        if let Some(own) = self.own_state(cfg) {
            // The job saved every consumer's own state, and the topology is the same: this
            // consumer goes on exactly from its own (its buckets' waiting samples included).
            cfg.resume_consumer = Some(own);
            cfg.resume = None;
        }
        self.running = Some((self.epoch, cfg.topology));
    }

    /// This consumer's own state among a loaded job state's, when the job saved them and the
    /// topology (consumers and nodes) is the one they were saved under.
    fn own_state(&self, cfg: &StreamConfig) -> Option<StreamState> {
        let list = self.resume_consumers.as_ref()?;
        let (c, n) = (cfg.topology.consumer(), cfg.topology.consumers());
        let nodes = crate::order::DealRule::for_job(&cfg.order, &cfg.topology).nodes;
        let own = list.iter().find(|s| s.value.consumer == c)?;
        (list.len() == n && own.value.consumers == n && own.value.nodes == nodes).then(|| own.value.clone())
    }

    /// The running loader is gone (dropped, or left behind in a forked parent).
    pub fn stopped(&mut self) {
        self.running = None;
    }

    /// Decides what happens to `batch`, the next one the running loader handed out, and moves
    /// on: a yielded batch's state becomes this consumer's saved state (taken out of `batch`).
    pub fn on_batch(&mut self, batch: &mut Batch) -> Step {
        let topology = self.running.map(|(_, t)| t);
        if batch.epoch != self.epoch {
            self.epoch = batch.epoch;
            self.running = topology.map(|t| (self.epoch, t));
            return Step::Defer;
        }
        self.state = batch.state.take();
        self.resume = None;
        self.resume_consumer = None;
        self.resume_consumers = None;
        if batch.end_of_epoch {
            // The loader goes on into the next epoch; the next iteration continues there.
            self.epoch = batch.epoch + 1;
            self.running = topology.map(|t| (self.epoch, t));
            return Step::YieldLast;
        }
        Step::Yield
    }

    /// The running loader's epoch `end.epoch` ended with no batch for this consumer: the
    /// iteration ends, and the next one reads the epoch after it, from its start.
    pub fn on_epoch_end(&mut self, end: &mut super::EpochEnd) -> Step {
        let topology = self.running.map(|(_, t)| t);
        self.state = end.state.take().or(self.state.take());
        self.resume = None;
        self.resume_consumer = None;
        self.resume_consumers = None;
        self.epoch = end.epoch + 1;
        self.running = topology.map(|t| (self.epoch, t));
        Step::End
    }

    /// This consumer's state after the last batch it yielded, if any.
    pub fn consumer_state(&self) -> Option<&StreamState> {
        self.state.as_ref()
    }

    /// The job's saved progress this object will start from, as it was loaded.
    pub fn resume_text(&self) -> Option<&str> {
        self.resume.as_ref().map(|s| s.text.as_str())
    }

    /// What a DataLoader worker saves: its own position, cheap to take after every batch
    /// (`{"version", "epoch", "consumer", "resume"}`, the positions as JSON text).
    pub fn worker_state(&self) -> Result<Value> {
        let consumer = match (&self.state, &self.resume_consumer) {
            (Some(s), _) => Some(to_text(s)?),
            (None, Some(saved)) => Some(saved.text.clone()),
            (None, None) => None,
        };
        Ok(json!({
            "version": SAVED_STATE_VERSION,
            "epoch": self.epoch,
            "consumer": consumer,
            "resume": self.resume_text(),
            "partitions": self.partitions,
        }))
    }

    /// The job's saved state before this consumer yielded anything: the epoch and the loaded
    /// progress, if any.
    pub fn unstarted_job_state(&self) -> Value {
        json!({
            "version": SAVED_STATE_VERSION,
            "epoch": self.epoch,
            "resume": self.resume_text(),
            "partitions": self.partitions,
        })
    }

    /// The job's saved state from every consumer's state taken after the same step. Under
    /// aspect-ratio buckets it also carries each consumer's own state (`"consumers"`), so that a
    /// job resumed on the same topology goes on exactly, its buckets' waiting samples included;
    /// on another, the progress alone deals what no consumer yielded yet.
    pub fn job_state(states: &[StreamState]) -> Result<Value> {
        let point = StreamState::job_progress(states)?;
        let mut v = json!({
            "version": SAVED_STATE_VERSION,
            "epoch": point.progress.epoch,
            "resume": to_text(&point)?,
            "partitions": point.order.partitions,
        });
        let mid_epoch = states.iter().any(|s| s.buckets.is_some()) && point.progress.epoch == states[0].base.epoch;
        if mid_epoch {
            v["consumers"] = Value::Array(
                states
                    .iter()
                    .map(to_text)
                    .collect::<Result<Vec<_>>>()?
                    .into_iter()
                    .map(Value::String)
                    .collect(),
            );
        }
        Ok(v)
    }

    /// Continues from a saved state (a job's, or a worker's): the next iteration reads the rest
    /// of its epoch. A state that is not one these functions made (not an object, a missing or
    /// wrong-typed field, text that does not parse, an `epoch` that disagrees with its `resume`)
    /// is an [`Error::InvalidInput`] naming the field, and changes nothing.
    pub fn load(&mut self, saved: &Value) -> Result<()> {
        let Value::Object(m) = saved else {
            return Err(Error::invalid(
                "state_dict",
                format!("must be a dict made by state_dict(), not {}", kind(saved)),
            ));
        };
        match m.get("version") {
            Some(v) if v.as_u64() == Some(SAVED_STATE_VERSION) => {}
            v => {
                return Err(Error::invalid(
                    "state_dict['version']",
                    format!("unknown version {}", v.map_or("None".into(), |v| v.to_string())),
                ))
            }
        }
        let epoch = match m.get("epoch") {
            None => return Err(Error::invalid("state_dict['epoch']", "missing")),
            Some(v) => v.as_u64().ok_or_else(|| {
                Error::invalid("state_dict['epoch']", format!("must be an int of at least 0, not {v}"))
            })?,
        };
        let resume: Option<Saved<ResumePoint>> = parsed(m.get("resume"), "resume")?;
        let consumer: Option<Saved<StreamState>> = parsed(m.get("consumer"), "consumer")?;
        let consumers = parsed_list(m.get("consumers"), "consumers")?;
        if let Some(r) = &resume {
            if r.value.progress.epoch != epoch {
                return Err(Error::invalid(
                    "state_dict['epoch']",
                    format!(
                        "is {epoch} but its 'resume' is a position in epoch {}",
                        r.value.progress.epoch
                    ),
                ));
            }
        }
        let partitions = saved_partitions(m.get("partitions"))?
            .or(resume.as_ref().map(|r| r.value.order.partitions))
            .or(consumer.as_ref().map(|c| c.value.order.partitions));
        self.epoch = consumer.as_ref().map_or(epoch, |c| c.value.base.epoch);
        self.partitions = partitions.or(self.partitions);
        self.resume = resume;
        self.resume_consumer = consumer;
        self.resume_consumers = consumers;
        self.state = None;
        self.running = None;
        Ok(())
    }

    /// Everything but the running loader, as JSON (to carry the object to another process).
    pub fn to_json(&self) -> Result<Value> {
        Ok(json!({
            "epoch": self.epoch,
            "resume": self.resume_text(),
            "consumer": self.resume_consumer.as_ref().map(|s| s.text.as_str()),
            "consumers": self.resume_consumers.as_ref().map(|l| l.iter().map(|s| s.text.as_str()).collect::<Vec<_>>()),
            "state": self.state.as_ref().map(to_text).transpose()?,
            "partitions": self.partitions,
        }))
    }

    /// The inverse of [`Epochs::to_json`]; no loader runs.
    pub fn from_json(v: &Value) -> Result<Self> {
        let epoch = v["epoch"]
            .as_u64()
            .ok_or_else(|| Error::invalid("position", "no epoch"))?;
        let state: Option<Saved<StreamState>> = parsed(v.get("state"), "state")?;
        Ok(Self {
            epoch,
            resume: parsed(v.get("resume"), "resume")?,
            resume_consumer: parsed(v.get("consumer"), "consumer")?,
            resume_consumers: parsed_list(v.get("consumers"), "consumers")?,
            state: state.map(|s| s.value),
            running: None,
            partitions: saved_partitions(v.get("partitions"))?,
        })
    }
}

/// A saved state's `partitions` (the run's, when the user gave none): absent or null, or a
/// count of at least 1.
fn saved_partitions(v: Option<&Value>) -> Result<Option<usize>> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_u64() {
            Some(p) if (1..=1 << 32).contains(&p) => Ok(Some(p as usize)),
            _ => Err(Error::invalid(
                "state_dict['partitions']",
                format!("must be an int in 1..=4294967296, not {v}"),
            )),
        },
    }
}

fn to_text<T: serde::Serialize>(v: &T) -> Result<String> {
    serde_json::to_string(v).map_err(|e| Error::invalid("state", e.to_string()))
}

/// A saved position's field: absent or null, or JSON text that parses as a `T`.
fn parsed<T: serde::de::DeserializeOwned>(v: Option<&Value>, field: &str) -> Result<Option<Saved<T>>> {
    let what = || format!("state_dict[{field:?}]").replace('"', "'");
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(text)) => match serde_json::from_str(text) {
            Ok(value) => Ok(Some(Saved {
                text: text.clone(),
                value,
            })),
            Err(e) => Err(Error::invalid(what(), format!("is not a ramjet state: {e}"))),
        },
        Some(other) => Err(Error::invalid(
            what(),
            format!("must be a JSON string, not {}", kind(other)),
        )),
    }
}

/// A saved list of positions: absent or null, or a list of JSON texts that each parse as a `T`.
fn parsed_list<T: serde::de::DeserializeOwned>(v: Option<&Value>, field: &str) -> Result<Option<Vec<Saved<T>>>> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Array(items)) => {
            let mut out = Vec::with_capacity(items.len());
            for (i, item) in items.iter().enumerate() {
                let at = format!("{field}[{i}]");
                match parsed(Some(item), &at)? {
                    Some(s) => out.push(s),
                    None => return Err(Error::invalid(format!("state_dict['{field}'][{i}]"), "is None")),
                }
            }
            Ok(Some(out))
        }
        Some(other) => Err(Error::invalid(
            format!("state_dict['{field}']"),
            format!("must be a list of JSON strings, not {}", kind(other)),
        )),
    }
}

/// A JSON value's kind, in the words of the Python types it came from.
fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "None",
        Value::Bool(_) => "bool",
        Value::Number(n) if n.is_f64() => "float",
        Value::Number(_) => "int",
        Value::String(_) => "str",
        Value::Array(_) => "list",
        Value::Object(_) => "dict",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::order::{EpochProgress, OrderSpec};
    use crate::stream::Audit;

    fn state(epoch: u64, delivered: u64) -> StreamState {
        StreamState {
            order_version: crate::order::ORDER_VERSION,
            versions: vec!["v1".into()],
            order: OrderSpec::default(),
            consumer: 0,
            consumers: 1,
            nodes: 1,
            base: EpochProgress {
                epoch,
                consumed: 0,
                ahead: vec![],
            },
            len: 100,
            delivered,
            audit_base: Audit::default(),
            audit: Audit::default(),
            buckets: None,
        }
    }

    fn batch(epoch: u64, end: bool, delivered: u64) -> Batch {
        Batch {
            epoch,
            columns: vec![],
            indices: vec![0],
            sources: vec![0],
            state: Some(state(epoch, delivered)),
            end_of_epoch: end,
            skipped: vec![],
        }
    }

    fn job(world: usize, local_world: usize) -> StreamConfig {
        StreamConfig {
            partitions_from_job: true,
            topology: Topology {
                world,
                local_world,
                ..Topology::default()
            },
            ..StreamConfig::default()
        }
    }

    #[test]
    fn a_run_without_partitions_takes_its_first_starts_nodes_and_keeps_them_in_its_states() {
        let mut e = Epochs::new();
        let mut first = job(8, 2);
        e.start(&mut first);
        assert_eq!(first.order.partitions, 4, "4 nodes of 2 ranks: 4 partitions");
        // Later in the run on 1 node of 2 ranks: still the run's 4.
        let mut later = job(2, 2);
        e.settle_partitions(&mut later);
        assert_eq!(later.order.partitions, 4);
        // Every saved state carries them; an object that loads one (a restarted job) takes them.
        for saved in [e.unstarted_job_state(), e.worker_state().unwrap(), e.to_json().unwrap()] {
            assert_eq!(saved["partitions"], 4, "{saved}");
            let mut f = Epochs::new();
            f.load(&json!({"version": 1, "epoch": 0, "partitions": saved["partitions"]}))
                .unwrap();
            let mut c = job(2, 2);
            f.settle_partitions(&mut c);
            assert_eq!(c.order.partitions, 4);
        }
        assert_eq!(Epochs::from_json(&e.to_json().unwrap()).unwrap().partitions(), Some(4));
        // A loaded job state's order gives them when the field is absent.
        let mut st = state(0, 3);
        st.order.partitions = 6;
        let mut saved = Epochs::job_state(&[st]).unwrap();
        saved.as_object_mut().unwrap().remove("partitions");
        let mut f = Epochs::new();
        f.load(&saved).unwrap();
        assert_eq!(f.partitions(), Some(6));
        // A fresh run on one node: 1, the order a single-node job always had.
        let mut one = job(4, 4);
        Epochs::new().start(&mut one);
        assert_eq!(one.order.partitions, 1);
        // A global shuffle has no partitions to deal; given partitions are the user's.
        let mut global = job(8, 2);
        global.order.shuffle = Shuffle::Global;
        Epochs::new().settle_partitions(&mut global);
        assert_eq!(global.order.partitions, 1);
        let mut given = job(8, 2);
        given.partitions_from_job = false;
        given.order.partitions = 3;
        e.start(&mut given);
        assert_eq!(given.order.partitions, 3);
        // A tampered count is refused, naming the field.
        let err = Epochs::new()
            .load(&json!({"version": 1, "epoch": 0, "partitions": 0}))
            .unwrap_err();
        assert!(err.to_string().contains("state_dict['partitions']"), "{err}");
    }

    #[test]
    fn a_loader_runs_on_across_epochs_and_restarts_only_for_another_epoch_or_topology() {
        let mut e = Epochs::new();
        let topo = Topology::default();
        assert!(e.needs_start(&topo));
        let mut cfg = StreamConfig::default();
        e.start(&mut cfg);
        assert_eq!((cfg.epochs, cfg.first_epoch), (None, 0));
        assert!(!e.needs_start(&topo));
        assert_eq!(e.on_batch(&mut batch(0, false, 1)), Step::Yield);
        assert_eq!(e.consumer_state().unwrap().delivered, 1);
        assert_eq!(e.on_batch(&mut batch(0, true, 2)), Step::YieldLast);
        assert_eq!(e.epoch(), 1);
        // The next iteration continues in the same loader, now in epoch 1.
        assert!(!e.needs_start(&topo));
        let other = Topology { world: 2, ..topo };
        assert!(e.needs_start(&other), "another topology needs another deal");
        e.set_epoch(5);
        assert!(e.needs_start(&topo) && e.consumer_state().is_none());
        e.start(&mut cfg);
        assert_eq!(cfg.first_epoch, 5);
    }

    #[test]
    fn a_resumed_consumer_with_nothing_left_defers_its_first_batch_to_the_next_iteration() {
        let mut e = Epochs::new();
        e.start(&mut StreamConfig::default());
        let mut b = batch(1, false, 1);
        assert_eq!(e.on_batch(&mut b), Step::Defer);
        assert!(
            b.state.is_some(),
            "a deferred batch keeps its state for when it is yielded"
        );
        assert_eq!(e.epoch(), 1);
        assert!(
            !e.needs_start(&Topology::default()),
            "the running loader is in epoch 1 now"
        );
        assert_eq!(e.on_batch(&mut b), Step::Yield);
    }

    #[test]
    fn an_epoch_that_ends_without_a_batch_ends_the_iteration_and_moves_to_the_next_epoch() {
        let mut e = Epochs::new();
        let topo = Topology::default();
        e.start(&mut StreamConfig::default());
        let mut end = super::super::EpochEnd {
            epoch: 0,
            state: Some(state(0, 0)),
        };
        assert_eq!(e.on_epoch_end(&mut end), Step::End);
        assert_eq!(e.epoch(), 1, "the next iteration reads epoch 1");
        assert!(!e.needs_start(&topo), "in the same loader");
        assert_eq!(
            e.consumer_state().unwrap().base.epoch,
            0,
            "the epoch's end is the state to save"
        );
    }

    #[test]
    fn a_saved_state_round_trips_and_a_bad_one_changes_nothing() {
        let mut e = Epochs::new();
        e.start(&mut StreamConfig::default());
        e.on_batch(&mut batch(0, false, 3));
        let job = Epochs::job_state(&[e.consumer_state().unwrap().clone()]).unwrap();
        let worker = e.worker_state().unwrap();
        let mut r = Epochs::new();
        r.load(&job).unwrap();
        assert_eq!(r.epoch(), 0);
        let mut cfg = StreamConfig::default();
        r.start(&mut cfg);
        assert_eq!(cfg.resume.unwrap().progress.epoch, 0);
        assert_eq!(
            r.unstarted_job_state()["resume"],
            job["resume"],
            "the loaded text is kept as given"
        );
        let mut w = Epochs::new();
        w.load(&worker).unwrap();
        let mut cfg = StreamConfig::default();
        w.start(&mut cfg);
        assert_eq!(cfg.resume_consumer.unwrap().delivered, 3);
        let moved = Epochs::from_json(&e.to_json().unwrap()).unwrap();
        assert_eq!(moved.consumer_state(), e.consumer_state());

        let bad: Vec<(Value, &str)> = vec![
            (json!([1, 2]), "state_dict"),
            (json!({"version": 1}), "state_dict['epoch']"),
            (json!({"version": 1, "epoch": "x"}), "state_dict['epoch']"),
            (json!({"version": 1, "epoch": -1}), "state_dict['epoch']"),
            (
                json!({"version": 1, "epoch": 0, "resume": "{not json"}),
                "state_dict['resume']",
            ),
            (json!({"version": 1, "epoch": 0, "resume": 5}), "state_dict['resume']"),
            (
                json!({"version": 1, "epoch": 0, "resume": "{}"}),
                "state_dict['resume']",
            ),
            (
                json!({"version": 1, "epoch": 0, "consumer": "[]"}),
                "state_dict['consumer']",
            ),
            (json!({"version": 2, "epoch": 0}), "state_dict['version']"),
            (
                json!({"version": 1, "epoch": 1, "resume": job["resume"]}),
                "state_dict['epoch']",
            ),
        ];
        for (v, named) in bad {
            let before = format!("{r:?}");
            match r.load(&v).unwrap_err() {
                Error::InvalidInput { what, .. } => assert_eq!(what, named, "{v}"),
                other => panic!("{v}: {other}"),
            }
            assert_eq!(format!("{r:?}"), before, "a refused state changed the position: {v}");
        }
    }
}
