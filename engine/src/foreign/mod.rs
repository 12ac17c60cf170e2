//! Foreign shards read in place: MosaicML Streaming (MDS), LitData, WebDataset (tar) and Parquet.
//!
//! `ramjet index` writes a ramjet manifest over a foreign dataset's shards without copying
//! them. Each shard entry keeps the foreign object's key, size and xxh3-64 ([`ForeignObject`]),
//! and, as its ramjet size and checksum, those of the ramjet shard that the foreign one
//! *transcodes* to ([`transcode`]): the same samples, as ramjet records with their per-sample
//! checksums. A reader fetches the foreign object, checks its size and xxh3, decompresses it,
//! transcodes it and checks the result against the manifest, so from there on (the disk cache,
//! the host daemon and its peers, the order, resume, decode) a foreign shard is an ordinary
//! verified ramjet shard. `docs/format.md` ("Foreign shards") describes the layouts read here.
//!
//! One concept per file: [`spec`] (what a foreign dataset and its objects are), [`mds`] and
//! [`wds`] (the two layouts), [`compress`] (bounded decompression), [`transcode`] (the one
//! entry point from a foreign object's bytes to ramjet records), [`scan`] (`ramjet index`:
//! a manifest over the shards), [`learned`] (the same, learned on first read and kept on
//! the host) and [`ranged`] (a plain shard's samples read one at a time through its sample
//! index, for the stream's ranged reads). Parquet's row groups: [`parquet_schema`] (its fields
//! as columns), [`parquet_footer`] (a file's footer, found and checked) and [`parquet_rows`]
//! (a row group's rows as ramjet records).

pub mod compress;
pub mod learned;
pub mod lit;
pub mod mds;
pub mod parquet_footer;
pub mod parquet_rows;
pub mod parquet_schema;
pub mod ranged;
pub mod scan;
pub mod spec;
pub mod transcode;
pub mod wds;

pub use compress::{compression_name, decompress, COMPRESSIONS};
pub use learned::{learned_dir, names_foreign_source, open_learned, Learned};
pub use scan::{expand_braces, index_into, ForeignSource, Indexed};
pub use spec::{
    sample_index_key, ForeignColumn, ForeignFormat, ForeignObject, ForeignSpec, ParquetPart, SampleIndexRef,
    SAMPLE_INDEX_ENTRY_LEN,
};
pub use transcode::{check_object, transcode, transcode_sample, transcode_with_spans};

/// Largest decompressed foreign shard (a bound on what a lying header can make us allocate).
pub const FOREIGN_SHARD_BYTES_MAX: u64 = 4 << 30;

#[cfg(test)]
mod tests;
