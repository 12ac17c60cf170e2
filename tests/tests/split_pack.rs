//! `ramjet pack --tasks N --task I` and `--merge` on real local files and real processes: the
//! same bytes and manifest version whatever the number of tasks, resumable after a SIGKILL,
//! and a merge that refuses a missing or damaged part, naming it.

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use ramjet_tests::{copy_tree, flip_byte, ramjet, ramjet_bin, ramjet_fails_naming, ramjet_ok, synth_dataset, text};

const N: usize = 40;

/// Every file under `dir` (relative name → bytes), the task parts and plan left out.
fn files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    fn walk(base: &Path, d: &Path, out: &mut BTreeMap<String, Vec<u8>>) {
        for e in fs::read_dir(d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(base, &p, out);
            } else {
                out.insert(
                    p.strip_prefix(base).unwrap().display().to_string(),
                    fs::read(&p).unwrap(),
                );
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(dir, dir, &mut out);
    out.retain(|k, _| !k.starts_with("parts/"));
    out
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Runs every task of a pack into `dst` at once (separate processes), then the merge.
fn split_pack(src: &str, dst: &Path, tasks: u64, extra: &[&str]) -> String {
    let n = tasks.to_string();
    let children: Vec<_> = (0..tasks)
        .map(|i| {
            let mut c = Command::new(ramjet_bin());
            c.args(["pack", src, s(dst), "--tasks", &n, "--task", &i.to_string()])
                .args(extra);
            (i, c.output().unwrap())
        })
        .collect();
    for (i, o) in children {
        assert!(o.status.success(), "task {i}: {}", text(&o));
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(out.contains(&format!("pack task {i}/{tasks}: groups")), "{out}");
    }
    let mut args = vec!["pack", src, s(dst), "--tasks", &n, "--merge"];
    args.extend_from_slice(extra);
    ramjet_ok(&args)
}

fn version(out: &str) -> String {
    out.lines()
        .find_map(|l| l.strip_prefix("pack: manifest version "))
        .unwrap_or_else(|| panic!("no version in {out}"))
        .to_owned()
}

/// The same input packed by one process, by 1, 2 or 6 tasks (in 8 groups of 5 images, so two
/// tasks own four groups each and six tasks own one or two), gives byte-identical shards,
/// sidecars and manifest, under the same keys; so do a JSONL file in groups of 7 lines and an
/// image folder of uneven classes in groups of 6.
#[test]
fn one_two_or_six_tasks_give_the_bytes_and_version_of_one_pack() {
    let t = tempfile::tempdir().unwrap();
    let yolo = synth_dataset(N);
    let rows = t.path().join("rows.jsonl");
    let text: String = (0..50)
        .map(|i| format!("{{\"id\": {i}, \"text\": \"row {i}\"}}\n"))
        .collect();
    fs::write(&rows, format!("\n{text}\n\n")).unwrap();
    // An image folder of uneven classes (one empty, names that sort apart by component and by
    // byte), and a stray file at its top: the plan lists the classes in parallel, and groups
    // straddle classes.
    let folder = t.path().join("folder");
    let sizes = [
        ("a", 1),
        ("a-b", 7),
        ("a.c", 0),
        ("b", 3),
        ("c", 12),
        ("d", 2),
        ("e", 8),
        ("f", 6),
        ("g", 1),
    ];
    let mut i = 0;
    for (class, n) in sizes {
        fs::create_dir_all(folder.join(class)).unwrap();
        for k in 0..n {
            let to = folder.join(class).join(format!("{k:02}.jpg"));
            fs::copy(yolo.join(format!("images/{i:06}.jpg")), to).unwrap();
            i += 1;
        }
    }
    fs::write(folder.join("stray.txt"), "not in a class").unwrap();
    for (src, extra) in [
        (s(&yolo).to_owned(), vec!["--group-size", "5", "--shard-size", "300KiB"]),
        (s(&rows).to_owned(), vec!["--group-size", "7", "--shard-size", "4KiB"]),
        (
            s(&folder).to_owned(),
            vec!["--group-size", "6", "--shard-size", "200KiB", "--skip-bad"],
        ),
    ] {
        let one = t.path().join(format!("one-{}", extra[1]));
        let mut args = vec!["pack", src.as_str(), s(&one)];
        args.extend_from_slice(&extra);
        let v = version(&ramjet_ok(&args));
        let want = files(&one);
        assert!(
            want.keys().filter(|k| k.starts_with("shards/")).count() >= 8,
            "{:?}",
            want.keys()
        );
        for tasks in [1u64, 2, 6] {
            let dst = t.path().join(format!("split-{}-{tasks}", extra[1]));
            let out = split_pack(&src, &dst, tasks, &extra);
            assert_eq!(version(&out), v, "{tasks} tasks");
            let got = files(&dst);
            assert_eq!(
                got.keys().collect::<Vec<_>>(),
                want.keys().collect::<Vec<_>>(),
                "{tasks} tasks"
            );
            for (k, b) in &want {
                assert!(got[k] == *b, "{k} differs with {tasks} tasks");
            }
        }
        // The data reads back: every sample, verified.
        ramjet_ok(&["verify", s(&one)]);
    }
}

/// A task killed mid-way (SIGKILL, after its first part) is rerun alone and packs only the
/// groups it had not finished; a merge with a part missing names the part and the task to
/// rerun; a damaged part is refused, then repacked by its task's rerun; a shard deleted after
/// its part was written is named by the merge. The end result equals a one-machine pack.
#[test]
fn a_killed_task_reruns_alone_and_a_merge_names_missing_or_damaged_parts() {
    let t = tempfile::tempdir().unwrap();
    let rows = t.path().join("rows.jsonl");
    let text: String = (0..600_000u64)
        .map(|i| format!("{{\"id\": {i}, \"text\": \"row {i} of the resumable pack\"}}\n"))
        .collect();
    fs::write(&rows, text).unwrap();
    let extra = ["--group-size", "20000", "--shard-size", "64KiB", "--threads", "1"];
    let (one, dst) = (t.path().join("one"), t.path().join("split"));
    let mut args = vec!["pack", s(&rows), s(&one)];
    args.extend_from_slice(&extra);
    let v = version(&ramjet_ok(&args));

    // Task 1 of 3 owns groups 10..20; it is killed once its first part is written.
    let mut child = Command::new(ramjet_bin())
        .args(["pack", s(&rows), s(&dst), "--tasks", "3", "--task", "1"])
        .args(extra)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    while !dst.join("parts/00000010.json").exists() {
        assert!(t0.elapsed() < Duration::from_secs(120), "task 1 wrote no part");
        assert!(child.try_wait().unwrap().is_none(), "task 1 ended before it was killed");
        std::thread::sleep(Duration::from_millis(2));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let done_before = (10..20)
        .filter(|g| dst.join(format!("parts/{g:08}.json")).exists())
        .count();
    assert!(done_before < 10, "task 1 finished before the kill");

    for task in ["0", "2"] {
        let mut a = vec!["pack", s(&rows), s(&dst), "--tasks", "3", "--task", task];
        a.extend_from_slice(&extra);
        ramjet_ok(&a);
    }
    let mut merge = vec!["pack", s(&rows), s(&dst), "--tasks", "3", "--merge"];
    merge.extend_from_slice(&extra);
    let missing = (10..20)
        .find(|g| !dst.join(format!("parts/{g:08}.json")).exists())
        .unwrap();
    let err = ramjet_fails_naming(
        &merge,
        &[
            "merge refused",
            &format!("parts/{missing:08}.json missing (task 1 of 3)"),
        ],
    );
    assert!(
        !dst.join("manifest.json").exists(),
        "a refused merge wrote a manifest:\n{err}"
    );

    // The rerun keeps what the killed run finished and packs the rest.
    let mut a = vec!["pack", s(&rows), s(&dst), "--tasks", "3", "--task", "1"];
    a.extend_from_slice(&extra);
    let out = ramjet_ok(&a);
    assert!(out.contains(&format!("({done_before} resumed")), "{out}");

    // A damaged part is refused, naming it; its task's rerun packs that group again.
    let part = dst.join("parts/00000004.json");
    flip_byte(&part, 40);
    ramjet_fails_naming(&merge, &["parts/00000004.json damaged (task 0 of 3)"]);
    let mut a = vec!["pack", s(&rows), s(&dst), "--tasks", "3", "--task", "0"];
    a.extend_from_slice(&extra);
    assert!(ramjet_ok(&a).contains("(9 resumed"));

    // A shard gone after its part was written.
    let shard = fs::read_dir(dst.join("shards"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let kept = fs::read(&shard).unwrap();
    fs::remove_file(&shard).unwrap();
    let name = shard.file_name().unwrap().to_str().unwrap().to_owned();
    ramjet_fails_naming(&merge, &[&name, "is missing", "rerun that task"]);
    fs::write(&shard, kept).unwrap();

    assert_eq!(version(&ramjet_ok(&merge)), v);
    assert_eq!(files(&dst), files(&one));
}

/// The plan fixes the input and the options: a task asking for another shard size is refused
/// naming the option; a file added to the input after the plan shifts the groups after it,
/// and the task packing them says the input changed, naming the group; a merge for another
/// input is refused.
#[test]
fn a_task_refuses_other_options_or_a_changed_input() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("src");
    copy_tree(&synth_dataset(N), &src);
    let dst = t.path().join("dst");
    let base = ["--group-size", "10", "--shard-size", "300KiB"];
    let task = |i: &str, extra: &[&str]| {
        let mut a = vec!["pack", s(&src), s(&dst), "--tasks", "2", "--task", i];
        a.extend_from_slice(extra);
        a.iter().map(|x| x.to_string()).collect::<Vec<_>>()
    };
    let run = |a: &[String]| ramjet(&a.iter().map(|x| x.as_str()).collect::<Vec<_>>(), &[]);
    let o = run(&task("0", &base));
    assert!(o.status.success(), "{}", text(&o));
    let o = run(&task("1", &["--group-size", "10", "--shard-size", "1MiB"]));
    assert!(!o.status.success());
    let err = text(&o);
    assert!(
        err.contains("--shard-size 307200") && err.contains("1048576") && err.contains("parts/plan.json"),
        "{err}"
    );

    // images/000021b.jpg sorts into group 2 (task 1's first): that group now lists other files.
    fs::copy(src.join("images/000021.jpg"), src.join("images/000021b.jpg")).unwrap();
    let o = run(&task("1", &base));
    assert!(!o.status.success(), "{}", text(&o));
    let err = text(&o);
    assert!(err.contains("the input changed since it was planned: group 2"), "{err}");

    let other = t.path().join("other");
    fs::create_dir_all(&other).unwrap();
    ramjet_fails_naming(
        &["pack", s(&other), s(&dst), "--merge"],
        &["the plan packs", "merge with the tasks' input"],
    );
    ramjet_fails_naming(
        &["pack", s(&src), s(&dst), "--tasks", "2", "--task", "2"],
        &["--task", "task 2 of 2"],
    );
    ramjet_fails_naming(
        &["pack", s(&src), s(&dst), "--tasks", "2"],
        &["--tasks N needs --task I"],
    );
}
