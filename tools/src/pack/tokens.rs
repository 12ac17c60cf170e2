//! `ramjet pack --tokenizer FILE`: a JSONL text column tokenized with a Hugging Face
//! `tokenizer.json` (the Rust `tokenizers` crate, the library behind the Python package) and
//! stored as a `tokens` array column in its place. Each chunk of lines (8 MiB) is tokenized as
//! one batch on the pack's thread pool, then packed in line order, so memory stays one chunk
//! and a few shards whatever the input's size.

use serde_json::{Map, Value as Json};
use tokenizers::Tokenizer;

use ramjet_engine::format::array::{Array, ArraySpec, Dims, Dtype};
use ramjet_engine::format::{encoded_len, ColumnType, Schema, Value};
use ramjet_engine::{Error, Result};

use super::Ctx;

/// The name of the column the tokens are stored in.
pub const TOKENS_COLUMN: &str = "tokens";

/// End-of-document tokens looked for, in this order, among a tokenizer's added tokens; the
/// first one present is recorded as the dataset's `eos` (what `TokenDataset(eos="auto")` uses).
const EOS_NAMES: [&str; 7] = [
    "<|endoftext|>",
    "<|end_of_text|>",
    "</s>",
    "<eos>",
    "<|eos|>",
    "[EOS]",
    "[SEP]",
];

/// A loaded tokenizer and what the manifest records of it.
pub struct Tok {
    /// The tokenizer.
    pub tokenizer: Tokenizer,
    /// Its file's name.
    pub file: String,
    /// XXH3-64 of its file, 16 hex digits.
    pub checksum: String,
    /// Entries of its vocabulary (added tokens included).
    pub vocab: usize,
    /// The largest id it can give (added tokens included): what the ids' element type must
    /// hold. Ids need not be dense, so this can be far above `vocab`.
    pub max_id: u32,
    /// Its end-of-document token and id, if it has one of [`EOS_NAMES`].
    pub eos: Option<(String, u32)>,
}

impl Tok {
    /// Loads `path` (a local `tokenizer.json`).
    pub fn load(path: &str) -> Result<Tok> {
        // A tokenizer.json is megabytes; a path naming a device or a FIFO is refused.
        let bytes = ramjet_engine::io::read_file_bounded(std::path::Path::new(path), 1 << 30)
            .map_err(|e| Error::invalid(format!("--tokenizer {path}"), e.to_string()))?;
        let tokenizer = Tokenizer::from_bytes(&bytes)
            .map_err(|e| Error::invalid(format!("--tokenizer {path}"), format!("not a tokenizer.json: {e}")))?;
        let vocab = tokenizer.get_vocab_size(true);
        if vocab == 0 {
            return Err(Error::invalid(format!("--tokenizer {path}"), "its vocabulary is empty"));
        }
        let max_id = tokenizer.get_vocab(true).into_values().max().unwrap_or(0);
        let eos = EOS_NAMES
            .iter()
            .find_map(|n| tokenizer.token_to_id(n).map(|id| ((*n).to_owned(), id)));
        Ok(Tok {
            tokenizer,
            file: path.rsplit('/').next().unwrap_or(path).to_owned(),
            checksum: format!("{:016x}", xxhash_rust::xxh3::xxh3_64(&bytes)),
            vocab,
            max_id,
            eos,
        })
    }

    /// The element type its ids are stored in: the narrowest that holds its largest id.
    pub fn dtype(&self) -> Dtype {
        if self.max_id <= u16::MAX as u32 {
            Dtype::U16
        } else {
            Dtype::U32
        }
    }
}

/// The shards' schema and the manifest's `tokenizer` entry: `text_column` (which must hold
/// strings) replaced, in its place, by [`TOKENS_COLUMN`].
pub fn tokenized_schema(input: &Schema, text_column: &str, tok: &Tok, display: &str) -> Result<(Schema, Json)> {
    let Some(i) = input.index_of(text_column) else {
        return Err(Error::invalid(
            "--text-column",
            format!("no column {text_column:?} in {display} ({})", input.describe()),
        ));
    };
    if input.columns[i].ty != ColumnType::Str {
        return Err(Error::invalid(
            "--text-column",
            format!(
                "column {text_column:?} of {display} holds {}, not text",
                input.columns[i].ty.name()
            ),
        ));
    }
    if text_column != TOKENS_COLUMN && input.index_of(TOKENS_COLUMN).is_some() {
        return Err(Error::invalid(
            "--tokenizer",
            format!("{display} already has a column {TOKENS_COLUMN:?}, where the tokens would go"),
        ));
    }
    let ty = ColumnType::Array(ArraySpec {
        dtype: Some(tok.dtype()),
        dims: Dims::Rank {
            rank: 1,
            dims: [ramjet_engine::format::array::FREE; ramjet_engine::format::array::DECLARED_RANK_MAX],
        },
    });
    let mut cols = input.columns.clone();
    cols[i] = ramjet_engine::format::Column {
        name: TOKENS_COLUMN.to_owned(),
        ty,
        nullable: false,
    };
    let schema = Schema::from_columns(cols)?;
    let mut info = Map::new();
    info.insert("file".into(), Json::from(tok.file.clone()));
    info.insert("checksum".into(), Json::from(tok.checksum.clone()));
    info.insert("vocab_size".into(), Json::from(tok.vocab));
    info.insert("max_id".into(), Json::from(tok.max_id));
    info.insert("text_column".into(), Json::from(text_column));
    info.insert("column".into(), Json::from(TOKENS_COLUMN));
    info.insert("dtype".into(), Json::from(tok.dtype().name()));
    info.insert(
        "eos".into(),
        tok.eos.as_ref().map_or(Json::Null, |(_, id)| Json::from(*id)),
    );
    info.insert(
        "eos_token".into(),
        tok.eos.as_ref().map_or(Json::Null, |(n, _)| Json::from(n.clone())),
    );
    Ok((schema, Json::Object(info)))
}

/// A pack's tokenizing step.
pub struct Tokenize {
    tok: Tok,
    /// The schema the lines are parsed with (the text column as text).
    pub input: Schema,
    column: usize,
    dtype: Dtype,
}

impl Tokenize {
    /// The step for `ctx`, `None` without `--tokenizer`. The layout (this run's, or a split
    /// pack's plan) must have been made with the same tokenizer file.
    pub(crate) fn of(ctx: &Ctx) -> Result<Option<Tokenize>> {
        let recorded = ctx.layout.meta.get("tokenizer");
        let Some(path) = &ctx.opts.tokenizer else {
            if let Some(r) = recorded {
                return Err(Error::invalid(
                    "--tokenizer",
                    format!("the pack's plan tokenizes with {r}: give --tokenizer with that file"),
                ));
            }
            return Ok(None);
        };
        let tok = Tok::load(path)?;
        let want = recorded.and_then(|r| r.get("checksum")).and_then(Json::as_str);
        if want != Some(tok.checksum.as_str()) {
            return Err(Error::invalid(
                format!("--tokenizer {path}"),
                format!(
                    "its checksum {} is not the one the pack's layout was made with ({})",
                    tok.checksum,
                    want.unwrap_or("none: made without --tokenizer")
                ),
            ));
        }
        let text = recorded
            .and_then(|r| r.get("text_column"))
            .and_then(Json::as_str)
            .unwrap_or("text")
            .to_owned();
        let schema = &ctx.layout.schema;
        let column = schema
            .index_of(TOKENS_COLUMN)
            .ok_or_else(|| Error::invalid("--tokenizer", format!("the layout has no {TOKENS_COLUMN:?} column")))?;
        let input = Schema::new(schema.columns.iter().enumerate().map(|(j, c)| {
            if j == column {
                (text.clone(), ColumnType::Str)
            } else {
                (c.name.clone(), c.ty)
            }
        }))?;
        let dtype = tok.dtype();
        Ok(Some(Tokenize {
            tok,
            input,
            column,
            dtype,
        }))
    }

    /// Replaces the text of every good row by its tokens (one batch, on the pack's thread
    /// pool); a text the tokenizer refuses makes its row an error naming the line.
    pub fn apply(
        &self,
        lines: &[(usize, String)],
        rows: &mut [Result<(Vec<Value>, u64)>],
        what: &(dyn Fn(usize) -> String + Sync),
    ) {
        let c = self.column;
        let texts: Vec<&str> = rows
            .iter()
            .filter_map(|r| match r {
                Ok((v, _)) => match &v[c] {
                    Value::Str(s) => Some(s.as_str()),
                    _ => None,
                },
                Err(_) => None,
            })
            .collect();
        if texts.is_empty() {
            return;
        }
        let mut encoded = match self.tok.tokenizer.encode_batch_fast(texts.clone(), false) {
            Ok(e) => e.into_iter().map(Ok).collect::<Vec<_>>(),
            // The batch failed as a whole: each text is tried alone, so the error names its line.
            Err(_) => texts
                .iter()
                .map(|t| self.tok.tokenizer.encode_fast(*t, false).map_err(|e| e.to_string()))
                .collect(),
        }
        .into_iter();
        for ((n, _), r) in lines.iter().zip(rows.iter_mut()) {
            let Ok((vals, size)) = r else { continue };
            if !matches!(vals[c], Value::Str(_)) {
                continue;
            }
            match encoded.next().expect("one encoding a text") {
                Ok(e) => {
                    let ids = e.get_ids();
                    // Every id fits the dtype chosen from the largest (checked, never wrapped).
                    if let Some(&bad) = ids.iter().find(|&&x| x > self.tok.max_id) {
                        *r = Err(Error::invalid(
                            what(*n),
                            format!(
                                "--tokenizer gave id {bad}, above its vocabulary's largest, {}",
                                self.tok.max_id
                            ),
                        ));
                        continue;
                    }
                    let mut data = Vec::with_capacity(ids.len() * self.dtype.size());
                    match self.dtype {
                        Dtype::U16 => ids
                            .iter()
                            .for_each(|&x| data.extend_from_slice(&(x as u16).to_le_bytes())),
                        _ => ids.iter().for_each(|&x| data.extend_from_slice(&x.to_le_bytes())),
                    }
                    let a = Array::new(self.dtype, vec![ids.len() as u64], data).expect("ids of the dtype's size");
                    vals[c] = Value::Array(a);
                    *size = encoded_len(vals);
                }
                Err(why) => {
                    *r = Err(Error::invalid(
                        what(*n),
                        format!(
                            "--tokenizer refuses the text of column {:?}: {why}",
                            self.input.columns[c].name
                        ),
                    ))
                }
            }
        }
    }
}
