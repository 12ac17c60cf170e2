//! Token streams for causal language models.
//!
//! A token dataset holds one document a sample: an integer array column (`tokens: uint16[?]`,
//! `int32[?]`, ...; or a `bytes` column of a stated element type, as MosaicML's token MDS
//! datasets have). A [`TokenStream`] concatenates the documents in the epoch's global order
//! (the same [`crate::order`] as every other stream: mixing by proportion, shuffling at
//! document level), an end-of-document token after each, and cuts the result into windows of
//! `seq_len + 1` tokens: a model's inputs and its targets shifted by one. Window `k` is tokens
//! `[k (L + 1), (k + 1)(L + 1))` of the epoch's concatenation, whatever the topology; the job's
//! consumers take the windows in turn (consumer `c` of `C` the `c`-th, `(c + C)`-th, ... of
//! those not yet delivered), so the sequence of windows is the same for any world size and
//! worker count. The last, partial window of an epoch is dropped, or padded when asked.
//!
//! Every consumer walks the whole order (a window's place depends on every document before
//! it) but copies only its own windows' tokens; the records of the others are read (from the
//! host's cache, shared by its ranks) and checked, never converted. A saved position names a
//! window and where it starts: token `offset` of the document at position `doc` of the order
//! ([`WindowStart`]), so a resume, with any number of consumers, continues inside a document.
//! `docs/python.md` ("Token streams") gives the rules; `docs/order.md` the order.

use std::sync::mpsc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::format::array::Dtype;
use crate::format::{ColumnType, ValueRef};
use crate::order::{EpochProgress, OrderSpec, Tail, Topology, ORDER_VERSION};
use crate::stream::{Opened, ResumePoint, Sample, Stream, StreamConfig};
use crate::{Error, Result};

/// Longest window (`seq_len`) a stream cuts.
pub const SEQ_LEN_MAX: usize = 1 << 24;
/// Most windows in one batch.
pub const BATCH_WINDOWS_MAX: usize = 1 << 16;
/// Most tokens in one batch (`batch_size * (seq_len + 1)`).
pub const BATCH_TOKENS_MAX: usize = 1 << 31;
/// Most windows a saved position may list as delivered ahead of its first open one.
pub const AHEAD_MAX: usize = 1 << 22;

/// The integer type of the windows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TokenDtype {
    /// 32-bit.
    Int32,
    /// 64-bit (what `torch.nn.Embedding` indexes with by default).
    Int64,
}

impl TokenDtype {
    fn max(self) -> i64 {
        match self {
            TokenDtype::Int32 => i32::MAX as i64,
            TokenDtype::Int64 => i64::MAX,
        }
    }
}

/// How the windows are cut.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TokenOptions {
    /// The column holding each document's tokens.
    pub column: String,
    /// Tokens a window feeds the model; a window holds `seq_len + 1` (the targets are the
    /// inputs shifted by one).
    pub seq_len: usize,
    /// The end-of-document token appended after every document; `None` appends nothing.
    pub eos: Option<i64>,
    /// Pad the epoch's last, partial window with this token (its `lengths` entry says how many
    /// are real); `None` drops it.
    pub pad: Option<i64>,
    /// Also give each token's position in its document and its document's index in the window
    /// (`positions`, `segments`), for attention that stays inside documents.
    pub boundaries: bool,
    /// The windows' integer type.
    pub dtype: TokenDtype,
    /// The element type of a `bytes` token column (MosaicML's `tokens` bytes): `int32`,
    /// `uint16`, ... An array column states its own, and this must then be unset or agree.
    pub bytes_dtype: Option<String>,
    /// Windows per batch.
    pub batch_size: usize,
    /// Batches prepared ahead of the consumer.
    pub prefetch_batches: usize,
}

impl Default for TokenOptions {
    fn default() -> Self {
        TokenOptions {
            column: "tokens".into(),
            seq_len: 2048,
            eos: None,
            pad: None,
            boundaries: false,
            dtype: TokenDtype::Int64,
            bytes_dtype: None,
            batch_size: 8,
            prefetch_batches: 4,
        }
    }
}

impl TokenOptions {
    /// Refuses options that cannot work, naming the option.
    pub fn check(&self) -> Result<()> {
        if self.column.is_empty() {
            return Err(Error::invalid("column", "is empty"));
        }
        if self.seq_len == 0 || self.seq_len > SEQ_LEN_MAX {
            return Err(Error::invalid(
                "seq_len",
                format!("{} is not in 1..={SEQ_LEN_MAX}", self.seq_len),
            ));
        }
        if self.batch_size == 0 || self.batch_size > BATCH_WINDOWS_MAX {
            return Err(Error::invalid(
                "batch_size",
                format!("{} is not in 1..={BATCH_WINDOWS_MAX}", self.batch_size),
            ));
        }
        if self.batch_size.saturating_mul(self.seq_len + 1) > BATCH_TOKENS_MAX {
            return Err(Error::invalid(
                "batch_size",
                format!(
                    "{} windows of {} tokens exceed {BATCH_TOKENS_MAX} tokens a batch",
                    self.batch_size,
                    self.seq_len + 1
                ),
            ));
        }
        if self.prefetch_batches == 0 || self.prefetch_batches > 1024 {
            return Err(Error::invalid(
                "prefetch_batches",
                format!("{} is not in 1..=1024", self.prefetch_batches),
            ));
        }
        for (what, v) in [("eos", self.eos), ("pad", self.pad)] {
            if let Some(v) = v {
                if v < 0 || v > self.dtype.max() {
                    return Err(Error::invalid(
                        what,
                        format!("token {v} is not in 0..={} ({:?})", self.dtype.max(), self.dtype),
                    ));
                }
            }
        }
        self.bytes_dtype()?;
        Ok(())
    }

    fn bytes_dtype(&self) -> Result<Option<Dtype>> {
        match &self.bytes_dtype {
            None => Ok(None),
            Some(name) => match Dtype::parse(name) {
                Some(d) if d.is_int() => Ok(Some(d)),
                _ => Err(Error::invalid(
                    "token_dtype",
                    format!("{name:?} is not an integer type (int8..int64, uint8..uint64)"),
                )),
            },
        }
    }
}

/// Where window `window` of an epoch begins: token `offset` (counting the end-of-document
/// token as the document's last) of the document at position `doc` of the epoch's order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct WindowStart {
    /// The window's index in the epoch.
    pub window: u64,
    /// Its first token's document: a position in the epoch's order.
    pub doc: u64,
    /// Its first token's offset in that document.
    pub offset: u64,
}

/// A token job's position: every window below `start.window` was delivered, and so was each in
/// `ahead`. It means the same for any number of consumers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenResume {
    /// Always `"tokens"` (an image stream's state is refused by name).
    pub kind: String,
    /// The order's version.
    pub order_version: u32,
    /// Manifest versions of the sources.
    pub versions: Vec<String>,
    /// The document order.
    pub order: OrderSpec,
    /// The windows' `seq_len`.
    pub seq_len: u64,
    /// The end-of-document token.
    pub eos: Option<i64>,
    /// The epoch.
    pub epoch: u64,
    /// The first window not delivered, and where it begins.
    pub start: WindowStart,
    /// Windows after `start.window` already delivered, rising.
    pub ahead: Vec<u64>,
}

impl TokenResume {
    fn check(&self, opts: &TokenOptions) -> Result<()> {
        let bad = |why: String| Err(Error::invalid("token resume state", why));
        if self.kind != "tokens" {
            return bad(format!("kind {:?} is not \"tokens\"", self.kind));
        }
        if self.seq_len != opts.seq_len as u64 {
            return bad(format!(
                "it was saved with seq_len {}, not {}: its windows are other windows",
                self.seq_len, opts.seq_len
            ));
        }
        if self.eos != opts.eos {
            return bad(format!(
                "it was saved with eos {:?}, not {:?}: its windows are other windows",
                self.eos, opts.eos
            ));
        }
        if self.ahead.len() > AHEAD_MAX {
            return bad(format!("{} windows ahead (at most {AHEAD_MAX})", self.ahead.len()));
        }
        let mut last = self.start.window;
        for &a in &self.ahead {
            if a <= last {
                return bad(format!(
                    "window {a} ahead is not above {last} (ahead must rise above start.window)"
                ));
            }
            last = a;
        }
        Ok(())
    }

    fn progress(&self) -> EpochProgress {
        EpochProgress {
            epoch: self.epoch,
            consumed: self.start.window,
            ahead: self.ahead.clone(),
        }
    }
}

/// One consumer's position in a token job, to save and combine ([`TokenState::combine`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenState {
    /// The job's position the current deal started from.
    pub base: TokenResume,
    /// This consumer.
    pub consumer: usize,
    /// Consumers in the job.
    pub consumers: usize,
    /// Windows of the deal this consumer delivered.
    pub delivered: u64,
    /// Where this consumer's next window begins; `None` when it has none left in the epoch.
    pub next: Option<WindowStart>,
}

impl TokenState {
    /// The job's position from every consumer's state (one each, of the same deal).
    pub fn combine(states: &[TokenState]) -> Result<TokenResume> {
        let bad = |why: String| Err(Error::invalid("token states", why));
        let Some(first) = states.first() else {
            return bad("none given".into());
        };
        let c_n = first.consumers;
        if c_n != states.len() {
            return bad(format!("{} states for a job of {c_n} consumers", states.len()));
        }
        let mut seen = vec![false; c_n];
        for s in states {
            if s.base != first.base || s.consumers != c_n {
                return bad("they come from different jobs, epochs or deals".into());
            }
            if s.consumer >= c_n || std::mem::replace(&mut seen[s.consumer], true) {
                return bad(format!("consumer {} given twice or out of 0..{c_n}", s.consumer));
            }
        }
        let cs = c_n as u64;
        let base = &first.base;
        // The first window of the deal not delivered is R[i*], i* the smallest next index
        // (`delivered * C + c`); its owner knows where it starts. With no window there, every
        // later one is missing too: the epoch is over.
        let owner = states
            .iter()
            .min_by_key(|s| s.delivered.saturating_mul(cs).saturating_add(s.consumer as u64))
            .expect("at least one state");
        let Some(start) = owner.next else {
            return Ok(TokenResume {
                epoch: base.epoch + 1,
                start: WindowStart {
                    window: 0,
                    doc: 0,
                    offset: 0,
                },
                ahead: Vec::new(),
                ..base.clone()
            });
        };
        // The window deal is the sample deal's (`EpochProgress::advance`), over an order with
        // no known end.
        let mut delivered = vec![0; c_n];
        for s in states {
            delivered[s.consumer] = s.delivered;
        }
        let EpochProgress { consumed, ahead, .. } =
            base.progress()
                .advance(u64::MAX, &delivered, &crate::order::DealRule::strided(delivered.len()));
        if start.window != consumed {
            return bad(format!(
                "consumer {}'s next window is {}, but the deal's first open one is {consumed}",
                owner.consumer, start.window
            ));
        }
        if ahead.len() > AHEAD_MAX {
            return bad(format!(
                "{} windows delivered ahead of the slowest consumer (at most {AHEAD_MAX})",
                ahead.len()
            ));
        }
        Ok(TokenResume {
            start,
            ahead,
            ..base.clone()
        })
    }
}

/// The windows of a batch.
#[derive(Debug)]
pub enum TokenData {
    /// `int32`.
    I32(Vec<i32>),
    /// `int64`.
    I64(Vec<i64>),
}

impl TokenData {
    /// Tokens held.
    pub fn len(&self) -> usize {
        match self {
            TokenData::I32(v) => v.len(),
            TokenData::I64(v) => v.len(),
        }
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Token `i` (tests).
    pub fn get(&self, i: usize) -> i64 {
        match self {
            TokenData::I32(v) => v[i] as i64,
            TokenData::I64(v) => v[i],
        }
    }
}

/// Windows for one consumer: `windows.len()` rows of `seq_len + 1` tokens.
#[derive(Debug)]
pub struct TokenBatch {
    /// The epoch.
    pub epoch: u64,
    /// Each row's window index in the epoch.
    pub windows: Vec<u64>,
    /// The tokens, row after row.
    pub tokens: TokenData,
    /// Real tokens of each row (`seq_len + 1` but in a padded last window).
    pub lengths: Vec<i32>,
    /// With `boundaries`: each token's offset in its document (0 on padding).
    pub positions: Option<Vec<i32>>,
    /// With `boundaries`: each token's document, counted from 0 in its row (-1 on padding).
    pub segments: Option<Vec<i32>>,
    /// This consumer's position after the batch.
    pub state: TokenState,
    /// Documents read (by this consumer's walk, its own windows' or not) since the last batch.
    pub docs_read: u64,
}

/// Settings of a [`TokenStream`].
#[derive(Debug, Clone)]
pub struct TokenConfig {
    /// The documents: sources, order, topology (whose consumers deal the windows), cache.
    pub stream: StreamConfig,
    /// How they are cut.
    pub tokens: TokenOptions,
    /// The epoch read (from its start, or from `resume`).
    pub epoch: u64,
    /// The job's position to continue from (its epoch overrides `epoch`).
    pub resume: Option<TokenResume>,
}

/// The document being cut.
struct Doc {
    position: u64,
    sample: Sample,
    /// Byte range of its tokens in the record.
    data: std::ops::Range<usize>,
    dtype: Dtype,
    /// The largest id its source's tokenizer gives (`meta.tokenizer.max_id`), if recorded.
    vocab_max: Option<u64>,
    /// Tokens of the document, the end-of-document one included.
    len: u64,
}

enum Msg {
    /// A batch whose tokens are still to be copied out of their records (`pieces`), which the
    /// consumer's thread does ([`materialize`]): the token thread only walks and cuts.
    Batch(Box<TokenBatch>, Vec<Piece>),
    /// The epoch's end for this consumer, and its state there.
    End(TokenState),
    Failed(Error),
}

/// One consumer's windows of a token job, in batches, prepared ahead on a thread of its own.
pub struct TokenStream {
    rx: mpsc::Receiver<Msg>,
    /// For [`materialize`]: the column (errors name it) and the output type.
    column: String,
    dtype: TokenDtype,
    /// The state before any batch (this consumer's first window located).
    initial: Option<TokenState>,
    last: Option<TokenState>,
    ended: bool,
}

impl TokenStream {
    /// Opens the sources and starts cutting.
    pub fn open(cfg: TokenConfig) -> Result<TokenStream> {
        cfg.tokens.check()?;
        cfg.stream.check()?;
        let topo = cfg.stream.topology;
        let epoch = cfg.resume.as_ref().map_or(cfg.epoch, |r| r.epoch);
        let mut sc = cfg.stream.clone();
        sc.topology = Topology {
            rank: 0,
            world: 1,
            worker: 0,
            workers: 1,
            ..topo
        };
        sc.order.tail = Tail::Uneven;
        sc.first_epoch = epoch;
        sc.epochs = Some(epoch + 1);
        sc.resume_consumer = None;
        sc.resume = cfg.resume.as_ref().map(|r| ResumePoint {
            order_version: r.order_version,
            versions: r.versions.clone(),
            order: r.order,
            progress: EpochProgress {
                epoch: r.epoch,
                consumed: r.start.doc,
                ahead: Vec::new(),
            },
            audit: Default::default(),
        });
        let order = sc.order;
        // The stream checks the state's sources first (a state of another dataset is named as
        // such, not by the eos it happened to be saved with), then the state's windows.
        let stream = Stream::open(sc)?;
        if let Some(r) = &cfg.resume {
            r.check(&cfg.tokens)?;
        }
        let base = cfg.resume.clone().unwrap_or_else(|| TokenResume {
            kind: "tokens".into(),
            order_version: ORDER_VERSION,
            versions: stream.versions(),
            order,
            seq_len: cfg.tokens.seq_len as u64,
            eos: cfg.tokens.eos,
            epoch,
            start: WindowStart {
                window: 0,
                doc: 0,
                offset: 0,
            },
            ahead: Vec::new(),
        });
        let bytes_dtype = cfg.tokens.bytes_dtype()?;
        let mut cutter = Cutter {
            stream,
            opts: cfg.tokens.clone(),
            bytes_dtype,
            consumer: topo.consumer() as u64,
            consumers: topo.consumers() as u64,
            skip: Some((base.start.doc, base.start.offset)),
            w: base.start.window,
            base,
            ahead_at: 0,
            r_index: 0,
            fill: 0,
            started: false,
            mine: false,
            seg: 0,
            doc: None,
            t: 0,
            delivered: 0,
            docs_read: 0,
            columns: Vec::new(),
            vocab_maxes: Vec::new(),
            exhausted: false,
        };
        // The first window of this consumer is located before the stream is handed out, so
        // its state is complete from the start (a consumer that yields nothing still has one).
        let initial = cutter.walk_to_next_own()?;
        let (tx, rx) = mpsc::sync_channel(cfg.tokens.prefetch_batches);
        std::thread::Builder::new()
            .name("ramjet-tokens".into())
            .spawn(move || loop {
                match cutter.batch() {
                    Ok(Some((b, pieces))) => {
                        if tx.send(Msg::Batch(Box::new(b), pieces)).is_err() {
                            return;
                        }
                    }
                    Ok(None) => {
                        let _ = tx.send(Msg::End(cutter.state(None)));
                        return;
                    }
                    Err(e) => {
                        let _ = tx.send(Msg::Failed(e));
                        return;
                    }
                }
            })
            .map_err(|e| Error::io("spawning the token thread", e))?;
        Ok(TokenStream {
            rx,
            column: cfg.tokens.column.clone(),
            dtype: cfg.tokens.dtype,
            initial: Some(initial),
            last: None,
            ended: false,
        })
    }

    /// The next batch; `Ok(None)` after the epoch's last. Waits at most `wait` (then
    /// `Err(None)`), so a caller can answer signals in between.
    pub fn next_batch_timeout(&mut self, wait: Duration) -> std::result::Result<Option<TokenBatch>, Option<Error>> {
        if self.ended {
            return Ok(None);
        }
        match self.rx.recv_timeout(wait) {
            Ok(Msg::Batch(mut b, pieces)) => match materialize(&pieces, self.dtype, &self.column) {
                Ok(tokens) => {
                    b.tokens = tokens;
                    self.last = Some(b.state.clone());
                    Ok(Some(*b))
                }
                Err(e) => {
                    self.ended = true;
                    Err(Some(e))
                }
            },
            Ok(Msg::End(state)) => {
                self.last = Some(state);
                self.ended = true;
                Ok(None)
            }
            Ok(Msg::Failed(e)) => {
                self.ended = true;
                Err(Some(e))
            }
            Err(mpsc::RecvTimeoutError::Timeout) => Err(None),
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                self.ended = true;
                Ok(None)
            }
        }
    }

    /// The next batch; `Ok(None)` after the epoch's last.
    pub fn next_batch(&mut self) -> Result<Option<TokenBatch>> {
        loop {
            match self.next_batch_timeout(Duration::from_secs(3600)) {
                Ok(b) => return Ok(b),
                Err(Some(e)) => return Err(e),
                Err(None) => continue,
            }
        }
    }

    /// This consumer's position after the last batch it handed out.
    pub fn state(&self) -> TokenState {
        self.last
            .clone()
            .or_else(|| self.initial.clone())
            .expect("a stream holds its initial state")
    }
}

/// The walk over the documents, cutting windows.
struct Cutter {
    stream: Stream,
    opts: TokenOptions,
    bytes_dtype: Option<Dtype>,
    consumer: u64,
    consumers: u64,
    base: TokenResume,
    /// The resume point's first document and offset, until reached.
    skip: Option<(u64, u64)>,
    /// Next unmatched entry of `base.ahead`.
    ahead_at: usize,
    /// The index in the deal's remaining windows the next window not ahead takes.
    r_index: u64,
    /// The window being cut.
    w: u64,
    /// Its tokens so far.
    fill: usize,
    /// Whether `mine` is known for `w`.
    started: bool,
    /// Whether `w` is this consumer's.
    mine: bool,
    /// The current document's index in the window (boundaries).
    seg: i32,
    doc: Option<Doc>,
    /// Offset in `doc`.
    t: u64,
    delivered: u64,
    docs_read: u64,
    /// Per source: the token column's index and element type (`None` for a bytes column
    /// read with `bytes_dtype`).
    columns: Vec<Option<(usize, Option<Dtype>)>>,
    /// Per source: the largest id its tokenizer gives, when recorded (looked up with its column).
    vocab_maxes: Vec<Option<u64>>,
    exhausted: bool,
}

/// Rows of a batch being filled.
struct Rows {
    windows: Vec<u64>,
    /// The rows' tokens, to be copied on the consumer's thread.
    pieces: Vec<Piece>,
    /// Tokens in `pieces`.
    planned: usize,
    lengths: Vec<i32>,
    positions: Option<Vec<i32>>,
    segments: Option<Vec<i32>>,
}

impl Cutter {
    fn state(&self, next: Option<WindowStart>) -> TokenState {
        TokenState {
            base: self.base.clone(),
            consumer: self.consumer as usize,
            consumers: self.consumers as usize,
            delivered: self.delivered,
            next,
        }
    }

    /// Makes `doc` a document with tokens left at `t`; false at the epoch's end.
    fn ensure_doc(&mut self) -> Result<bool> {
        loop {
            if let Some(d) = &self.doc {
                if self.t < d.len {
                    return Ok(true);
                }
            }
            self.doc = None;
            if self.exhausted {
                return Ok(false);
            }
            let Some(sample) = self.stream.next_sample()? else {
                self.exhausted = true;
                if let Some((doc, _)) = self.skip {
                    return Err(Error::invalid(
                        "token resume state",
                        format!("document {doc} is past the epoch's end"),
                    ));
                }
                return Ok(false);
            };
            self.docs_read += 1;
            let doc = self.open_doc(sample)?;
            self.t = 0;
            if let Some((at, offset)) = self.skip.take() {
                if doc.position != at {
                    return Err(Error::invalid(
                        "token resume state",
                        format!("the stream resumed at document {}, not {at}", doc.position),
                    ));
                }
                if offset >= doc.len {
                    return Err(Error::invalid(
                        "token resume state",
                        format!(
                            "offset {offset} is past document {at}'s {} tokens (source {}, sample {})",
                            doc.len, doc.sample.id.source, doc.sample.global_index
                        ),
                    ));
                }
                self.t = offset;
            }
            self.doc = Some(doc);
        }
    }

    fn open_doc(&mut self, sample: Sample) -> Result<Doc> {
        let source = sample.id.source as usize;
        let where_ = || format!("source {source}, sample {}", sample.global_index);
        if self.columns.len() <= source {
            self.columns.resize(source + 1, None);
            self.vocab_maxes.resize(source + 1, None);
        }
        if self.columns[source].is_none() {
            let schema = sample.schema();
            let Some(i) = schema.index_of(&self.opts.column) else {
                return Err(Error::invalid(
                    "column",
                    format!(
                        "source {source} has no column {:?} (its columns: {})",
                        self.opts.column,
                        schema.describe()
                    ),
                ));
            };
            let kind = match schema.columns[i].ty {
                ColumnType::Array(spec) => {
                    if let Some(d) = spec.dtype {
                        if !d.is_int() {
                            return Err(Error::invalid(
                                "column",
                                format!(
                                    "column {:?} of source {source} holds {}, not integers",
                                    self.opts.column,
                                    d.name()
                                ),
                            ));
                        }
                    }
                    (i, spec.dtype)
                }
                ColumnType::Bytes if self.bytes_dtype.is_some() => (i, None),
                ColumnType::Bytes => {
                    return Err(Error::invalid(
                        "token_dtype",
                        format!(
                            "column {:?} of source {source} is bytes: give the element type its bytes hold (token_dtype=\"int32\", \"uint16\", ...)",
                            self.opts.column
                        ),
                    ))
                }
                t => {
                    return Err(Error::invalid(
                        "column",
                        format!(
                            "column {:?} of source {source} is {}, not a token array or bytes",
                            self.opts.column,
                            t.name()
                        ),
                    ))
                }
            };
            self.columns[source] = Some(kind);
            self.vocab_maxes[source] = vocab_max(self.stream.dataset(source), &self.opts.column);
            self.check_eos(source, kind.1.or(self.bytes_dtype))?;
        }
        let (col, _) = self.columns[source].expect("set above");
        let values = sample.values()?;
        let base = sample.record.as_ptr() as usize;
        let (data, dtype) = match values[col] {
            ValueRef::Array(a) => {
                if !a.dtype.is_int() {
                    return Err(Error::invalid(
                        "column",
                        format!(
                            "{}: column {:?} holds {}, not integers",
                            where_(),
                            self.opts.column,
                            a.dtype.name()
                        ),
                    ));
                }
                (a.data, a.dtype)
            }
            ValueRef::Bytes(b) => {
                let d = self.bytes_dtype.expect("checked with the column");
                if b.len() % d.size() != 0 {
                    return Err(Error::corrupt(
                        crate::Location::sample(format!("source {source}"), sample.global_index),
                        format!(
                            "column {:?}: {} bytes are not whole {} tokens",
                            self.opts.column,
                            b.len(),
                            d.name()
                        ),
                    ));
                }
                (b, d)
            }
            _ => unreachable!("the column's type was checked"),
        };
        let start = data.as_ptr() as usize - base;
        let n = (data.len() / dtype.size()) as u64;
        let len = n + self.opts.eos.is_some() as u64;
        let vocab_max = self.vocab_maxes[source];
        Ok(Doc {
            position: sample.position,
            data: start..start + data.len(),
            dtype,
            vocab_max,
            len,
            sample,
        })
    }

    /// Decides whether window `w` is this consumer's, once.
    fn start_window(&mut self) {
        if self.started {
            return;
        }
        self.started = true;
        if self.base.ahead.get(self.ahead_at) == Some(&self.w) {
            self.ahead_at += 1;
            self.mine = false;
        } else {
            self.mine = self.r_index % self.consumers == self.consumer;
            self.r_index += 1;
        }
        self.seg = 0;
    }

    /// Walks to the start of this consumer's next window; its state with that start.
    fn walk_to_next_own(&mut self) -> Result<TokenState> {
        loop {
            if !self.ensure_doc()? {
                return Ok(self.state(None));
            }
            if self.fill == 0 {
                self.start_window();
                if self.mine {
                    let d = self.doc.as_ref().expect("ensured");
                    return Ok(self.state(Some(WindowStart {
                        window: self.w,
                        doc: d.position,
                        offset: self.t,
                    })));
                }
            }
            self.advance(None)?;
        }
    }

    /// Moves the cut forward within the current document, to the end of the document or of
    /// the window, copying the tokens into `rows` when the window is this consumer's.
    fn advance(&mut self, rows: Option<&mut Rows>) -> Result<()> {
        let width = self.opts.seq_len + 1;
        let d = self.doc.as_ref().expect("ensured");
        let k = (d.len - self.t).min((width - self.fill) as u64);
        if self.mine {
            let rows = rows.expect("an own window is cut into rows");
            let n = d.len - self.opts.eos.is_some() as u64;
            let from = self.t;
            let to = self.t + k;
            let real_to = to.min(n);
            if from < real_to {
                let size = d.dtype.size();
                rows.push(Piece::Tokens {
                    rec: d.sample.record.clone(),
                    at: d.data.start + from as usize * size,
                    n: (real_to - from) as usize,
                    dtype: d.dtype,
                    vocab_max: d.vocab_max,
                    source: d.sample.id.source,
                    sample: d.sample.global_index,
                });
            }
            if to > n {
                rows.push(Piece::Fill {
                    v: self.opts.eos.expect("a token past the document is its eos"),
                    n: 1,
                });
            }
            if let (Some(p), Some(s)) = (&mut rows.positions, &mut rows.segments) {
                if self.fill > 0 && from == 0 {
                    self.seg += 1;
                }
                p.extend((from..to).map(|x| x.min(i32::MAX as u64) as i32));
                s.extend(std::iter::repeat_n(self.seg, k as usize));
            }
        }
        self.t += k;
        self.fill += k as usize;
        if self.fill == width {
            self.w += 1;
            self.fill = 0;
            self.started = false;
        }
        Ok(())
    }

    /// The next batch of this consumer's windows, `None` after the epoch's last.
    fn batch(&mut self) -> Result<Option<(TokenBatch, Vec<Piece>)>> {
        let width = self.opts.seq_len + 1;
        let b = self.opts.batch_size;
        let mut rows = Rows {
            windows: Vec::with_capacity(b),
            pieces: Vec::with_capacity(b * 8),
            planned: 0,
            lengths: Vec::with_capacity(b),
            positions: self.opts.boundaries.then(|| Vec::with_capacity(b * width)),
            segments: self.opts.boundaries.then(|| Vec::with_capacity(b * width)),
        };
        let next = loop {
            if !self.ensure_doc()? {
                // The epoch's end: a partial window of this consumer is padded or dropped.
                if self.fill > 0 && self.mine {
                    if let Some(pad) = self.opts.pad {
                        let real = self.fill;
                        rows.push(Piece::Fill {
                            v: pad,
                            n: width - real,
                        });
                        if let (Some(p), Some(s)) = (&mut rows.positions, &mut rows.segments) {
                            p.extend(std::iter::repeat_n(0, width - real));
                            s.extend(std::iter::repeat_n(-1, width - real));
                        }
                        rows.windows.push(self.w);
                        rows.lengths.push(real as i32);
                        self.delivered += 1;
                    } else {
                        let keep = rows.windows.len() * width;
                        rows.truncate(keep);
                    }
                }
                self.fill = 0;
                break None;
            }
            if self.fill == 0 {
                self.start_window();
                if self.mine && rows.windows.len() == b {
                    let d = self.doc.as_ref().expect("ensured");
                    break Some(WindowStart {
                        window: self.w,
                        doc: d.position,
                        offset: self.t,
                    });
                }
            }
            let (w, mine) = (self.w, self.mine);
            self.advance(Some(&mut rows))?;
            if mine && self.w != w {
                rows.windows.push(w);
                rows.lengths.push(width as i32);
                self.delivered += 1;
            }
        };
        if rows.windows.is_empty() && next.is_none() {
            return Ok(None);
        }
        let docs_read = std::mem::take(&mut self.docs_read);
        let empty = match self.opts.dtype {
            TokenDtype::Int32 => TokenData::I32(Vec::new()),
            TokenDtype::Int64 => TokenData::I64(Vec::new()),
        };
        let batch = TokenBatch {
            epoch: self.base.epoch,
            windows: rows.windows,
            tokens: empty,
            lengths: rows.lengths,
            positions: rows.positions,
            segments: rows.segments,
            state: self.state(next),
            docs_read,
        };
        Ok(Some((batch, rows.pieces)))
    }
}

/// A run of a batch's tokens: cut on the token thread, copied (widened, range-checked) on the
/// consumer's thread by [`materialize`].
enum Piece {
    /// `n` tokens of `dtype`, little-endian, at byte `at` of the record of sample `sample` of
    /// source `source`.
    Tokens {
        rec: bytes::Bytes,
        at: usize,
        n: usize,
        dtype: Dtype,
        /// The largest id the source's tokenizer gives, when recorded.
        vocab_max: Option<u64>,
        source: u32,
        sample: u64,
    },
    /// `n` tokens `v` (an end-of-document token, padding).
    Fill { v: i64, n: usize },
}

impl Piece {
    fn len(&self) -> usize {
        match self {
            Piece::Tokens { n, .. } | Piece::Fill { n, .. } => *n,
        }
    }
}

impl Rows {
    fn push(&mut self, p: Piece) {
        self.planned += p.len();
        self.pieces.push(p);
    }

    /// Drops every token past the first `len` (a partial row).
    fn truncate(&mut self, len: usize) {
        while self.planned > len {
            let over = self.planned - len;
            let last = self.pieces.last_mut().expect("tokens are in pieces");
            let n = last.len();
            if n <= over {
                self.pieces.pop();
                self.planned -= n;
            } else {
                match last {
                    Piece::Tokens { n, .. } | Piece::Fill { n, .. } => *n -= over,
                }
                self.planned -= over;
            }
        }
        if let Some(p) = &mut self.positions {
            p.truncate(len);
        }
        if let Some(s) = &mut self.segments {
            s.truncate(len);
        }
    }
}

/// A batch's tokens, copied out of their records into one buffer of the output type; a token
/// out of the type's range (negative, or too large) is an error naming its sample and column.
fn materialize(pieces: &[Piece], dtype: TokenDtype, column: &str) -> Result<TokenData> {
    let total = pieces.iter().map(Piece::len).sum();
    let mut out = match dtype {
        TokenDtype::Int32 => TokenData::I32(Vec::with_capacity(total)),
        TokenDtype::Int64 => TokenData::I64(Vec::with_capacity(total)),
    };
    for p in pieces {
        match p {
            Piece::Tokens {
                rec,
                at,
                n,
                dtype: d,
                vocab_max,
                source,
                sample,
            } => {
                let max = vocab_max.map_or(dtype.max() as i128, |m| (m as i128).min(dtype.max() as i128));
                convert(*d, &rec[*at..*at + n * d.size()], max, &mut out).map_err(|v| {
                    let why = match vocab_max {
                        Some(m) if (*m as i128) < dtype.max() as i128 => {
                            format!("the tokenizer's largest id, {m}, recorded by pack --tokenizer")
                        }
                        _ => format!("{dtype:?}"),
                    };
                    Error::corrupt(
                        crate::Location::sample(format!("source {source}"), *sample),
                        format!("column {column:?}: token {v} is not in 0..={max} ({why})"),
                    )
                })?
            }
            Piece::Fill { v, n } => match &mut out {
                TokenData::I32(o) => o.extend(std::iter::repeat_n(*v as i32, *n)),
                TokenData::I64(o) => o.extend(std::iter::repeat_n(*v, *n)),
            },
        }
    }
    Ok(out)
}

impl Cutter {
    /// `eos` must be an id source `source`'s documents can hold: at most its tokenizer's largest
    /// id when recorded, else the column's element type's largest (a uint16 column's eos of
    /// 2**40 is an id no embedding of its vocabulary has). `pad` is not held to it: it fills
    /// only the positions `lengths` marks as padding, and is often chosen outside the
    /// vocabulary on purpose.
    fn check_eos(&self, source: usize, dtype: Option<Dtype>) -> Result<()> {
        let (bound, why) = match (self.vocab_maxes[source], dtype) {
            (Some(m), _) => (m as i128, "its tokenizer's largest id, recorded by pack --tokenizer"),
            (None, Some(d)) => (int_max(d), "the largest its token column's element type holds"),
            (None, None) => return Ok(()),
        };
        match self.opts.eos.filter(|&v| v as i128 > bound) {
            Some(v) => Err(Error::invalid(
                "eos",
                format!("token {v} is above {bound}, {why} (source {source})"),
            )),
            None => Ok(()),
        }
    }
}

/// The largest value of the integer type `d`.
fn int_max(d: Dtype) -> i128 {
    let bits = d.size() as u32 * 8;
    match d {
        Dtype::I8 | Dtype::I16 | Dtype::I32 | Dtype::I64 => (1i128 << (bits - 1)) - 1,
        _ => (1i128 << bits) - 1,
    }
}

/// The largest token id `ds`'s tokenizer gives, when `ramjet pack --tokenizer` recorded it for
/// `column` (`meta.tokenizer.max_id`): every id read must be at most this.
fn vocab_max(ds: &crate::Dataset, column: &str) -> Option<u64> {
    let t = ds.manifest().meta.get("tokenizer")?;
    if t.get("column").and_then(|c| c.as_str()) != Some(column) {
        return None;
    }
    t.get("max_id")?.as_u64()
}

/// Appends little-endian `dtype` elements to `out`; the first value out of range (negative, or
/// above `max`, at most the output type's largest) is the error.
fn convert(dtype: Dtype, src: &[u8], max: i128, out: &mut TokenData) -> std::result::Result<(), i128> {
    // A check pass, then a widening pass: both vectorize (a per-element push with its range
    // check did not), and the check folds away where every value fits (uint16 into int32).
    macro_rules! run {
        ($t:ty, $n:literal, $o:expr, $ot:ty) => {{
            let vals = src
                .chunks_exact($n)
                .map(|c| <$t>::from_le_bytes(c.try_into().expect("chunk size")));
            if let Some(bad) = vals
                .clone()
                .find(|&v| !((v as i128) >= 0 && (v as i128) <= max.min(<$ot>::MAX as i128)))
            {
                return Err(bad as i128);
            }
            $o.extend(vals.map(|v| v as $ot));
        }};
    }
    macro_rules! each {
        ($o:expr, $ot:ty) => {
            match dtype {
                Dtype::I8 => run!(i8, 1, $o, $ot),
                Dtype::I16 => run!(i16, 2, $o, $ot),
                Dtype::I32 => run!(i32, 4, $o, $ot),
                Dtype::I64 => run!(i64, 8, $o, $ot),
                Dtype::U8 => run!(u8, 1, $o, $ot),
                Dtype::U16 => run!(u16, 2, $o, $ot),
                Dtype::U32 => run!(u32, 4, $o, $ot),
                Dtype::U64 => run!(u64, 8, $o, $ot),
                _ => unreachable!("token columns are checked to be integers"),
            }
        };
    }
    match out {
        TokenData::I32(o) => each!(o, i32),
        TokenData::I64(o) => each!(o, i64),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(ids: &[u16], vocab_max: Option<u64>) -> Piece {
        let rec: Vec<u8> = ids.iter().flat_map(|x| x.to_le_bytes()).collect();
        Piece::Tokens {
            rec: bytes::Bytes::from(rec),
            at: 0,
            n: ids.len(),
            dtype: Dtype::U16,
            vocab_max,
            source: 0,
            sample: 7,
        }
    }

    /// Regression: a token id past the tokenizer's recorded vocabulary (a shard written with ids
    /// cut to 16 bits, or tampered) was read as a valid token. It is a `CorruptError` naming the
    /// sample and the bound; within the bound, the ids are read as they are.
    #[test]
    fn a_token_above_the_recorded_vocabulary_is_corrupt_naming_the_bound() {
        let got = materialize(&[piece(&[1, 300, 65_535], None)], TokenDtype::Int64, "tokens").unwrap();
        assert!(matches!(got, TokenData::I64(v) if v == [1, 300, 65_535]));
        let ok = materialize(&[piece(&[1, 300], Some(300))], TokenDtype::Int32, "tokens").unwrap();
        assert!(matches!(ok, TokenData::I32(v) if v == [1, 300]));
        let e = materialize(&[piece(&[1, 301], Some(300))], TokenDtype::Int64, "tokens")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("token 301") && e.contains("0..=300") && e.contains("sample 7"),
            "{e}"
        );
    }
}
