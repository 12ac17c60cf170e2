"""Writes, with Hugging Face `datasets` itself (run in the peers' venv), the inputs of
test_pack_from.py that the Parquet and LitData fixtures do not hold: the JPEGs of IMAGES (some
damaged, headers intact) as a split saved both ways, `to_parquet` (damaged/) and `save_to_disk`
(damaged-saved/), and a DatasetDict saved with `save_to_disk` (dict/).

Usage: python pack_from_fixtures.py OUT IMAGES"""

import sys
from pathlib import Path


def main(out, images):
    from datasets import Dataset, DatasetDict, Image

    out, files = Path(out), sorted(Path(images).iterdir())
    ds = Dataset.from_dict({
        "image": [{"bytes": f.read_bytes(), "path": None} for f in files],
        "name": [f.name for f in files],
    }).cast_column("image", Image())
    (out / "damaged").mkdir()
    ds.to_parquet(str(out / "damaged" / "train-00000-of-00001.parquet"), batch_size=16)
    ds.save_to_disk(str(out / "damaged-saved"), max_shard_size="20KB")
    DatasetDict({"train": ds.select(range(4)), "test": ds.select(range(4, 6))}).save_to_disk(str(out / "dict"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
