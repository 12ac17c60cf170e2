//! Where `pack` reads its input: a local folder or file, or a prefix or object in an object
//! store (`s3://`, `gs://`, `az://`), listed and read through the same [`Store`] as everything
//! else (its retries, its origin control).
//!
//! Inputs are named by their key relative to the source's root (`cat/001.jpg`,
//! `images/train/x.jpg`) and come in a fixed order: a local folder is walked in path order
//! (component by component), an object store prefix is listed in the store's own order (UTF-8
//! byte order on S3, folder by folder on SeaweedFS). Either way a listing resumes after any key
//! it gave, which is what splits a pack into tasks (`split.rs`).

use std::ffi::OsString;
use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};

use futures::StreamExt;

use ramjet_engine::{Error, Result, Store};

/// Whole objects a worker fetches at once from an object store (each worker builds one shard).
pub const FETCH_IN_FLIGHT: usize = 32;

/// The most bytes one local input file (an image, a `.npy`, a label file) may hold: a path a
/// row names may be `/dev/zero`, a FIFO or a huge file, and is read only when it is a regular
/// file of at most this size ([`ramjet_engine::io::read_file_bounded`]).
pub const INPUT_FILE_BYTES_MAX: u64 = 4 << 30;

/// The root of a pack's input.
#[derive(Clone)]
pub enum Root {
    /// A local folder.
    Local(PathBuf),
    /// A prefix in an object store.
    Store(Store),
}

/// A pack's input: a folder (or prefix), or one file (or object) in it.
#[derive(Clone)]
pub struct Source {
    /// The folder or prefix inputs are named relative to.
    pub root: Root,
    /// The JSONL file (or object), relative to the root, when the input is one.
    pub file: Option<String>,
    /// As the user gave it.
    pub display: String,
    /// Stores of the buckets a JSONL input's rows name, by `scheme://bucket`.
    stores: std::sync::Arc<std::sync::Mutex<std::collections::HashMap<String, Store>>>,
}

/// Suffixes of an object URL that names a JSONL object rather than a prefix.
const JSONL_SUFFIXES: [&str; 3] = [".jsonl", ".ndjson", ".json"];

impl Source {
    /// `src`: a local path, `file://…`, or an object store URL. A URL ending in `.jsonl`,
    /// `.ndjson` or `.json` names one JSONL object; any other, a prefix.
    pub fn open(src: &str) -> Result<Source> {
        let remote = src.contains("://") && !src.starts_with("file://");
        if !remote {
            let p = PathBuf::from(src.strip_prefix("file://").unwrap_or(src));
            if p.is_file() {
                let dir = p
                    .parent()
                    .filter(|d| !d.as_os_str().is_empty())
                    .unwrap_or(Path::new("."));
                let name = p
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default();
                return Ok(Source {
                    root: Root::Local(dir.to_path_buf()),
                    file: Some(name),
                    display: src.to_owned(),
                    stores: Default::default(),
                });
            }
            if !p.is_dir() {
                return Err(Error::invalid(src, "no such file or folder"));
            }
            return Ok(Source {
                root: Root::Local(p),
                file: None,
                display: src.to_owned(),
                stores: Default::default(),
            });
        }
        let t = src.trim_end_matches('/');
        if let Some((dir, name)) = t
            .rsplit_once('/')
            .filter(|(d, n)| !d.ends_with(':') && !d.ends_with(":/") && JSONL_SUFFIXES.iter().any(|s| n.ends_with(s)))
        {
            return Ok(Source {
                root: Root::Store(Store::open(dir)?),
                file: Some(name.to_owned()),
                display: src.to_owned(),
                stores: Default::default(),
            });
        }
        Ok(Source {
            root: Root::Store(Store::open(t)?),
            file: None,
            display: src.to_owned(),
            stores: Default::default(),
        })
    }

    /// The name of `key` in messages: a path or a URL.
    pub fn name(&self, key: &str) -> String {
        match &self.root {
            Root::Local(d) => d.join(key).display().to_string(),
            Root::Store(s) => s.url(key),
        }
    }

    /// Reads one input whole.
    pub fn read(&self, rt: &tokio::runtime::Runtime, key: &str) -> Result<Vec<u8>> {
        match &self.root {
            Root::Local(d) => ramjet_engine::io::read_file_bounded(&d.join(key), INPUT_FILE_BYTES_MAX),
            Root::Store(s) => Ok(Vec::from(rt.block_on(s.get(key))?)),
        }
    }

    /// Reads one input whole, `None` if it does not exist.
    pub fn read_opt(&self, rt: &tokio::runtime::Runtime, key: &str) -> Result<Option<Vec<u8>>> {
        match self.read(rt, key) {
            Ok(b) => Ok(Some(b)),
            Err(Error::NotFound { .. }) => Ok(None),
            Err(Error::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Reads `keys`, in order: from an object store [`FETCH_IN_FLIGHT`] at once, from a local
    /// folder one after the other (`f` gets each as it comes, with its index).
    pub fn read_each(
        &self,
        rt: &tokio::runtime::Runtime,
        keys: &[&str],
        mut f: impl FnMut(usize, Result<Vec<u8>>) -> Result<()>,
    ) -> Result<()> {
        match &self.root {
            Root::Local(_) => {
                for (i, k) in keys.iter().enumerate() {
                    f(i, self.read(rt, k))?;
                }
                Ok(())
            }
            Root::Store(s) => rt.block_on(async {
                let mut got = futures::stream::iter(keys.iter().copied())
                    .map(|k| async move { s.get(k).await.map(Vec::from) })
                    .buffered(FETCH_IN_FLIGHT)
                    .enumerate();
                while let Some((i, r)) = got.next().await {
                    f(i, r)?;
                }
                Ok(())
            }),
        }
    }

    /// Reads each of `keys` that exists (`None` for one that does not), in parallel.
    pub fn read_opt_all(&self, rt: &tokio::runtime::Runtime, keys: &[String]) -> Vec<Result<Option<Vec<u8>>>> {
        match &self.root {
            Root::Local(_) => {
                use rayon::prelude::*;
                keys.par_iter().map(|k| self.read_opt(rt, k)).collect()
            }
            Root::Store(s) => rt.block_on(
                futures::stream::iter(keys.iter())
                    .map(|k| async move {
                        match s.get(k).await {
                            Ok(b) => Ok(Some(Vec::from(b))),
                            Err(Error::NotFound { .. }) => Ok(None),
                            Err(e) => Err(e),
                        }
                    })
                    .buffered(FETCH_IN_FLIGHT * 2)
                    .collect(),
            ),
        }
    }

    /// A local input's size (an object store's listing gives its sizes).
    pub fn local_size(&self, key: &str) -> Result<u64> {
        match &self.root {
            Root::Local(d) => {
                let p = d.join(key);
                Ok(fs::metadata(&p).map_err(|e| Error::io(p.display(), e))?.len())
            }
            Root::Store(s) => Err(Error::invalid(s.url(key), "no size from the listing")),
        }
    }

    /// Reads the images `names` name ([`FETCH_IN_FLIGHT`] at once), in order: a URL
    /// (`s3://bucket/key`, `file:///path`), an absolute path, or a key relative to the JSONL
    /// input's folder. An empty name is an error.
    pub fn fetch_refs(&self, rt: &tokio::runtime::Runtime, names: &[String]) -> Vec<Result<Vec<u8>>> {
        rt.block_on(
            futures::stream::iter(names.iter())
                .map(|n| self.fetch_ref(n))
                .buffered(FETCH_IN_FLIGHT)
                .collect(),
        )
    }

    async fn fetch_ref(&self, name: &str) -> Result<Vec<u8>> {
        let local = |p: PathBuf| ramjet_engine::io::read_file_bounded_async(p, INPUT_FILE_BYTES_MAX);
        if name.is_empty() {
            return Err(Error::invalid("image", "no image named (an empty string)"));
        }
        if let Some(p) = name.strip_prefix("file://") {
            return local(PathBuf::from(p)).await;
        }
        if let Some((scheme, rest)) = name.split_once("://") {
            let Some((bucket, key)) = rest.split_once('/') else {
                return Err(Error::invalid(name, "a URL names an object: scheme://bucket/key"));
            };
            let store = self.store_for(&format!("{scheme}://{bucket}"))?;
            return Ok(Vec::from(store.get(key).await?));
        }
        if name.starts_with('/') {
            return local(PathBuf::from(name)).await;
        }
        match &self.root {
            Root::Local(d) => local(d.join(name)).await,
            Root::Store(s) => Ok(Vec::from(s.get(name).await?)),
        }
    }

    /// A store for a bucket other rows name, opened once.
    fn store_for(&self, base: &str) -> Result<Store> {
        let mut m = self.stores.lock().expect("not poisoned");
        if let Some(s) = m.get(base) {
            return Ok(s.clone());
        }
        let s = Store::open(base)?;
        m.insert(base.to_owned(), s.clone());
        Ok(s)
    }

    /// The folders and files directly in the root (hidden ones left out), each sorted by name.
    pub fn top(&self, rt: &tokio::runtime::Runtime) -> Result<(Vec<String>, Vec<String>)> {
        let (mut dirs, mut files) = (Vec::new(), Vec::new());
        match &self.root {
            Root::Local(d) => {
                for (p, is_dir) in list_sorted(d)? {
                    let name = p
                        .file_name()
                        .map(|n| n.to_string_lossy().into_owned())
                        .unwrap_or_default();
                    if is_dir {
                        dirs.push(name)
                    } else {
                        files.push(name)
                    }
                }
            }
            Root::Store(s) => {
                let (d, f) = rt.block_on(s.list_dir(""))?;
                dirs = d.into_iter().filter(|n| !n.starts_with('.')).collect();
                files = f.into_iter().map(|(n, _)| n).filter(|n| !n.starts_with('.')).collect();
            }
        }
        Ok((dirs, files))
    }

    /// The files under folder `under` (a key relative to the root), after key `after` when
    /// given, each with its size when the listing gives it: walked in path order from a local
    /// folder, listed in the store's order from an object store. Hidden entries (a name
    /// starting with `.`) and folder markers are left out.
    pub fn walk(
        &self,
        rt: &tokio::runtime::Handle,
        under: &str,
        after: Option<&str>,
    ) -> Box<dyn Iterator<Item = Result<(String, Option<u64>)>> + Send> {
        match &self.root {
            Root::Local(d) => {
                let base = d.clone();
                let walk = match SortedWalk::after(&d.join(under), after.and_then(|a| rest_of(a, under))) {
                    Ok(w) => w,
                    Err(e) => return Box::new(std::iter::once(Err(e))),
                };
                Box::new(walk.map(move |p| Ok((rel_of(&base, &p?), None))))
            }
            Root::Store(s) => Box::new(StoreWalk {
                rt: rt.clone(),
                listing: s.list(under, after),
            }),
        }
    }

    /// The JSONL input's size in bytes.
    pub fn file_len(&self, rt: &tokio::runtime::Runtime) -> Result<u64> {
        let f = self.file.as_deref().expect("a JSONL source");
        match &self.root {
            Root::Local(d) => {
                let p = d.join(f);
                Ok(fs::metadata(&p).map_err(|e| Error::io(p.display(), e))?.len())
            }
            Root::Store(s) => rt.block_on(s.size(f)),
        }
    }

    /// The JSONL input from byte `offset`, buffered.
    pub fn file_reader(&self, rt: &tokio::runtime::Runtime, offset: u64) -> Result<Box<dyn std::io::BufRead + Send>> {
        let f = self.file.as_deref().expect("a JSONL source");
        match &self.root {
            Root::Local(d) => {
                use std::io::Seek;
                let p = d.join(f);
                let mut file = fs::File::open(&p).map_err(|e| Error::io(p.display(), e))?;
                file.seek(std::io::SeekFrom::Start(offset))
                    .map_err(|e| Error::io(p.display(), e))?;
                Ok(Box::new(std::io::BufReader::with_capacity(1 << 20, file)))
            }
            Root::Store(s) => {
                let len = rt.block_on(s.size(f))?;
                Ok(Box::new(std::io::BufReader::with_capacity(
                    1 << 20,
                    ObjectReader {
                        rt: rt.handle().clone(),
                        store: s.clone(),
                        key: f.to_owned(),
                        at: offset.min(len),
                        len,
                        next: None,
                        buf: bytes::Bytes::new(),
                    },
                )))
            }
        }
    }
}

/// The part of key `after` below folder `under` (`None` when it is not below it).
fn rest_of<'a>(after: &'a str, under: &str) -> Option<&'a str> {
    if under.is_empty() {
        return Some(after);
    }
    after.strip_prefix(under)?.strip_prefix('/')
}

/// An object store listing as an iterator (each step waits on the runtime).
struct StoreWalk {
    rt: tokio::runtime::Handle,
    listing: ramjet_engine::store::Listing,
}

impl Iterator for StoreWalk {
    type Item = Result<(String, Option<u64>)>;
    fn next(&mut self) -> Option<Self::Item> {
        loop {
            let (key, size) = match self.rt.block_on(self.listing.next())? {
                Ok(v) => v,
                Err(e) => return Some(Err(e)),
            };
            // Folder markers (`dir/`) and hidden entries are no inputs.
            if key.ends_with('/') || key.is_empty() || key.split('/').any(|c| c.starts_with('.')) {
                continue;
            }
            return Some(Ok((key, Some(size))));
        }
    }
}

/// Bytes of an object read in order, 8 MiB a request, the next one fetched while the last is
/// read.
struct ObjectReader {
    rt: tokio::runtime::Handle,
    store: Store,
    key: String,
    at: u64,
    len: u64,
    next: Option<tokio::task::JoinHandle<Result<bytes::Bytes>>>,
    buf: bytes::Bytes,
}

/// Bytes of one ranged read of a JSONL object.
const OBJECT_READ_BYTES: u64 = 8 << 20;

impl ObjectReader {
    fn fetch(&mut self) -> Option<tokio::task::JoinHandle<Result<bytes::Bytes>>> {
        if self.at >= self.len {
            return None;
        }
        let end = (self.at + OBJECT_READ_BYTES).min(self.len);
        let (s, k, r) = (self.store.clone(), self.key.clone(), self.at..end);
        self.at = end;
        Some(self.rt.spawn(async move { s.get_range(&k, r).await }))
    }
}

impl Read for ObjectReader {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        if self.buf.is_empty() {
            let job = match self.next.take() {
                Some(j) => Some(j),
                None => self.fetch(),
            };
            let Some(job) = job else { return Ok(0) };
            self.buf = self
                .rt
                .block_on(job)
                .map_err(std::io::Error::other)?
                .map_err(std::io::Error::other)?;
            self.next = self.fetch();
        }
        let n = out.len().min(self.buf.len());
        out[..n].copy_from_slice(&self.buf[..n]);
        self.buf = self.buf.slice(n..);
        Ok(n)
    }
}

/// Deepest folder nesting a pack walks.
const WALK_DEPTH_MAX: usize = 64;

/// The entries of `d` that are not hidden, sorted by name, each with whether it is a folder.
pub fn list_sorted(d: &Path) -> Result<Vec<(PathBuf, bool)>> {
    let mut out = Vec::new();
    let rd = fs::read_dir(d).map_err(|e| Error::io(d.display(), e))?;
    for e in rd {
        let e = e.map_err(|e| Error::io(d.display(), e))?;
        if e.file_name().to_string_lossy().starts_with('.') {
            continue;
        }
        let p = e.path();
        let ft = e.file_type().map_err(|err| Error::io(p.display(), err))?;
        // A link to a folder is walked as the folder.
        let is_dir = ft.is_dir() || (ft.is_symlink() && p.is_dir());
        out.push((p, is_dir));
    }
    out.sort_by(|a, b| a.0.file_name().cmp(&b.0.file_name()));
    Ok(out)
}

/// Files under a folder, recursively, in path order, found as they are walked: each folder's
/// entries are listed and sorted when the walk enters it (the same order as sorting the whole
/// listing, as paths compare component by component), so memory holds the folders on the
/// current path, not the tree. Hidden entries are ignored; a folder that cannot be listed, or
/// folders nested deeper than [`WALK_DEPTH_MAX`] (a link loop), are an error.
pub struct SortedWalk {
    stack: Vec<std::vec::IntoIter<(PathBuf, bool)>>,
}

impl SortedWalk {
    /// The walk of all of `dir`.
    pub fn new(dir: &Path) -> Result<SortedWalk> {
        Self::after(dir, None)
    }

    /// The walk of `dir` that starts after the file at relative path `after` (which need not
    /// exist): it lists only the folders on that path and what comes after them, not what
    /// came before.
    pub fn after(dir: &Path, after: Option<&str>) -> Result<SortedWalk> {
        let comps: Vec<OsString> = after
            .map(|a| a.split('/').filter(|c| !c.is_empty()).map(OsString::from).collect())
            .unwrap_or_default();
        let mut stack = Vec::new();
        let mut d = dir.to_path_buf();
        for (i, c) in comps.iter().enumerate() {
            let mut entries = list_sorted(&d)?;
            let cut = entries.partition_point(|(p, _)| p.file_name().is_some_and(|n| n <= c.as_os_str()));
            // A folder named exactly so: what is under it comes after it.
            let down = entries[..cut]
                .last()
                .filter(|(p, is_dir)| *is_dir && p.file_name() == Some(c.as_os_str()))
                .map(|(p, _)| p.clone());
            stack.push(entries.split_off(cut).into_iter());
            match down {
                Some(p) if stack.len() >= WALK_DEPTH_MAX => {
                    return Err(Error::invalid(
                        p.display().to_string(),
                        format!("folders nested over {WALK_DEPTH_MAX} deep (a link loop?)"),
                    ))
                }
                Some(p) if i + 1 == comps.len() => {
                    stack.push(list_sorted(&p)?.into_iter());
                    break;
                }
                Some(p) => d = p,
                None => break,
            }
        }
        if comps.is_empty() {
            stack.push(list_sorted(dir)?.into_iter());
        }
        Ok(SortedWalk { stack })
    }
}

impl Iterator for SortedWalk {
    type Item = Result<PathBuf>;
    fn next(&mut self) -> Option<Self::Item> {
        loop {
            match self.stack.last_mut()?.next() {
                None => {
                    self.stack.pop();
                }
                Some((p, true)) if self.stack.len() >= WALK_DEPTH_MAX => {
                    self.stack.clear();
                    return Some(Err(Error::invalid(
                        p.display().to_string(),
                        format!("folders nested over {WALK_DEPTH_MAX} deep (a link loop?)"),
                    )));
                }
                Some((p, true)) => match list_sorted(&p) {
                    Ok(v) => self.stack.push(v.into_iter()),
                    Err(e) => {
                        self.stack.clear();
                        return Some(Err(e));
                    }
                },
                Some((p, false)) => return Some(Ok(p)),
            }
        }
    }
}

/// `p` relative to `base`, with `/` between components.
pub fn rel_of(base: &Path, p: &Path) -> String {
    p.strip_prefix(base).unwrap_or(p).to_string_lossy().into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tree(r: &Path, files: &[&str]) {
        for f in files {
            let p = r.join(f);
            fs::create_dir_all(p.parent().unwrap()).unwrap();
            fs::write(&p, b"x").unwrap();
        }
    }

    /// The walk yields what sorting the whole listing gives (paths compare component by
    /// component, so "a/z" comes before "a.jpg" and "a-b"), skips hidden entries, follows a
    /// link to a folder, and names a link loop instead of walking it forever.
    #[test]
    fn the_walk_is_in_path_order_without_listing_the_tree() {
        let t = tempfile::tempdir().unwrap();
        let r = t.path();
        tree(
            r,
            &[
                "a/z",
                "a/b/c",
                "a.jpg",
                "a-b",
                "B",
                "b/x",
                "\u{e9}",
                "a/.hidden",
                ".h/x",
                "c/d/e/f",
            ],
        );
        let walked: Vec<PathBuf> = SortedWalk::new(r).unwrap().map(|p| p.unwrap()).collect();
        let mut want: Vec<PathBuf> = ["a/b/c", "a/z", "a-b", "a.jpg", "B", "b/x", "c/d/e/f", "\u{e9}"]
            .iter()
            .map(|f| r.join(f))
            .collect();
        want.sort();
        assert_eq!(walked, want);
        std::os::unix::fs::symlink(r.join("c"), r.join("c/d/loop")).unwrap();
        let e = SortedWalk::new(r)
            .unwrap()
            .find_map(|p| p.err())
            .expect("the loop is named");
        assert!(e.to_string().contains("loop"), "{e}");
    }

    /// A walk resumed after any key (one that exists, or one that does not) yields exactly
    /// what the whole walk yields after it.
    #[test]
    fn a_walk_resumes_after_any_key() {
        let t = tempfile::tempdir().unwrap();
        let r = t.path();
        tree(r, &["a/z", "a/b/c", "a/b/d", "a.jpg", "a-b", "b/x", "b/y/z", "c"]);
        let all: Vec<String> = SortedWalk::new(r).unwrap().map(|p| rel_of(r, &p.unwrap())).collect();
        let mut cursors: Vec<String> = all.clone();
        cursors.extend(["a", "a/b", "a/b/cc", "a/a", "0", "b/y", "zz", "a/b/c/d"].map(String::from));
        for c in cursors {
            let got: Vec<String> = SortedWalk::after(r, Some(&c))
                .unwrap()
                .map(|p| rel_of(r, &p.unwrap()))
                .collect();
            let want: Vec<String> = all
                .iter()
                .filter(|k| {
                    let (a, b): (Vec<&str>, Vec<&str>) = (k.split('/').collect(), c.split('/').collect());
                    a > b
                })
                .cloned()
                .collect();
            assert_eq!(got, want, "after {c:?}");
        }
    }
}
