//! LitData's optimized datasets (`litdata.optimize`: `index.json` and `chunk-*.bin`), read as
//! the MDS layout they share: a chunk is a `u32` item count, `u32` offsets (count + 1, from the
//! file start), then the items; an item is a `u32` size for every field, then the fields.
//! So a LitData index is read here as an MDS [`Index`](super::mds::Index) whose every column
//! gives its size, and everything after (checks, transcoding, sample indexes, learning) is the
//! MDS path's (`docs/format.md`, "LitData").

use serde::Deserialize;
use serde_json::Value as Json;

use super::mds::{Index, IndexFile, IndexShard};
use crate::error::{Error, Invalid, Result};

/// LitData's `index.json`.
#[derive(Debug, Deserialize)]
struct LitIndex {
    chunks: Vec<LitChunk>,
    config: LitConfig,
}

/// One chunk of `index.json`.
#[derive(Debug, Deserialize)]
struct LitChunk {
    chunk_bytes: u64,
    chunk_size: u64,
    filename: String,
}

/// The writer's settings in `index.json`.
#[derive(Debug, Deserialize)]
struct LitConfig {
    #[serde(default)]
    compression: Option<String>,
    #[serde(default)]
    compression_level: Option<String>,
    data_format: Vec<String>,
    #[serde(default)]
    data_spec: Option<String>,
    #[serde(default)]
    encryption: Option<Json>,
    #[serde(default)]
    item_loader: Option<String>,
}

/// The MDS encoding a LitData field format is read as (the same bytes), or why it is refused.
fn encoding(format: &str) -> std::result::Result<String, Invalid> {
    let (name, arg) = format.split_once(':').unwrap_or((format, ""));
    let dtype = || {
        arg.parse::<usize>()
            .ok()
            .and_then(super::mds::litdata_dtype)
            .map(|d| d.name())
            .ok_or_else(|| format!("LitData field {format:?}: a NumPy dtype ramjet does not read"))
    };
    Ok(match name {
        "int" => "int64".into(),
        "float" => "float64".into(),
        "bool" => "uint8".into(),
        "str" | "bytes" | "jpeg" | "pil" => name.into(),
        "numpy" => "litdata-numpy".into(),
        "no_header_numpy" => format!("litdata-numpy:{}", dtype()?),
        "pickle" => return Err("LitData field \"pickle\" is refused: unpickling runs arbitrary code".into()),
        other => return Err(format!("LitData field {other:?} is not one ramjet reads").into()),
    })
}

/// The field names: a dict's keys (the pytree spec's context), else `0`, `1`, ... (a tuple
/// or list), else `value` (one leaf).
fn names(spec: Option<&str>, fields: usize) -> std::result::Result<Vec<String>, Invalid> {
    let positional = || (0..fields).map(|i| i.to_string()).collect();
    let Some(text) = spec else {
        return Ok(if fields == 1 {
            vec!["value".into()]
        } else {
            positional()
        });
    };
    let v: Json = serde_json::from_str(text).map_err(|e| format!("data_spec: {e}"))?;
    let root = v.get(1).ok_or("data_spec: not [version, spec]")?;
    let children = root.get("children_spec").and_then(Json::as_array).map_or(0, Vec::len);
    if children > 0
        && root["children_spec"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|c| !c["type"].is_null())
    {
        return Err("nested fields (a dict or list inside a sample) are not read: flatten the sample".into());
    }
    match root.get("type").and_then(Json::as_str) {
        None => Ok(vec!["value".into()]),
        Some("builtins.dict") => {
            let ctx = root
                .get("context")
                .and_then(Json::as_str)
                .ok_or("data_spec: a dict with no keys")?;
            let keys: Vec<String> = serde_json::from_str(ctx).map_err(|e| format!("data_spec keys: {e}"))?;
            if keys.len() != fields {
                return Err(format!("data_spec names {} keys for {fields} fields", keys.len()).into());
            }
            Ok(keys)
        }
        Some(_) => Ok(positional()),
    }
}

/// `bytes` (the dataset's `index.json`, read from `object`) as the MDS index it is laid out
/// like, when it is LitData's (`chunks` and `config`); `None` when it is not.
pub fn as_mds_index(bytes: &[u8], object: &str) -> Result<Option<Index>> {
    let probe: Json = match serde_json::from_slice(bytes) {
        Ok(v) => v,
        Err(_) => return Ok(None), // the MDS parser names what is wrong
    };
    if probe.get("chunks").is_none() || probe.get("config").is_none() {
        return Ok(None);
    }
    let bad = |r: String| Error::Manifest {
        object: object.to_owned(),
        reason: r,
    };
    let ix: LitIndex = serde_json::from_value(probe).map_err(|e| bad(format!("not a LitData index: {e}")))?;
    let c = &ix.config;
    if let Some(l) = c.item_loader.as_deref().filter(|l| *l != "PyTreeLoader") {
        return Err(bad(format!(
            "LitData's {l} chunks are not read (ramjet reads PyTreeLoader's)"
        )));
    }
    if c.encryption.as_ref().is_some_and(|e| !e.is_null()) {
        return Err(bad("encrypted LitData chunks are not read".into()));
    }
    if c.compression.is_some() || c.compression_level.is_some() {
        return Err(bad(format!(
            "compressed LitData chunks ({}) are not read yet (neither in place nor by `ramjet pack`): optimize without compression",
            c.compression.as_deref().unwrap_or("compressed")
        )));
    }
    let encodings: Vec<String> = c
        .data_format
        .iter()
        .map(|f| encoding(f))
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| bad(e.to_string()))?;
    let names = names(c.data_spec.as_deref(), encodings.len()).map_err(|e| bad(e.to_string()))?;
    if ix.chunks.is_empty() {
        return Err(bad("it lists no chunks".into()));
    }
    let shards = ix
        .chunks
        .into_iter()
        .map(|ch| IndexShard {
            format: "mds".into(),
            version: 2,
            column_names: names.clone(),
            column_encodings: encodings.clone(),
            column_sizes: vec![None; encodings.len()],
            compression: None,
            raw_data: IndexFile {
                basename: ch.filename,
                bytes: ch.chunk_bytes,
                hashes: Default::default(),
            },
            zip_data: None,
            samples: ch.chunk_size,
        })
        .collect();
    Ok(Some(Index { version: 2, shards }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_read_as_the_mds_encodings_of_the_same_bytes_and_the_rest_are_refused() {
        assert_eq!(encoding("int").unwrap(), "int64");
        assert_eq!(encoding("no_header_numpy:9").unwrap(), "litdata-numpy:float32");
        assert_eq!(encoding("numpy").unwrap(), "litdata-numpy");
        assert!(encoding("pickle").unwrap_err().contains("refused"));
        assert!(encoding("no_header_numpy:12").unwrap_err().contains("dtype"));
        assert!(encoding("video").unwrap_err().contains("video"));
    }

    #[test]
    fn names_come_from_a_dicts_keys_else_positions() {
        let dict = r#"[1, {"type": "builtins.dict", "context": "[\"a\", \"b\"]", "children_spec": [{"type": null, "context": null, "children_spec": []}, {"type": null, "context": null, "children_spec": []}]}]"#;
        assert_eq!(names(Some(dict), 2).unwrap(), ["a", "b"]);
        assert!(names(Some(dict), 3).unwrap_err().contains("2 keys for 3 fields"));
        let tuple = r#"[1, {"type": "builtins.tuple", "context": "null", "children_spec": [{"type": null, "context": null, "children_spec": []}, {"type": null, "context": null, "children_spec": []}]}]"#;
        assert_eq!(names(Some(tuple), 2).unwrap(), ["0", "1"]);
        let nested = r#"[1, {"type": "builtins.dict", "context": "[\"a\"]", "children_spec": [{"type": "builtins.list", "context": "null", "children_spec": []}]}]"#;
        assert!(names(Some(nested), 1).unwrap_err().contains("nested"));
        assert_eq!(names(None, 1).unwrap(), ["value"]);
    }

    #[test]
    fn an_mds_index_is_not_taken_for_litdata() {
        assert!(as_mds_index(br#"{"version": 2, "shards": []}"#, "index.json")
            .unwrap()
            .is_none());
        let enc = br#"{"chunks": [{"chunk_bytes": 9, "chunk_size": 1, "filename": "c.bin"}], "config": {"data_format": ["int"], "encryption": {"algorithm": "fernet"}}}"#;
        assert!(as_mds_index(enc, "index.json")
            .unwrap_err()
            .to_string()
            .contains("encrypted"));
    }
}
