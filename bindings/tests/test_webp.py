"""WebP (issue 69, item 1): packed, verified and decoded like JPEG and PNG, against Pillow's own
decode of the same files (Pillow bundles the same libwebp, 1.6)."""

import io
import subprocess

import numpy as np
import pytest
import torch
from PIL import Image

import ramjet

from ramjet_cli import RAMJET, run  # noqa: E402 - bindings/tests/ramjet_cli.py


def picture(w, h, alpha=False, seed=0):
    """A picture with structure in both axes (so a misplaced crop or a flipped decode shows)."""
    y, x = np.mgrid[0:h, 0:w]
    rng = np.random.default_rng(seed)
    px = np.stack([(x * 255 // w), (y * 255 // h), ((x // 16 + y // 16) % 2) * 200 + 20], -1).astype(np.uint8)
    px = np.clip(px.astype(int) + rng.integers(-12, 12, px.shape), 0, 255).astype(np.uint8)
    if alpha:
        a = ((x + y) % 255).astype(np.uint8)[..., None]
        return Image.fromarray(np.concatenate([px, a], -1), "RGBA")
    return Image.fromarray(px, "RGB")


def webp(im, **kw):
    b = io.BytesIO()
    im.save(b, "WEBP", **kw)
    return b.getvalue()


KINDS = {
    "lossy": lambda i: webp(picture(320 + 8 * i, 240, seed=i), quality=85),
    "lossless": lambda i: webp(picture(200, 150 + 4 * i, seed=i), lossless=True),
    "alpha": lambda i: webp(picture(160, 120, alpha=True, seed=i), quality=90),
    "alpha-lossless": lambda i: webp(picture(96, 80, alpha=True, seed=i), lossless=True),
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_whole_decode_is_pillows(kind):
    for i in range(3):
        b = KINDS[kind](i)
        got = ramjet.decode_image(b)
        # Alpha dropped, not composited: Pillow's convert("RGB") does the same.
        want = np.asarray(Image.open(io.BytesIO(b)).convert("RGB"))
        assert got.shape == want.shape, kind
        assert np.array_equal(got, want), f"{kind} {i}: {np.abs(got.astype(int) - want).max()} off"


def test_a_crop_is_decoded_at_the_output_s_size():
    b = KINDS["lossy"](1)
    for spec in ({"width": 64, "height": 48}, {"width": 64, "height": 48, "dct_scaling": False},
                 {"width": 96, "height": 96, "augment": "eval", "float": True}):
        out = ramjet.decode_image(b, spec, sample=5)
        assert out.shape == (3, spec["height"], spec["width"])
        assert out.dtype == (np.float32 if spec.get("float") else np.uint8)
    # Resize of the whole image: against Pillow's bilinear resize of its own decode.
    got = ramjet.decode_image(b, {"width": 96, "height": 64, "augment": "resize"}).astype(float)
    want = np.asarray(Image.open(io.BytesIO(b)).convert("RGB").resize((96, 64), Image.BILINEAR))
    diff = np.abs(got - want.transpose(2, 0, 1))
    assert diff.mean() < 2.0, diff.mean()


def test_animated_and_damaged_webp_are_named_errors():
    frames = [picture(48, 48, seed=i) for i in range(3)]
    b = io.BytesIO()
    frames[0].save(b, "WEBP", save_all=True, append_images=frames[1:], duration=40)
    with pytest.raises(ramjet.CorruptError, match="animated WebP"):
        ramjet.decode_image(b.getvalue())
    good = KINDS["lossy"](0)
    with pytest.raises(ramjet.CorruptError, match="truncated"):
        ramjet.decode_image(good[: len(good) // 2])
    bad = bytearray(good)
    bad[40:] = bytes(x ^ 0x5A for x in bad[40:])
    with pytest.raises(ramjet.CorruptError, match="WebP"):
        ramjet.decode_image(bytes(bad))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """An image folder of WebP (every kind) and JPEG, two classes."""
    root = tmp_path_factory.mktemp("webp") / "folder"
    truth = {}
    for i in range(16):
        kind = sorted(KINDS)[i % 4] if i % 5 else None
        d = root / f"c{i % 2}"
        d.mkdir(parents=True, exist_ok=True)
        if kind is None:
            f = d / f"{i:03d}.jpg"
            picture(200, 160, seed=i).save(f, quality=90)
        else:
            f = d / f"{i:03d}.webp"
            f.write_bytes(KINDS[kind](i))
        truth[f"c{i % 2}/{f.name}"] = f.read_bytes()
    return root, truth


def test_packed_webp_reads_back_as_pillow_decodes_it(folder, tmp_path):
    root, truth = folder
    out = tmp_path / "packed"
    run("pack", str(root), str(out), "--shard-size", "64KiB")
    run("verify", str(out))
    ds = ramjet.StreamingDataset(str(out), batch_size=4, shuffle=False, augment="resize", image_size=(48, 64))
    seen = 0
    for batch in ds:
        for k, path in enumerate(batch["path"]):
            ref = Image.open(io.BytesIO(truth[path])).convert("RGB").resize((64, 48), Image.BILINEAR)
            ref = torch.from_numpy(np.array(ref)).permute(2, 0, 1).float()
            diff = (batch["image"][k].float() - ref).abs()
            assert diff.mean() < 2.5, f"{path}: mean abs difference {diff.mean():.2f} against Pillow"
            seen += 1
    assert seen == len(truth)
    # The manifest's width and height columns are the WebP's own.
    cols = ramjet.columns(str(out), ["path", "width", "height"])
    for path, w, h in zip(cols["path"], cols["width"], cols["height"]):
        assert (int(w), int(h)) == Image.open(io.BytesIO(truth[path])).size, path


def test_pack_refuses_an_animated_webp_naming_it(folder, tmp_path):
    root, _ = folder
    frames = [picture(48, 48, seed=i) for i in range(2)]
    (root / "c0" / "zz-anim.webp").write_bytes(b"")
    b = io.BytesIO()
    frames[0].save(b, "WEBP", save_all=True, append_images=frames[1:], duration=40)
    (root / "c0" / "zz-anim.webp").write_bytes(b.getvalue())
    try:
        p = subprocess.run([RAMJET, "pack", str(root), str(tmp_path / "a")], capture_output=True, text=True)
        assert p.returncode != 0
        assert "c0/zz-anim.webp" in p.stderr and "animated WebP" in p.stderr, p.stderr
        p = subprocess.run([RAMJET, "pack", str(root), str(tmp_path / "b"), "--skip-bad"], capture_output=True,
                           text=True)
        assert p.returncode == 0, p.stderr
        assert "c0/zz-anim.webp: an animated WebP" in p.stdout + p.stderr
    finally:
        (root / "c0" / "zz-anim.webp").unlink()
