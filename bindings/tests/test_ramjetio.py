"""The published ramjetio surface on ramjet (issue 70): its streaming page's snippet with only
the package name changed, the two exports (labels only, and the whole split), its environment
variables, and the Ultralytics version check."""

import json
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

import ramjet
import ramjet.datasets
from ports import free_port

ROOT = Path(__file__).resolve().parents[2]
RAMJET = os.environ.get("RAMJET_BIN") or str(ROOT / "target/debug/ramjet")
BUCKET = os.environ.get("RAMJET_S3_BUCKET", "ramjet")


def _sh(*cmd, **kw):
    out = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=900, **kw)
    assert out.returncode == 0, f"{cmd} failed ({out.returncode}):\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
    return out


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """A YOLO folder (ramjet synth) and its split packed at an S3 prefix."""
    if "AWS_ENDPOINT_URL" not in os.environ:
        pytest.fail("the local S3 server is not configured: run tools/test.sh")
    src = tmp_path_factory.mktemp("yolo") / "files"
    _sh(RAMJET, "synth", src / "train", "--samples", 24)
    url = f"s3://{BUCKET}/pytest-ramjetio/{uuid.uuid4().hex[:8]}"
    _sh(RAMJET, "pack", src / "train", f"{url}/train", "--shard-size", "256KiB")
    return src, url


def _labels(d):
    return {p.stem: [[float(x) for x in line.split()] for line in p.read_text().splitlines() if line.strip()]
            for p in sorted(Path(d).glob("*.txt"))}


def test_the_streaming_page_snippet_trains_with_the_package_name_changed(packed, tmp_path):
    _, url = packed
    # The page's snippet: `ramjetio` read as `ramjet`, the bucket, a model built from its yaml
    # (no weight download offline), and the run kept small.
    snippet = textwrap.dedent(f"""
        import os
        import ramjet
        from ultralytics import YOLO
        from ramjet.datasets import UniversalDataset
        from ramjet.integrations.ultralytics import streaming_train

        ramjet.init()

        dataset = UniversalDataset(split="train", source="{url}")
        dataset.export_labels_only("{tmp_path}/ramjet_data", rank=int(os.environ.get("RANK", 0)),
                                   world_size=int(os.environ.get("WORLD_SIZE", 1)))
        model = YOLO("yolov8n.yaml")
        streaming_train(
            model,
            data="{tmp_path}/ramjet_data/data.yaml",
            source=dataset._client,
            samples=dataset.samples,
            epochs=1,
            batch=8,
            workers=2,
            val=False,
            plots=False,
            imgsz=64, device="cpu", project="{tmp_path}/runs", name="r", exist_ok=True,
        )
    """)
    env = dict(os.environ, RAMJET_CACHE_DIR=str(tmp_path / "cache"), RAMJET_SOCKET=str(tmp_path / "d.sock"),
               YOLO_CONFIG_DIR=str(tmp_path / "yolo-config"), YOLO_OFFLINE="1")
    _sh(sys.executable, "-c", snippet, env=env)
    assert (tmp_path / "runs" / "r" / "weights" / "last.pt").is_file()


def test_labels_only_writes_the_real_labels_placeholders_and_a_data_yaml(packed, tmp_path):
    src, url = packed
    ds = ramjet.datasets.UniversalDataset(split="train", source=url)
    assert len(ds) == len(ds.samples) == 24
    yaml = ds.export_labels_only(tmp_path / "out", rank=0, world_size=1)
    assert _labels(tmp_path / "out/train/labels") == _labels(src / "train/labels")
    from PIL import Image

    images = sorted((tmp_path / "out/train/images").iterdir())
    assert len(images) == 24 and Image.open(images[0]).size == (32, 32)
    text = Path(yaml).read_text()
    assert f"train: {url}/train" in text and "names:" in text
    from ramjet.integrations.ultralytics import resolve_data

    assert resolve_data(yaml)["train"] == f"{url}/train"


def test_export_local_writes_the_split_as_ultralytics_files_byte_for_byte(packed, tmp_path):
    src, url = packed
    ds = ramjet.datasets.UniversalDataset(split="train", source=url)
    ds.export_local(tmp_path / "p2")
    got = {p.name: p.read_bytes() for p in (tmp_path / "p2/train/images").iterdir()}
    want = {p.name: p.read_bytes() for p in (src / "train/images").iterdir()}
    assert got == want
    assert _labels(tmp_path / "p2/train/labels") == _labels(src / "train/labels")


def test_a_hosts_other_ranks_wait_for_its_export(packed, tmp_path, monkeypatch):
    _, url = packed
    ds = ramjet.datasets.UniversalDataset(split="train", source=url)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(ramjet.datasets, "EXPORT_WAIT_S", 0.5)
    with pytest.raises(ramjet.Error, match="data.yaml did not appear"):
        ds.export_labels_only(tmp_path / "w", rank=1, world_size=2)
    assert not (tmp_path / "w" / "train").exists()
    monkeypatch.setenv("LOCAL_RANK", "0")
    yaml = ds.export_labels_only(tmp_path / "w", rank=0, world_size=2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert ds.export_labels_only(tmp_path / "w", rank=1, world_size=2) == yaml
    with pytest.raises(ramjet.InvalidInputError, match="rank=3 of world_size=2"):
        ds.export_labels_only(tmp_path / "w", rank=3, world_size=2)


def test_samples_other_than_the_splits_are_refused_naming_filter(packed):
    _, url = packed
    from ramjet.integrations.ultralytics import _with_source

    ds = ramjet.datasets.UniversalDataset(split="train", source=url)
    assert _with_source(None, ds._client, ds.samples) == f"{url}/train"
    with pytest.raises(ramjet.InvalidInputError, match="filter="):
        _with_source(None, ds._client, ds.samples[:5])
    with pytest.raises(ramjet.InvalidInputError, match="source="):
        _with_source(None, object(), None)


def _python(code, **env):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, **env))


def test_the_pages_environment_variables_map_to_ramjets_with_a_notice():
    out = _python("import os, ramjet; print(os.environ.get('RAMJET_ORIGIN_REQUESTS'))", RAMJET_HTTP_POOL_SIZE="7")
    assert out.stdout.strip() == "7"
    assert "RAMJET_HTTP_POOL_SIZE=7 is ramjetio's: read as RAMJET_ORIGIN_REQUESTS=7" in out.stderr
    out = _python("import ramjet", RAMJET_SINGLEFLIGHT="0")
    assert "always coalesces" in out.stderr and "cannot be turned off" in out.stderr
    out = _python("import os, ramjet; print(os.environ['RAMJET_ORIGIN_REQUESTS'])", RAMJET_HTTP_POOL_SIZE="7",
                  RAMJET_ORIGIN_REQUESTS="3")
    assert out.stdout.strip() == "3" and "wins" in out.stderr


def test_an_untested_ultralytics_is_an_import_error_when_strict_else_a_warning():
    code = textwrap.dedent("""
        import ultralytics
        ultralytics.__version__ = "8.0.1"
        import ramjet.integrations.ultralytics
        print("imported")
    """)
    strict = _python(code, RAMJET_ULTRALYTICS_STRICT="1")
    assert strict.returncode != 0 and "ImportError" in strict.stderr and "not 8.0.1" in strict.stderr
    loose = _python(code, RAMJET_ULTRALYTICS_STRICT="0")
    assert loose.returncode == 0 and "imported" in loose.stdout and "tested with ultralytics 8.4.190" in loose.stderr
    tested = _python("import ramjet.integrations.ultralytics", RAMJET_ULTRALYTICS_STRICT="1")
    assert tested.returncode == 0, tested.stderr


def test_yolo_under_ddp_on_two_cpu_processes_with_workers_runs_an_epoch(packed, tmp_path):
    """torchrun, gloo, 2 ranks on CPUs, 2 loader workers each: both ranks train the epoch on
    their halves, the model wrapped with find_unused_parameters=True, and end together."""
    _, url = packed
    script = tmp_path / "ddp.py"
    script.write_text(textwrap.dedent(f"""
        import os
        from ultralytics import YOLO
        from ramjet.integrations.ultralytics import streaming_train

        model = YOLO("yolov8n.yaml")
        streaming_train(model, data="{url}/train", epochs=1, batch=8, workers=2, val=False, plots=False, imgsz=64,
                        device="cpu", project="{tmp_path}/runs", name="ddp", exist_ok=True)
        t = model.trainer
        # A file per rank: the two ranks' prints share one stdout, where print's pieces interleave.
        with open(f"{tmp_path}/result-{{os.environ['RANK']}}.txt", "w") as f:
            print(os.environ["RANK"], t.world_size, type(t.model).__name__, t.model.find_unused_parameters,
                  len(t.train_loader), file=f)
    """))
    env = dict(os.environ, RAMJET_CACHE_DIR=str(tmp_path / "cache"), RAMJET_SOCKET=str(tmp_path / "d.sock"),
               YOLO_CONFIG_DIR=str(tmp_path / "yolo-config"), YOLO_OFFLINE="1")
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    out = _sh(torchrun, "--nproc_per_node", 2, "--master_port", free_port(), script, env=env,
              cwd=tmp_path)
    results = sorted(p.read_text().split() for p in tmp_path.glob("result-*.txt"))
    # 24 samples, batch 8 across 2 ranks: 4 a rank a step, 3 steps each.
    assert results == [["0", "2", "CpuDDP", "True", "3"], ["1", "2", "CpuDDP", "True", "3"]], out.stdout[-3000:]
    assert (tmp_path / "runs" / "ddp" / "weights" / "last.pt").is_file()
