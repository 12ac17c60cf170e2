"""Pack hygiene (issue 69, item 3): --check-decode finds at pack time every image the loader
would fail on, aborting naming it or, with --skip-bad, skipping and listing it."""

import shutil
import subprocess

import pytest

import ramjet

from ramjet_cli import RAMJET, run  # noqa: E402 - bindings/tests/ramjet_cli.py


@pytest.fixture(scope="module")
def damaged(tmp_path_factory):
    """An image folder of 60 ImageNet-like JPEGs, 200 per thousand damaged (entropy data
    overwritten, headers intact), and the names of those whose whole decode fails."""
    d = tmp_path_factory.mktemp("dmg")
    run("synth", str(d / "synth"), "--samples", "60", "--profile", "imagenet", "--damaged-per-mille", "200")
    root = d / "folder" / "c0"
    root.mkdir(parents=True)
    failing = set()
    for f in sorted((d / "synth" / "images").iterdir()):
        shutil.copy(f, root / f.name)
        try:
            ramjet.decode_image(f.read_bytes())
        except ramjet.CorruptError:
            failing.add(f"c0/{f.name}")
    assert failing, "the synth set has no image that fails to decode"
    return d / "folder", failing


def test_a_plain_pack_passes_damage_that_check_decode_refuses(damaged, tmp_path):
    folder, failing = damaged
    run("pack", str(folder), str(tmp_path / "plain"))
    run("verify", str(tmp_path / "plain"))
    p = subprocess.run([RAMJET, "pack", str(folder), str(tmp_path / "checked"), "--check-decode"],
                       capture_output=True, text=True)
    assert p.returncode != 0
    assert "does not decode" in p.stderr and any(f in p.stderr for f in failing), p.stderr


def test_check_decode_with_skip_bad_lists_each_and_the_loader_never_fails(damaged, tmp_path):
    folder, failing = damaged
    out = run("pack", str(folder), str(tmp_path / "p"), "--check-decode", "--skip-bad")
    listed = {line.split(":")[0].strip() for line in out.splitlines() if "does not decode" in line}
    assert listed == failing, out
    ds = ramjet.StreamingDataset(str(tmp_path / "p"), batch_size=8, image_size=32, on_corrupt="error")
    assert len(ds) == -(-(60 - len(failing)) // 8)
    for epoch in range(2):
        ds.set_epoch(epoch)
        assert sum(len(b["label"]) for b in ds) == 60 - len(failing)
    # Without the check, the same data makes the loader stop at a damaged sample.
    run("pack", str(folder), str(tmp_path / "plain"))
    plain = ramjet.StreamingDataset(str(tmp_path / "plain"), batch_size=8, image_size=32, augment="resize",
                                    on_corrupt="error")
    with pytest.raises(ramjet.CorruptError):
        for _ in plain:
            pass


def test_a_jsonl_image_column_gains_the_shown_width_and_height(tmp_path):
    import io
    import json

    from PIL import Image

    sizes = [(64, 48), (30, 90), (77, 41)]
    rows = []
    for i, (w, h) in enumerate(sizes):
        im = Image.new("RGB", (w, h), (i * 80, 30, 200))
        ex = Image.Exif()
        ex[0x0112] = 6 if i == 1 else 1
        b = io.BytesIO()
        im.save(b, "JPEG" if i != 2 else "WEBP", exif=ex.tobytes())
        name = f"img{i}.{'jpg' if i != 2 else 'webp'}"
        (tmp_path / name).write_bytes(b.getvalue())
        rows.append({"image": name, "caption": f"c{i}", "label": i})
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run("pack", str(tmp_path / "rows.jsonl"), str(tmp_path / "p"), "--image-column", "image")
    cols = ramjet.columns(str(tmp_path / "p"), ["label", "width", "height"])
    got = {int(k): (int(w), int(h)) for k, w, h in zip(cols["label"], cols["width"], cols["height"])}
    # Shown sizes: the EXIF-6 image's sides swapped.
    assert got == {0: (64, 48), 1: (90, 30), 2: (77, 41)}, got
    # A JSONL that has its own width and height keeps them.
    own = [dict(r, width=1, height=2) for r in rows]
    (tmp_path / "own.jsonl").write_text("".join(json.dumps(r) + "\n" for r in own))
    run("pack", str(tmp_path / "own.jsonl"), str(tmp_path / "q"), "--image-column", "image")
    cols = ramjet.columns(str(tmp_path / "q"), ["width", "height"])
    assert set(zip(map(int, cols["width"]), map(int, cols["height"]))) == {(1, 2)}
