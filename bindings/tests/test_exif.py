"""EXIF orientation (issue 69, item 2): every orientation 1-8 shown as Pillow's
ImageOps.exif_transpose shows it, in the whole decode, the loader's samples and pack's width and
height columns; exif_orientation=False keeps the stored pixels."""

import io

import numpy as np
import pytest
from PIL import Image, ImageOps

import ramjet

from ramjet_cli import run  # noqa: E402 - bindings/tests/ramjet_cli.py


def picture(w=120, h=80):
    """Four distinct quadrants and gradients: any wrong turn or mirror shows."""
    y, x = np.mgrid[0:h, 0:w]
    px = np.stack([x * 255 // w, y * 255 // h, np.where((x < w // 2) ^ (y < h // 3), 230, 25)], -1)
    return Image.fromarray(px.astype(np.uint8), "RGB")


def encoded(fmt, orientation, **kw):
    ex = Image.Exif()
    ex[0x0112] = orientation
    b = io.BytesIO()
    picture().save(b, fmt, exif=ex.tobytes(), **kw)
    return b.getvalue()


@pytest.mark.parametrize("orientation", range(1, 9))
@pytest.mark.parametrize("fmt,kw", [("JPEG", {"quality": 95}), ("WEBP", {"lossless": True}), ("PNG", {})])
def test_the_whole_decode_is_exif_transposes(fmt, kw, orientation):
    b = encoded(fmt, orientation, **kw)
    src = Image.open(io.BytesIO(b))
    assert src.getexif().get(0x0112) == orientation
    want = np.asarray(ImageOps.exif_transpose(src).convert("RGB")).astype(int)
    got = ramjet.decode_image(b).astype(int)
    assert got.shape == want.shape, (fmt, orientation)
    # The same decoder underneath for WebP and PNG; libjpeg-turbo builds may round differently.
    assert np.abs(got - want).max() <= (3 if fmt == "JPEG" else 0), (fmt, orientation)
    stored = ramjet.decode_image(b, exif_orientation=False).astype(int)
    assert stored.shape == np.asarray(src.convert("RGB")).shape
    # The loader's whole-image resize: the shown image, resized as Pillow resizes it.
    out = ramjet.decode_image(b, {"width": 50, "height": 30, "augment": "resize"}).astype(float)
    ref = np.asarray(ImageOps.exif_transpose(src).convert("RGB").resize((50, 30), Image.BILINEAR))
    assert np.abs(out - ref.transpose(2, 0, 1)).mean() < 2.5, (fmt, orientation)


def test_pack_records_the_shown_size_and_the_loader_shows_it(tmp_path):
    root = tmp_path / "folder" / "c0"
    root.mkdir(parents=True)
    for v in range(1, 9):
        (root / f"{v}.jpg").write_bytes(encoded("JPEG", v, quality=95))
    out = tmp_path / "packed"
    run("pack", str(tmp_path / "folder"), str(out))
    cols = ramjet.columns(str(out), ["path", "width", "height"])
    for path, w, h in zip(cols["path"], cols["width"], cols["height"]):
        v = int(path.split("/")[-1].split(".")[0])
        assert (int(w), int(h)) == ((80, 120) if v >= 5 else (120, 80)), path
    for exif in (True, False):
        ds = ramjet.StreamingDataset(str(out), batch_size=8, shuffle=False, augment="resize", image_size=(30, 50),
                                     exif_orientation=exif)
        (batch,) = list(ds)
        for k, path in enumerate(batch["path"]):
            im = Image.open(root / path.split("/")[-1])
            ref = (ImageOps.exif_transpose(im) if exif else im).convert("RGB").resize((50, 30), Image.BILINEAR)
            diff = np.abs(batch["image"][k].numpy().astype(float) - np.asarray(ref).transpose(2, 0, 1))
            assert diff.mean() < 2.5, (exif, path, diff.mean())
    # The orientation is part of the transform a state records.
    assert ds.contract()["transform"]["image"]["exif_orientation"] is False


def test_synth_writes_webp_and_turned_jpegs_shown_as_rendered(tmp_path):
    d = tmp_path / "synth"
    out = run("synth", str(d), "--samples", "40", "--webp-per-mille", "250", "--exif-per-mille", "400")
    files = sorted((d / "images").iterdir())
    webps = [f for f in files if f.suffix == ".webp"]
    turned = [f for f in files if f.suffix == ".jpg" and Image.open(f).getexif().get(0x0112, 1) != 1]
    assert webps and turned, out
    assert "webp lossy" in out and "exif " in out, out
    # Every label file still has its image; every image is shown 640x480, as rendered.
    assert sorted(f.stem for f in files) == sorted(f.stem for f in (d / "labels").iterdir())
    for f in webps + turned:
        shown = ramjet.decode_image(f.read_bytes())
        assert shown.shape == (480, 640, 3), f
        want = np.asarray(ImageOps.exif_transpose(Image.open(f)).convert("RGB")).astype(int)
        assert np.abs(shown.astype(int) - want).max() <= 3, f
    # A YOLO pack of it keeps the shown size.
    run("pack", str(d), str(tmp_path / "packed"))
    cols = ramjet.columns(str(tmp_path / "packed"), ["width", "height"])
    assert set(zip(map(int, cols["width"]), map(int, cols["height"]))) == {(640, 480)}
