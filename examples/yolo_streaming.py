"""Train Ultralytics YOLO on a dataset streamed from S3 through ramjet: train and val, offline.

    pip install './bindings[ultralytics]'
    tools/s3-server.sh start && source tools/env.sh     # the local S3 server (or your own S3)
    python examples/yolo_streaming.py                   # packs a small synthetic set, then trains

With ``--data s3://bucket/prefix`` it trains on your own packed YOLO dataset instead (a prefix
holding ``train/`` and ``val/``, each packed with ``ramjet pack <yolo folder> s3://...``).
Nothing of the dataset is written to local disk except ramjet's node cache.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def synthetic_dataset(train: int, val: int) -> str:
    """Packs a small synthetic YOLO set (photo-like 640x480 JPEGs, 8 classes) into the S3
    server of ``AWS_ENDPOINT_URL``; the local copy is deleted afterwards."""
    ramjet_bin = os.environ.get("RAMJET_BIN") or shutil.which("ramjet") or str(ROOT / "target/release/ramjet")
    if not Path(ramjet_bin).exists():
        sys.exit(f"the ramjet CLI is needed to pack the example data: build it (cargo build --release) or set RAMJET_BIN")
    bucket = os.environ.get("RAMJET_S3_BUCKET", "ramjet")
    url = f"s3://{bucket}/examples/yolo-{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory() as d:
        for split, n, seed in (("train", train, 0), ("val", val, 1)):
            subprocess.run([ramjet_bin, "synth", f"{d}/{split}", "--samples", str(n), "--seed", str(seed)], check=True,
                           stdout=subprocess.DEVNULL)
            subprocess.run([ramjet_bin, "pack", f"{d}/{split}", f"{url}/{split}"], check=True)
    return url


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", help="a ramjet dataset URL (default: pack a synthetic set into the local S3)")
    p.add_argument("--model", default="yolov8n.yaml", help="model yaml (built from scratch) or checkpoint")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--imgsz", type=int, default=160)
    p.add_argument("--device", default=None, help="cpu or a GPU index (default: GPU 0 when there is one)")
    a = p.parse_args()
    if "AWS_ENDPOINT_URL" not in os.environ and not a.data:
        sys.exit("no S3 endpoint: run `source tools/env.sh` (and tools/s3-server.sh start), or pass --data")

    from ramjet.integrations.ultralytics import StepTimer, offline_environment, streaming_train

    offline_environment()  # no weight, font or hub downloads; a private YOLO config dir
    import torch
    from ultralytics import YOLO

    device = a.device or ("0" if torch.cuda.is_available() else "cpu")
    url = a.data or synthetic_dataset(train=160, val=32)
    model = YOLO(a.model)
    timer = StepTimer().attach(model)
    streaming_train(model, data=url, epochs=a.epochs, batch=a.batch, workers=a.workers, imgsz=a.imgsz,
                    device=device, plots=False, project=tempfile.mkdtemp(prefix="ramjet-yolo-"), name="run")
    t = model.trainer
    print(f"\ntrained {a.epochs} epochs on {url}")
    print(f"time to first step: {timer.first_step_s:.1f} s")
    for e in timer.epochs:
        print(f"epoch {e['epoch'] + 1}: {e['wall_s']:.1f} s, {e['steps']} steps, data wait {e['wait_s']:.2f} s")
    print(f"validation (streamed val split): {t.metrics}")
    print(f"weights: {t.last}")


if __name__ == "__main__":
    main()
