//! The shard file: an immutable, checksummed pack of N samples of one schema.
//!
//! Layout (all integers little-endian; `docs/format.md` is the normative description):
//!
//! ```text
//! [0, 64)                 header
//! [64, 64 + 24 N)         index: one entry per sample (offset u64, length u64, xxh3 u64)
//! [.., + schema_len)      schema, canonical JSON
//! [data_offset, end - 16) records, back to back, in sample order
//! [end - 16, end)         footer: xxh3-64 of bytes [0, end - 16), then b"RJSHEND\0"
//! ```
//!
//! The index sits at a fixed place right after the header, so with the header in hand
//! sample `i` costs one read of its 24-byte index entry and one read of its record. The same
//! two ranged GETs fetch one sample from object storage.

use std::io;

use xxhash_rust::xxh3::xxh3_64;

use super::schema::{decode_record, encode_record, Schema, Value, ValueRef};
use crate::error::{Error, Location, Result};

/// First 8 bytes of every shard.
pub const SHARD_MAGIC: [u8; 8] = *b"RJSHARD\0";
/// Last 8 bytes of every shard.
pub const FOOTER_MAGIC: [u8; 8] = *b"RJSHEND\0";
/// Shard format version this code writes and reads.
pub const FORMAT_VERSION: u16 = 1;
/// Header length in bytes.
pub const HEADER_LEN: u64 = 64;
/// One index entry in bytes.
pub const INDEX_ENTRY_LEN: u64 = 24;
/// Footer length in bytes.
pub const FOOTER_LEN: u64 = 16;
/// Most samples one shard may hold (bounds the index a reader will trust).
pub const SHARD_SAMPLES_MAX: u64 = 1 << 32;
/// Largest schema JSON a reader accepts.
pub const SCHEMA_BYTES_MAX: u32 = 1 << 20;
/// Sample problems listed per shard by [`verify_shard_bytes`] before it only counts them.
pub const PROBLEMS_LISTED_MAX: usize = 20;

/// Checksum of one sample's record. Seeded with the sample's index inside the shard, so a
/// record copied into the wrong slot fails its check too.
pub fn sample_checksum(index_in_shard: u64, record: &[u8]) -> u64 {
    twox_hash::XxHash3_64::oneshot_with_seed(index_in_shard, record)
}

/// Checksum of a whole shard: xxh3-64 of every byte before the footer.
///
/// Bulk data (records and whole shards) is hashed with `twox-hash`, which picks AVX2 at run
/// time (xxhash-rust picks its SIMD width at compile time, so a portable build gets SSE2: a
/// third of the speed here). Both compute the same XXH3; a test holds them to it.
pub fn shard_checksum(bytes_before_footer: &[u8]) -> u64 {
    twox_hash::XxHash3_64::oneshot(bytes_before_footer)
}

/// [`shard_checksum`], fed in pieces.
#[derive(Default)]
pub struct ShardHasher(twox_hash::XxHash3_64);

impl ShardHasher {
    /// Hashes the next bytes.
    pub fn update(&mut self, b: &[u8]) {
        std::hash::Hasher::write(&mut self.0, b);
    }

    /// The checksum of everything fed.
    pub fn digest(&self) -> u64 {
        std::hash::Hasher::finish(&self.0)
    }
}

/// Decoded shard header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// Number of samples, N.
    pub samples: u64,
    /// Number of columns in the schema.
    pub columns: u32,
    /// Byte offset of the schema JSON (always `64 + 24 N`).
    pub schema_offset: u64,
    /// Length of the schema JSON.
    pub schema_len: u32,
    /// Byte offset of the first record (always `schema_offset + schema_len`).
    pub data_offset: u64,
    /// xxh3-64 of the schema JSON.
    pub schema_hash: u64,
}

impl Header {
    /// Byte offset of sample `i`'s index entry.
    pub fn entry_offset(i: u64) -> u64 {
        HEADER_LEN + INDEX_ENTRY_LEN * i
    }

    /// The 64 header bytes, checksum included.
    pub fn encode(&self) -> [u8; 64] {
        let mut b = [0u8; 64];
        b[0..8].copy_from_slice(&SHARD_MAGIC);
        b[8..10].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        // 10..12 flags, 0 in version 1.
        b[12..16].copy_from_slice(&self.columns.to_le_bytes());
        b[16..24].copy_from_slice(&self.samples.to_le_bytes());
        b[24..32].copy_from_slice(&self.schema_offset.to_le_bytes());
        b[32..36].copy_from_slice(&self.schema_len.to_le_bytes());
        // 36..40 reserved, 0.
        b[40..48].copy_from_slice(&self.data_offset.to_le_bytes());
        b[48..56].copy_from_slice(&self.schema_hash.to_le_bytes());
        let sum = xxh3_64(&b[0..56]);
        b[56..64].copy_from_slice(&sum.to_le_bytes());
        b
    }

    /// Parses and checks the 64 header bytes of `object`.
    pub fn parse(b: &[u8], object: &str) -> Result<Header> {
        let at = || Location::object(object).at(0);
        if b.len() < HEADER_LEN as usize {
            return Err(Error::corrupt(at(), format!("header needs 64 bytes, got {}", b.len())));
        }
        if b[0..8] != SHARD_MAGIC {
            return Err(Error::corrupt(
                at(),
                format!("not a ramjet shard: magic is {:02x?}", &b[0..8]),
            ));
        }
        let u16_at = |o: usize| u16::from_le_bytes(b[o..o + 2].try_into().expect("2"));
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().expect("4"));
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().expect("8"));
        let stored = u64_at(56);
        let computed = xxh3_64(&b[0..56]);
        if stored != computed {
            return Err(Error::corrupt(
                at(),
                format!("header checksum mismatch: stored {stored:016x}, computed {computed:016x}"),
            ));
        }
        let version = u16_at(8);
        if version != FORMAT_VERSION {
            return Err(Error::corrupt(
                at(),
                format!("unsupported shard format version {version} (this build reads {FORMAT_VERSION})"),
            ));
        }
        let h = Header {
            columns: u32_at(12),
            samples: u64_at(16),
            schema_offset: u64_at(24),
            schema_len: u32_at(32),
            data_offset: u64_at(40),
            schema_hash: u64_at(48),
        };
        let flags = u16_at(10);
        if flags != 0 || u32_at(36) != 0 {
            return Err(Error::corrupt(at(), "reserved header fields are not zero"));
        }
        if h.samples > SHARD_SAMPLES_MAX {
            return Err(Error::corrupt(
                at(),
                format!("{} samples exceeds the limit {SHARD_SAMPLES_MAX}", h.samples),
            ));
        }
        if h.schema_offset != Header::entry_offset(h.samples) {
            return Err(Error::corrupt(
                at(),
                format!(
                    "schema offset {} does not follow an index of {} samples",
                    h.schema_offset, h.samples
                ),
            ));
        }
        if h.schema_len == 0 || h.schema_len > SCHEMA_BYTES_MAX {
            return Err(Error::corrupt(
                at(),
                format!("schema length {} out of range", h.schema_len),
            ));
        }
        if h.data_offset != h.schema_offset + h.schema_len as u64 {
            return Err(Error::corrupt(
                at(),
                format!("data offset {} does not follow the schema", h.data_offset),
            ));
        }
        Ok(h)
    }

    /// Smallest valid file size for this header (no records, just the footer).
    pub fn min_file_len(&self) -> u64 {
        self.data_offset + FOOTER_LEN
    }
}

/// One index entry: where sample `i`'s record is and its checksum.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IndexEntry {
    /// Absolute byte offset of the record in the shard.
    pub offset: u64,
    /// Record length in bytes.
    pub len: u64,
    /// [`sample_checksum`] of the record.
    pub checksum: u64,
}

impl IndexEntry {
    /// Parses 24 bytes.
    pub fn parse(b: &[u8]) -> IndexEntry {
        let u = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().expect("8"));
        IndexEntry {
            offset: u(0),
            len: u(8),
            checksum: u(16),
        }
    }

    /// Checks the entry lies inside the record area of a shard of `file_len` bytes.
    pub fn check_bounds(&self, h: &Header, file_len: u64, at: &Location) -> Result<()> {
        let data_end = file_len.saturating_sub(FOOTER_LEN);
        let end = self.offset.checked_add(self.len);
        match end {
            Some(end) if self.offset >= h.data_offset && end <= data_end => Ok(()),
            _ => Err(Error::corrupt(
                at.clone(),
                format!(
                    "index entry points at bytes [{}, +{}) outside the record area [{}, {})",
                    self.offset, self.len, h.data_offset, data_end
                ),
            )),
        }
    }

    /// Checks `record` against this entry's checksum.
    pub fn check_record(&self, index_in_shard: u64, record: &[u8], at: &Location) -> Result<()> {
        let got = sample_checksum(index_in_shard, record);
        if got != self.checksum {
            return Err(Error::corrupt(
                at.clone().at(self.offset),
                format!(
                    "sample checksum mismatch: index says {:016x}, record hashes to {got:016x}",
                    self.checksum
                ),
            ));
        }
        Ok(())
    }
}

/// Builds one shard in memory. Records accumulate in one buffer; [`ShardBuilder::finish`]
/// lays out header, index, schema, records and footer in a single allocation.
pub struct ShardBuilder {
    schema: Schema,
    schema_json: Vec<u8>,
    records: Vec<u8>,
    entries: Vec<IndexEntry>,
}

/// A finished shard.
pub struct BuiltShard {
    /// The whole file.
    pub bytes: Vec<u8>,
    /// Number of samples.
    pub samples: u64,
    /// [`shard_checksum`] of the file.
    pub checksum: u64,
}

impl ShardBuilder {
    /// An empty shard of `schema`.
    pub fn new(schema: Schema) -> Self {
        let schema_json = schema.to_canonical_json();
        Self {
            schema,
            schema_json,
            records: Vec::new(),
            entries: Vec::new(),
        }
    }

    /// Reserves room for `bytes` of records.
    pub fn reserve(&mut self, bytes: usize) {
        self.records.reserve(bytes);
    }

    /// Appends one sample. `what` names it in errors (source path, `file:line`).
    pub fn push(&mut self, values: &[Value], what: &str) -> Result<()> {
        let start = self.records.len();
        encode_record(&self.schema, values, what, &mut self.records)?;
        let rec = &self.records[start..];
        let i = self.entries.len() as u64;
        self.entries.push(IndexEntry {
            offset: start as u64, // relative until finish()
            len: rec.len() as u64,
            checksum: sample_checksum(i, rec),
        });
        Ok(())
    }

    /// Samples so far.
    pub fn samples(&self) -> u64 {
        self.entries.len() as u64
    }

    /// File size if finished now.
    pub fn file_len(&self) -> u64 {
        Header::entry_offset(self.samples()) + self.schema_json.len() as u64 + self.records.len() as u64 + FOOTER_LEN
    }

    /// Lays out the file and computes its checksum.
    pub fn finish(self) -> BuiltShard {
        let n = self.samples();
        let schema_offset = Header::entry_offset(n);
        let data_offset = schema_offset + self.schema_json.len() as u64;
        let header = Header {
            samples: n,
            columns: self.schema.columns.len() as u32,
            schema_offset,
            schema_len: self.schema_json.len() as u32,
            data_offset,
            schema_hash: xxh3_64(&self.schema_json),
        };
        let total = self.file_len() as usize;
        let mut out = Vec::with_capacity(total);
        out.extend_from_slice(&header.encode());
        for e in &self.entries {
            out.extend_from_slice(&(e.offset + data_offset).to_le_bytes());
            out.extend_from_slice(&e.len.to_le_bytes());
            out.extend_from_slice(&e.checksum.to_le_bytes());
        }
        out.extend_from_slice(&self.schema_json);
        out.extend_from_slice(&self.records);
        let checksum = shard_checksum(&out);
        out.extend_from_slice(&checksum.to_le_bytes());
        out.extend_from_slice(&FOOTER_MAGIC);
        debug_assert_eq!(out.len(), total);
        BuiltShard {
            bytes: out,
            samples: n,
            checksum,
        }
    }
}

/// Positioned reads: a local file, a byte buffer, or a counting wrapper in benchmarks.
pub trait ReadAt {
    /// Fills `buf` from `offset`, or fails (short reads are errors).
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
    /// Total size in bytes.
    fn size(&self) -> io::Result<u64>;
}

impl ReadAt for std::fs::File {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        std::os::unix::fs::FileExt::read_exact_at(self, buf, offset)
    }
    fn size(&self) -> io::Result<u64> {
        Ok(self.metadata()?.len())
    }
}

impl ReadAt for [u8] {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let start = usize::try_from(offset).map_err(|_| io::ErrorKind::UnexpectedEof)?;
        let src = start
            .checked_add(buf.len())
            .and_then(|end| self.get(start..end))
            .ok_or(io::ErrorKind::UnexpectedEof)?;
        buf.copy_from_slice(src);
        Ok(())
    }
    fn size(&self) -> io::Result<u64> {
        Ok(self.len() as u64)
    }
}

impl<T: ReadAt + ?Sized> ReadAt for &T {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        (**self).read_exact_at(buf, offset)
    }
    fn size(&self) -> io::Result<u64> {
        (**self).size()
    }
}

/// Checks a shard's footer (its last [`FOOTER_LEN`] bytes) against the checksum its manifest
/// lists: the magic, then the whole-shard checksum. The footer's checksum covers every byte
/// before it, so a reader that reads only parts of a shard (its index entries and some
/// records) knows with it that those parts belong to the shard the manifest lists, not to
/// another valid shard put in its place. The error names `name`.
pub fn check_footer(footer: &[u8], want: u64, name: &str) -> Result<()> {
    let at = || Location::object(name);
    if footer.len() != FOOTER_LEN as usize || footer[8..16] != FOOTER_MAGIC {
        return Err(Error::corrupt(
            at(),
            "footer magic missing: the shard is truncated or was overwritten",
        ));
    }
    let got = u64::from_le_bytes(footer[..8].try_into().expect("8 bytes"));
    if got != want {
        return Err(Error::corrupt(
            at(),
            format!(
                "its footer's checksum {got:016x} is not the manifest's {want:016x}: the object holds another \
                 shard, or was rewritten since the manifest was made"
            ),
        ));
    }
    Ok(())
}

/// Random access to the samples of one shard through [`ReadAt`].
///
/// Opening reads the header, the schema and the footer (three reads). After that,
/// [`ShardReader::read_record`] costs exactly two reads: the index entry and the record.
pub struct ShardReader<R> {
    src: R,
    name: String,
    header: Header,
    schema: Schema,
    size: u64,
    /// The whole-shard checksum its footer holds.
    footer_checksum: u64,
}

impl<R: ReadAt> ShardReader<R> {
    /// [`ShardReader::open`] of a shard expected to be `bytes` long with whole-shard checksum
    /// `checksum` (its manifest's, or its cache name's): a file of another size, or whose footer
    /// holds another checksum (another valid shard in its place), is refused, naming `name`.
    pub fn open_expecting(src: R, name: &str, bytes: u64, checksum: u64) -> Result<Self> {
        let size = src.size().map_err(|e| Error::io(name, e))?;
        if size != bytes {
            return Err(Error::Truncated {
                object: name.to_owned(),
                expected: bytes,
                actual: size,
            });
        }
        let r = Self::open(src, name)?;
        let mut fb = [0u8; FOOTER_LEN as usize];
        fb[..8].copy_from_slice(&r.footer_checksum.to_le_bytes());
        fb[8..].copy_from_slice(&FOOTER_MAGIC);
        check_footer(&fb, checksum, name)?;
        Ok(r)
    }

    /// The whole-shard checksum its footer holds (not verified against the bytes: see
    /// [`ShardReader::open_expecting`]).
    pub fn footer_checksum(&self) -> u64 {
        self.footer_checksum
    }

    /// Opens `src`, named `name` in errors, and checks header, schema and footer.
    pub fn open(src: R, name: &str) -> Result<Self> {
        let io_err = |e: io::Error| Error::io(name, e);
        let size = src.size().map_err(io_err)?;
        if size < HEADER_LEN + FOOTER_LEN {
            return Err(Error::Truncated {
                object: name.to_owned(),
                expected: HEADER_LEN + FOOTER_LEN,
                actual: size,
            });
        }
        let mut hb = [0u8; 64];
        src.read_exact_at(&mut hb, 0).map_err(io_err)?;
        let header = Header::parse(&hb, name)?;
        if size < header.min_file_len() {
            return Err(Error::Truncated {
                object: name.to_owned(),
                expected: header.min_file_len(),
                actual: size,
            });
        }
        let mut sb = vec![0u8; header.schema_len as usize];
        src.read_exact_at(&mut sb, header.schema_offset).map_err(io_err)?;
        let schema = parse_schema(&sb, &header, name)?;
        let mut fb = [0u8; 16];
        src.read_exact_at(&mut fb, size - FOOTER_LEN).map_err(io_err)?;
        if fb[8..16] != FOOTER_MAGIC {
            return Err(Error::corrupt(
                Location::object(name).at(size - FOOTER_LEN),
                "footer magic missing: the shard is truncated or was overwritten",
            ));
        }
        Ok(Self {
            src,
            name: name.to_owned(),
            header,
            schema,
            size,
            footer_checksum: u64::from_le_bytes(fb[..8].try_into().expect("8 bytes")),
        })
    }

    /// The shard's schema.
    pub fn schema(&self) -> &Schema {
        &self.schema
    }

    /// The shard's header.
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// Number of samples.
    pub fn samples(&self) -> u64 {
        self.header.samples
    }

    /// Reads and bounds-checks index entry `i` (one read).
    pub fn entry(&self, i: u64) -> Result<IndexEntry> {
        self.check_index(i)?;
        let mut eb = [0u8; 24];
        self.src
            .read_exact_at(&mut eb, Header::entry_offset(i))
            .map_err(|e| Error::io(Location::sample(&self.name, i), e))?;
        let e = IndexEntry::parse(&eb);
        self.check_entry(i, &e)?;
        Ok(e)
    }

    fn check_index(&self, i: u64) -> Result<()> {
        if i >= self.header.samples {
            return Err(Error::invalid(
                format!("{} sample {i}", self.name),
                format!("shard has {} samples", self.header.samples),
            ));
        }
        Ok(())
    }

    /// Bounds check of sample `i`'s entry; the error's location is built only on failure.
    fn check_entry(&self, i: u64, e: &IndexEntry) -> Result<()> {
        let data_end = self.size.saturating_sub(FOOTER_LEN);
        match e.offset.checked_add(e.len) {
            Some(end) if e.offset >= self.header.data_offset && end <= data_end => Ok(()),
            _ => e.check_bounds(&self.header, self.size, &Location::sample(&self.name, i)),
        }
    }

    /// Reads sample `i`'s record and checks its checksum (two reads).
    pub fn read_record(&self, i: u64) -> Result<Vec<u8>> {
        let e = self.entry(i)?;
        self.read_checked(i, &e)
    }

    /// The shard's whole index, 24 bytes a sample, in one read: for a reader that reads many of
    /// the shard's samples in an order of its own ([`ShardReader::read_record_indexed`]).
    pub fn read_index(&self) -> Result<Vec<u8>> {
        let mut b = vec![0u8; (self.header.samples * INDEX_ENTRY_LEN) as usize];
        self.src
            .read_exact_at(&mut b, Header::entry_offset(0))
            .map_err(|e| Error::io(Location::object(&self.name).at(Header::entry_offset(0)), e))?;
        Ok(b)
    }

    /// Sample `i`'s record with its entry taken from `index` (what [`ShardReader::read_index`]
    /// returned): one read, the entry bounds-checked and the record checked as
    /// [`ShardReader::read_record`] does.
    pub fn read_record_indexed(&self, index: &[u8], i: u64) -> Result<Vec<u8>> {
        self.check_index(i)?;
        let o = (i * INDEX_ENTRY_LEN) as usize;
        let eb = index
            .get(o..o + INDEX_ENTRY_LEN as usize)
            .ok_or_else(|| Error::invalid(format!("{} sample {i}", self.name), "the index given is short"))?;
        let e = IndexEntry::parse(eb);
        self.check_entry(i, &e)?;
        self.read_checked(i, &e)
    }

    /// Reads the record `e` points at and checks it against `e`.
    fn read_checked(&self, i: u64, e: &IndexEntry) -> Result<Vec<u8>> {
        let mut rec = vec![0u8; e.len as usize];
        self.src
            .read_exact_at(&mut rec, e.offset)
            .map_err(|err| Error::io(Location::sample(&self.name, i), err))?;
        if sample_checksum(i, &rec) != e.checksum {
            e.check_record(i, &rec, &Location::sample(&self.name, i))?;
        }
        Ok(rec)
    }

    /// Reads sample `i` into owned values.
    pub fn read_sample(&self, i: u64) -> Result<Vec<Value>> {
        let rec = self.read_record(i)?;
        let vals = decode_record(&self.schema, &rec, &Location::sample(&self.name, i))?;
        Ok(vals.iter().map(ValueRef::to_owned_value).collect())
    }
}

fn parse_schema(sb: &[u8], header: &Header, name: &str) -> Result<Schema> {
    let at = || Location::object(name).at(header.schema_offset);
    let got = xxh3_64(sb);
    if got != header.schema_hash {
        return Err(Error::corrupt(
            at(),
            format!(
                "schema hash mismatch: header says {:016x}, schema hashes to {got:016x}",
                header.schema_hash
            ),
        ));
    }
    let schema = Schema::from_json(sb).map_err(|r| Error::corrupt(at(), r))?;
    if schema.columns.len() != header.columns as usize {
        return Err(Error::corrupt(
            at(),
            format!(
                "header says {} columns, schema has {}",
                header.columns,
                schema.columns.len()
            ),
        ));
    }
    Ok(schema)
}

/// A whole shard held in memory, read without copying.
pub struct ShardView<'a> {
    bytes: &'a [u8],
    name: &'a str,
    header: Header,
    schema: Schema,
}

impl<'a> ShardView<'a> {
    /// Checks header, schema and footer magic (not the whole-shard checksum: see
    /// [`ShardView::check_checksum`], which costs a pass over every byte).
    pub fn parse(bytes: &'a [u8], name: &'a str) -> Result<Self> {
        let len = bytes.len() as u64;
        if len < HEADER_LEN + FOOTER_LEN {
            return Err(Error::Truncated {
                object: name.to_owned(),
                expected: HEADER_LEN + FOOTER_LEN,
                actual: len,
            });
        }
        let header = Header::parse(&bytes[..64], name)?;
        if len < header.min_file_len() {
            return Err(Error::Truncated {
                object: name.to_owned(),
                expected: header.min_file_len(),
                actual: len,
            });
        }
        let s0 = header.schema_offset as usize;
        let schema = parse_schema(&bytes[s0..s0 + header.schema_len as usize], &header, name)?;
        if bytes[bytes.len() - 8..] != FOOTER_MAGIC {
            return Err(Error::corrupt(
                Location::object(name).at(len - FOOTER_LEN),
                "footer magic missing: the shard is truncated or was overwritten",
            ));
        }
        Ok(Self {
            bytes,
            name,
            header,
            schema,
        })
    }

    /// Header.
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// Schema.
    pub fn schema(&self) -> &Schema {
        &self.schema
    }

    /// Number of samples.
    pub fn samples(&self) -> u64 {
        self.header.samples
    }

    /// The checksum stored in the footer.
    pub fn footer_checksum(&self) -> u64 {
        let n = self.bytes.len();
        u64::from_le_bytes(self.bytes[n - 16..n - 8].try_into().expect("8"))
    }

    /// Hashes every byte before the footer and compares with the footer. Returns the hash.
    pub fn check_checksum(&self) -> Result<u64> {
        self.check_checksum_hashed(None)
    }

    /// [`ShardView::check_checksum`] with the hash of the bytes before the footer already
    /// computed (as they arrived), when `hashed` is given.
    pub fn check_checksum_hashed(&self, hashed: Option<u64>) -> Result<u64> {
        let n = self.bytes.len();
        let got = hashed.unwrap_or_else(|| shard_checksum(&self.bytes[..n - 16]));
        if got != self.footer_checksum() {
            return Err(Error::corrupt(
                Location::object(self.name),
                format!(
                    "shard checksum mismatch: footer says {:016x}, content hashes to {got:016x}",
                    self.footer_checksum()
                ),
            ));
        }
        Ok(got)
    }

    /// Sample `i`'s record, bounds- and checksum-checked.
    pub fn record(&self, i: u64) -> Result<&'a [u8]> {
        let at = Location::sample(self.name, i);
        if i >= self.header.samples {
            return Err(Error::invalid(
                format!("{} sample {i}", self.name),
                format!("shard has {} samples", self.header.samples),
            ));
        }
        let o = Header::entry_offset(i) as usize;
        let e = IndexEntry::parse(&self.bytes[o..o + 24]);
        e.check_bounds(&self.header, self.bytes.len() as u64, &at)?;
        let rec = &self.bytes[e.offset as usize..(e.offset + e.len) as usize];
        e.check_record(i, rec, &at)?;
        Ok(rec)
    }

    /// Sample `i` decoded, borrowing from the shard bytes.
    pub fn sample(&self, i: u64) -> Result<Vec<ValueRef<'a>>> {
        let rec = self.record(i)?;
        decode_record(&self.schema, rec, &Location::sample(self.name, i))
    }
}

/// What the manifest says a shard should be.
#[derive(Debug, Clone, Copy)]
pub struct ShardExpect<'a> {
    /// Size in bytes.
    pub bytes: u64,
    /// Sample count.
    pub samples: u64,
    /// Whole-shard checksum.
    pub checksum: u64,
    /// Schema.
    pub schema: &'a Schema,
}

/// One problem found by verification.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// Sample index in the shard, when the problem is in one sample.
    pub sample: Option<u64>,
    /// What is wrong.
    pub message: String,
}

/// Checks every byte of a shard against itself and against the manifest's expectations.
/// Returns all problems found (sample problems beyond [`PROBLEMS_LISTED_MAX`] are summarised
/// in one line), or nothing if the shard is sound.
pub fn verify_shard_bytes(bytes: &[u8], name: &str, expect: &ShardExpect<'_>) -> Vec<Problem> {
    let mut problems = Vec::new();
    let whole = |m: String| Problem {
        sample: None,
        message: m,
    };
    let len = bytes.len() as u64;
    if len != expect.bytes {
        problems.push(whole(if len < expect.bytes {
            format!("truncated: manifest says {} bytes, object has {len}", expect.bytes)
        } else {
            format!("size mismatch: manifest says {} bytes, object has {len}", expect.bytes)
        }));
    }
    let view = match ShardView::parse(bytes, name) {
        Ok(v) => Some(v),
        Err(e) => {
            problems.push(whole(detail_of(&e)));
            None
        }
    };
    // The content hash is meaningful even when the structure is damaged.
    if len >= FOOTER_LEN {
        let got = shard_checksum(&bytes[..(len - FOOTER_LEN) as usize]);
        if got != expect.checksum {
            problems.push(whole(format!(
                "checksum mismatch: manifest says {:016x}, content hashes to {got:016x}",
                expect.checksum
            )));
        }
        if let Some(v) = &view {
            if v.footer_checksum() != got {
                problems.push(whole(format!(
                    "footer checksum {:016x} does not match content {got:016x}",
                    v.footer_checksum()
                )));
            }
        }
    }
    let Some(view) = view else { return problems };
    if view.schema() != expect.schema {
        problems.push(whole(format!(
            "schema mismatch: manifest has [{}], shard has [{}]",
            expect.schema.describe(),
            view.schema().describe()
        )));
    }
    if view.samples() != expect.samples {
        problems.push(whole(format!(
            "sample count mismatch: manifest says {}, shard has {}",
            expect.samples,
            view.samples()
        )));
    }
    let mut bad = 0usize;
    for i in 0..view.samples() {
        if let Err(e) = view.sample(i) {
            bad += 1;
            if bad <= PROBLEMS_LISTED_MAX {
                problems.push(Problem {
                    sample: Some(i),
                    message: detail_of(&e),
                });
            }
        }
    }
    if bad > PROBLEMS_LISTED_MAX {
        problems.push(whole(format!(
            "{} more bad samples not listed",
            bad - PROBLEMS_LISTED_MAX
        )));
    }
    problems
}

/// The part of an error that a per-shard report needs: the report already names the object
/// and the sample, so only the offset and the reason remain.
fn detail_of(e: &Error) -> String {
    match e {
        Error::Corrupt { at, reason } => match at.offset {
            Some(o) => format!("at byte {o}: {reason}"),
            None => reason.clone(),
        },
        Error::Truncated { expected, actual, .. } => format!("truncated: expected {expected} bytes, found {actual}"),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod checksum_tests {
    use super::*;

    /// The bulk checksums (twox-hash, SIMD chosen at run time) are the XXH3 of the reference
    /// implementation (xxhash-rust), at every length class XXH3 treats differently, seeded or
    /// not, whole or fed in pieces.
    #[test]
    fn bulk_checksums_are_reference_xxh3() {
        let data: Vec<u8> = (0..300_000u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        let mut lens: Vec<usize> = (0..=260).collect();
        lens.extend([1023, 1024, 1025, 4095, 4096, 65_537, 299_999, 300_000]);
        for &n in &lens {
            let b = &data[..n];
            assert_eq!(shard_checksum(b), xxh3_64(b), "len {n}");
            for seed in [0u64, 1, 77, u64::MAX] {
                assert_eq!(
                    sample_checksum(seed, b),
                    xxhash_rust::xxh3::xxh3_64_with_seed(b, seed),
                    "len {n} seed {seed}"
                );
            }
            let mut h = ShardHasher::default();
            for piece in b.chunks(1000) {
                h.update(piece);
            }
            assert_eq!(h.digest(), xxh3_64(b), "len {n}, in pieces");
        }
    }
}
