//! Shard layout, manifest and checksums: writers and readers. `docs/format.md` describes
//! every byte.

pub mod array;
mod checksum;
mod manifest;
pub mod npy;
mod schema;
mod shard;
mod table;
mod table_counts;

pub use checksum::Checksum;
pub use manifest::{
    validate_key, ColumnsInfo, Manifest, ShardInfo, ShardList, MANIFEST_BYTES_MAX, MANIFEST_FORMAT, MANIFEST_NAME,
    MANIFEST_VERSION, MANIFEST_VERSION_FOREIGN, MANIFEST_VERSION_TABLE,
};
pub use schema::{
    decode_record, decode_record_at, encode_record, encoded_len, Column, ColumnType, Schema, Value, ValueRef,
    COLUMNS_MAX, NULL_INT64,
};
pub use shard::{
    check_footer, sample_checksum, shard_checksum, verify_shard_bytes, BuiltShard, Header, IndexEntry, Problem, ReadAt,
    ShardBuilder, ShardExpect, ShardHasher, ShardReader, ShardView, FOOTER_LEN, FOOTER_MAGIC, FORMAT_VERSION,
    HEADER_LEN, INDEX_ENTRY_LEN, SHARD_MAGIC, SHARD_SAMPLES_MAX,
};
pub use table::{
    shard_table_head_len, shard_table_len, ShardTable, ShardTableBuilder, ShardTableRef, TableReader,
    SHARD_TABLE_AUTO_MIN, SHARD_TABLE_BLOCK_RECORDS, SHARD_TABLE_DIR_ENTRY_LEN, SHARD_TABLE_HEADER_LEN,
    SHARD_TABLE_MAGIC, SHARD_TABLE_RECORD_LEN,
};

/// Key under which shard number `index` with checksum `checksum` is stored. The checksum in
/// the name makes shard objects immutable: a re-pack never overwrites a shard that an older
/// manifest version still lists.
pub fn shard_key(index: usize, checksum: u64) -> String {
    format!("shards/{index:06}-{checksum:016x}.rjs")
}

/// Key of shard number `index`'s columns sidecar, whose own checksum is `checksum`.
pub fn columns_key(index: usize, checksum: u64) -> String {
    format!("columns/{index:06}-{checksum:016x}.rjs")
}
