"""ramjet under a real three-node Slurm cluster (tools/slurm/testcluster.sh: Debian's slurm-wlm
and munge, each node a network, UTS and mount namespace with its own slurmd).

`sbatch -N 3` runs the sbatch template (tools/slurm/ramjet.sbatch) with the launcher
(tools/slurm/ramjet-slurm) and the 3-rank DDP example (gloo), streaming the synthetic set from
the local S3 server through a counting proxy on the cluster's bridge. Needs root (namespaces, a
bridge, slurmd); RAMJET_SKIP_SLURM=1 skips it, visibly.
"""

import json
import os
import re
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from counting_proxy import CountingProxy

ROOT = Path(__file__).resolve().parents[2]
RAMJET = os.path.abspath(os.environ.get("RAMJET_BIN") or ROOT / "target/debug/ramjet")
BUCKET = os.environ.get("RAMJET_S3_BUCKET", "ramjet")
NODES = 3
SAMPLES = 480  # 3 ranks x 10 batches of 16: every epoch divides evenly, nothing is dropped

if os.environ.get("RAMJET_SKIP_SLURM") == "1":
    pytest.skip("RAMJET_SKIP_SLURM=1: the Slurm cluster test is skipped on request", allow_module_level=True)


def sh(*args, env=None, check=True, timeout=120):
    out = subprocess.run(list(args), capture_output=True, text=True, env=env, timeout=timeout)
    if check:
        assert out.returncode == 0, f"{args}: exit {out.returncode}\n{out.stdout}\n{out.stderr}"
    return out


@pytest.fixture(scope="module")
def cluster():
    if os.geteuid() != 0:
        pytest.fail("the Slurm test needs root (network namespaces, a bridge, slurmd); "
                    "RAMJET_SKIP_SLURM=1 skips it")
    script = str(ROOT / "tools/slurm/testcluster.sh")
    sh("bash", script, "start", timeout=600)
    env = dict(os.environ)
    for line in sh("bash", script, "env").stdout.splitlines():
        k, v = line.removeprefix("export ").split("=", 1)
        env[k] = v
    try:
        yield env
    finally:
        sh("bash", script, "stop", check=False)


@pytest.fixture(scope="module")
def dataset(cluster, tmp_path_factory):
    if "AWS_ENDPOINT_URL" not in os.environ:
        pytest.fail("the local S3 server is not configured: run tools/test.sh")
    d = tmp_path_factory.mktemp("slurm-synth")
    sh(RAMJET, "synth", str(d / "synth"), "--samples", str(SAMPLES))
    url = f"s3://{BUCKET}/pytest-slurm/synth-{uuid.uuid4().hex[:8]}"
    sh(RAMJET, "pack", str(d / "synth"), url, "--shard-size", "1MiB")
    info = json.loads(sh(RAMJET, "inspect", url, "--json").stdout)
    return url, info


@pytest.fixture
def proxy(cluster):
    """A request-counting proxy to the S3 server on the cluster's bridge (the nodes cannot
    reach the root namespace's loopback)."""
    p = CountingProxy(cluster["RAMJET_SLURM_GATEWAY"], ("127.0.0.1", int(os.environ["RAMJET_S3_PORT"])))
    yield p
    p.close()


def job_state(env, jid):
    out = sh("scontrol", "show", "job", str(jid), env=env, check=False).stdout
    state = re.search(r"JobState=(\S+)", out)
    code = re.search(r"ExitCode=(\S+)", out)
    return (state.group(1) if state else "?"), (code.group(1) if code else "?")


def wait_gone(env, jid, timeout):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if not sh("squeue", "-h", "-j", str(jid), env=env, check=False).stdout.strip():
            return
        time.sleep(0.5)
    sh("scancel", str(jid), env=env, check=False)
    pytest.fail(f"job {jid} still running after {timeout} s")


def submit(cluster, dataset, proxy, work, train_args, url=None, **extra_env):
    env = dict(cluster, **extra_env)
    env.update(
        RAMJET_HOME=str(ROOT),
        RAMJET_BIN=RAMJET,
        RAMJET_RUN_ROOT=str(work / "run"),
        DATASET=url or dataset[0],
        PYTHON=str(Path(os.environ.get("RAMJET_VENV", ROOT / ".venv")) / "bin/python"),
        TRAIN_ARGS=train_args,
        AWS_ENDPOINT_URL=f"http://{proxy.address}",
    )
    env.pop("RAMJET_API_KEY", None)  # the launcher makes one for the job
    (work / "run").mkdir(parents=True, exist_ok=True)
    out = sh("sbatch", "--parsable", "-N", str(NODES), "--chdir", str(work), "-o", str(work / "job-%j.out"),
             str(ROOT / "tools/slurm/ramjet.sbatch"), env=env)
    return int(out.stdout.strip().split(";")[0]), env


def assert_nothing_left(work, jid, marker):
    """No process, socket, listening port or file of job `jid` on any node. `marker` is a
    string in the command line of the job's ranks."""
    procs = [line for line in sh("ps", "-eo", "pid,args").stdout.splitlines()
             if marker in line or f"ramjet-{jid}-node" in line or f"job{jid:05d}" in line]
    assert not procs, f"processes left after job {jid}:\n" + "\n".join(procs)
    left = sorted(str(p) for p in (work / "run").glob(f"ramjet-{jid}-*"))
    assert not left, f"files left after job {jid}: {left}"
    base = 20000 + (jid % 4000) * 4
    inst = int(os.environ.get("RAMJET_S3_PORT", "8333")) // 100 % 200
    for i in range(1, NODES + 1):
        ports = sh("nsenter", f"--net=/var/run/netns/rj{inst}-node{i}", "ss", "-Hltnx").stdout
        mine = [line for line in ports.splitlines()
                if re.search(r":(%d|%d|%d)\b" % (base, base + 1, base + 2), line) or f"ramjet-{jid}-" in line]
        assert not mine, f"node{i}: listening after job {jid}: {mine}"


def eventually_nothing_left(work, jid, marker):
    # A cancelled job's steps end with it; give each node's slurmstepd a moment.
    t0 = time.monotonic()
    while True:
        try:
            return assert_nothing_left(work, jid, marker)
        except AssertionError:
            if time.monotonic() - t0 > 30:
                raise
            time.sleep(0.5)


def output(work, jid):
    f = work / f"job-{jid}.out"
    return f.read_text() if f.exists() else ""


def check_record(path):
    """Every epoch: the three ranks' samples, reassembled, are every sample exactly once; the
    loss falls."""
    rec = json.loads(path.read_text())
    assert rec["world"] == 3 and rec["num_samples"] == SAMPLES
    for e in rec["epochs"]:
        flat = [i for rank in e["indices"] for i in rank]
        assert sorted(flat) == list(range(SAMPLES))
        assert all(len(rank) == SAMPLES // 3 for rank in e["indices"])
    first, last = rec["epochs"][0]["mean_loss"], rec["epochs"][-1]["mean_loss"]
    assert last < 0.8 * first, (first, last)


def test_three_node_job_trains_covers_every_epoch_once_and_leaves_nothing(cluster, dataset, proxy, tmp_path):
    url, info = dataset
    record = tmp_path / "record.json"
    # RAMJET_SRUN_ARGS reaches the ranks' step.
    jid, env = submit(cluster, dataset, proxy, tmp_path, f"--out {record}", RAMJET_SRUN_ARGS="--cpus-per-task=1")
    wait_gone(env, jid, 600)
    out = output(tmp_path, jid)
    state, code = job_state(env, jid)
    assert (state, code) == ("COMPLETED", "0:0"), f"job {jid}: {state} {code}\n{out}"

    # The ring: three daemons, one per node, agreed on one ring of all three, and each rank
    # read through its own node's daemon.
    m = re.search(r"ring ready after [\d.]+ s: 3 members, version \d+: (.*)", out)
    assert m, out
    assert sorted(n.split(":")[0] for n in m.group(1).split()) == ["node1", "node2", "node3"]
    for i in range(1, NODES + 1):
        assert re.search(rf"^rank \d/3 on node{i}, daemon {tmp_path}/run/ramjet-{jid}-node{i}/ramjet.sock",
                         out, re.M), out
    assert re.search(r"^ramjet-slurm: ranks: srun .*--cpus-per-task=1 ", out, re.M), out
    check_record(record)

    # The origin saw each shard once: a miss is fetched once per cluster, by its owner.
    reqs = proxy.requests()
    shard_gets = [p for (meth, p, _) in reqs if meth == "GET" and "/shards/" in p]
    assert len(set(shard_gets)) == info["shards"], (len(set(shard_gets)), info["shards"], reqs)
    assert len(shard_gets) == info["shards"], sorted(shard_gets)
    assert_nothing_left(tmp_path, jid, str(record))


def test_two_jobs_share_the_nodes_and_a_cancelled_one_leaves_nothing(cluster, dataset, proxy, tmp_path):
    # Two jobs on the same three nodes at once, with the same run root: their daemons,
    # sockets, ports and files are keyed by job id and node, so neither disturbs the other.
    # One is cancelled mid-epoch; the other trains to the end, covering every epoch exactly once.
    slow_out, done_out = tmp_path / "slow.json", tmp_path / "done.json"
    # Two jobs of one CPU a node fit at once only on nodes of 2 CPUs or more (they had 1 when the
    # cluster counted its CPUs under OMP_NUM_THREADS=1, set by Ultralytics' import in this process).
    cpus = sh("sinfo", "-h", "-N", "-o", "%N %c", env=cluster).stdout.split()
    assert all(int(c) >= 2 for c in cpus[1::2]), f"nodes and CPUs: {cpus}"
    slow, env = submit(cluster, dataset, proxy, tmp_path, f"--step-ms 2000 --out {slow_out}")
    done, _ = submit(cluster, dataset, proxy, tmp_path, f"--step-ms 800 --out {done_out}")

    def wait_for(text, jid):
        t0 = time.monotonic()
        while text not in output(tmp_path, jid):
            assert time.monotonic() - t0 < 300, f"job {jid} never printed {text!r}:\n" + output(tmp_path, jid)
            time.sleep(0.1)

    # Both train at once: the first job alone would take 40 s of steps (it is cancelled at
    # step 3), the second at least 16 s.
    t0 = time.monotonic()
    while not all("epoch 0 step 0 " in output(tmp_path, j) for j in (slow, done)):
        assert time.monotonic() - t0 < 300, "the jobs did not both start:\n" + output(
            tmp_path, slow) + output(tmp_path, done)
        time.sleep(0.1)
    # On the same three nodes (asked of scontrol, which answers whatever state a job has reached;
    # that both trained at once is shown below: `slow` is cancelled mid-epoch after `done` began).
    for j in (slow, done):
        shown = sh("scontrol", "show", "job", str(j), env=env).stdout
        assert re.search(r"\bNodeList=node\[1-3\]", shown), f"job {j}: {job_state(env, j)}\n{shown}"
    wait_for("epoch 0 step 3 ", slow)
    sh("scancel", str(slow), env=env)
    wait_gone(env, slow, 120)
    assert job_state(env, slow)[0] == "CANCELLED", f"job {slow}: {job_state(env, slow)}\n" + output(tmp_path, slow)
    eventually_nothing_left(tmp_path, slow, str(slow_out))

    wait_gone(env, done, 600)
    state, code = job_state(env, done)
    assert (state, code) == ("COMPLETED", "0:0"), f"job {done}: {state} {code}\n{output(tmp_path, done)}"
    check_record(done_out)
    assert_nothing_left(tmp_path, done, str(done_out))


def test_a_job_whose_ranks_fail_names_the_dataset_and_leaves_nothing(cluster, dataset, proxy, tmp_path):
    missing = f"s3://{BUCKET}/pytest-slurm/no-such-dataset-{uuid.uuid4().hex[:8]}"
    marker = tmp_path / "never.json"
    jid, env = submit(cluster, dataset, proxy, tmp_path, f"--out {marker}", url=missing)
    wait_gone(env, jid, 300)
    state, code = job_state(env, jid)
    out = output(tmp_path, jid)
    assert state == "FAILED" and code != "0:0", f"{state} {code}\n{out}"
    assert missing in out, out
    assert re.search(r"torn down \(exit [1-9]", out), out
    assert_nothing_left(tmp_path, jid, str(marker))


def upload_tree(local, url):
    import boto3

    bucket, prefix = url.removeprefix("s3://").split("/", 1)
    s3 = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
    for p in sorted(Path(local).rglob("*")):
        if p.is_file():
            s3.upload_file(str(p), bucket, f"{prefix}/{p.relative_to(local)}")


def wait_state(env, jid, timeout):
    wait_gone(env, jid, timeout)
    return job_state(env, jid)


def test_a_pack_split_across_a_job_array_resumes_a_cancelled_task_and_equals_one_pack(cluster, proxy, tmp_path):
    """tools/slurm/ramjet-pack.sbatch: one submission plans the pack (one listing), submits an
    array of 6 tasks packing from the local S3 server into it, and a merge after them. Index 3 is
    cancelled by `scancel <array>_3` (while the array is held, so it never ran); the merge then
    refuses, naming group 6's part and task 3 of 6. Index 3 resubmitted alone, then the merge
    again: the dataset verifies and has the manifest version of a one-machine pack."""
    raw_dir = tmp_path / "raw"
    sh(RAMJET, "synth", str(raw_dir), "--samples", "120")
    run = uuid.uuid4().hex[:8]
    raw = f"s3://{BUCKET}/pytest-slurm/raw-{run}"
    upload_tree(raw_dir, raw)
    dst, one = f"s3://{BUCKET}/pytest-slurm/packed-{run}", f"s3://{BUCKET}/pytest-slurm/one-{run}"
    args = ["--group-size", "10", "--shard-size", "256KiB"]
    want = re.search(r"manifest version (\w+)", sh(RAMJET, "pack", raw, one, *args).stdout).group(1)

    env = dict(cluster)
    env.update(
        RAMJET_HOME=str(ROOT), RAMJET_BIN=RAMJET, SRC=raw, DST=dst, TASKS="6", PACK_ARGS=" ".join(args),
        SBATCH_ARGS="--hold", AWS_ENDPOINT_URL=f"http://{proxy.address}",
        RAMJET_PACK_OUTPUT=str(tmp_path / "task-%A_%a.out"),
        RAMJET_PACK_OUTPUT_MERGE=str(tmp_path / "merge-%j.out"),
    )
    sbatch = str(ROOT / "tools/slurm/ramjet-pack.sbatch")
    launch = int(sh("sbatch", "--parsable", "--chdir", str(tmp_path), "-o", str(tmp_path / "launch-%j.out"),
                    sbatch, env=env).stdout.strip().split(";")[0])
    state = wait_state(env, launch, 300)
    text = (tmp_path / f"launch-{launch}.out").read_text()
    assert state == ("COMPLETED", "0:0"), text
    m = re.search(r"array job (\d+) \(tasks 0-5\), merge job (\d+)", text)
    assert m and "plan " in text and "120 inputs in 12 groups" in text, text
    array, merge = int(m.group(1)), int(m.group(2))

    sh("scancel", f"{array}_3", env=env)
    sh("scontrol", "release", str(array), str(merge), env=env)  # SBATCH_ARGS held both
    state, _ = wait_state(env, merge, 300)
    merged = (tmp_path / f"merge-{merge}.out").read_text()
    assert state == "FAILED", merged
    assert "merge refused: 2 of 12 parts missing" in merged, merged
    assert "parts/00000006.json missing (task 3 of 6)" in merged, merged
    for i in (0, 1, 2, 4, 5):
        out = (tmp_path / f"task-{array}_{i}.out").read_text()
        assert f"pack task {i}/6: groups" in out, out

    # Task 3 alone, then the merge.
    env.update(SBATCH_ARGS="")
    rerun = int(sh("sbatch", "--parsable", "--array=3", "--chdir", str(tmp_path), "-o", str(tmp_path / "rerun-%A_%a.out"),
                   "--export=ALL,RAMJET_PACK_STEP=task", sbatch, env=env).stdout.strip().split(";")[0])
    wait_gone(env, rerun, 300)
    out = (tmp_path / f"rerun-{rerun}_3.out").read_text()
    assert "pack task 3/6: groups 6..8 of 12 (0 resumed)" in out, out
    merge2 = int(sh("sbatch", "--parsable", "--chdir", str(tmp_path), "-o", str(tmp_path / "merge2-%j.out"),
                    "--export=ALL,RAMJET_PACK_STEP=merge", sbatch, env=env).stdout.strip().split(";")[0])
    state = wait_state(env, merge2, 300)
    merged = (tmp_path / f"merge2-{merge2}.out").read_text()
    assert state == ("COMPLETED", "0:0"), merged
    assert f"manifest version {want}" in merged, merged
    sh(RAMJET, "verify", dst)
