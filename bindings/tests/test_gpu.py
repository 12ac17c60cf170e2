"""The GPU path's parts that run without a GPU: driver detection and its error, and where
the CUDA user libraries are found (ramjet.gpu_info). On a machine with a driver the same
tests check the other branch."""
import ctypes
import os
from pathlib import Path

import pytest

import ramjet
from ramjet import _ramjet


def driver_loads() -> bool:
    """An independent look for libcuda, the way ctypes would open it."""
    for name in ("libcuda.so.1", "libcuda.so"):
        try:
            ctypes.CDLL(name)
            return True
        except OSError:
            pass
    return False


def test_driver_detection_and_the_no_driver_error():
    info = ramjet.gpu_info()
    assert info["driver"] == driver_loads()
    if info["driver"]:
        # A GPU, or an error that says why none can be used.
        assert info["devices"] > 0 or "no GPU" in info["error"] or "CUDA driver error" in info["error"]
    else:
        assert info["devices"] == 0
        assert "no CUDA driver" in info["error"] and "libcuda" in info["error"]
    assert set(info["libraries"]) == {"nvjpeg", "nvrtc", "cufile"}


def fake_lib(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"not a library, only its name and place")
    return path


@pytest.fixture
def no_lib_vars(monkeypatch):
    for var in ("RAMJET_NVJPEG", "RAMJET_NVRTC", "RAMJET_CUFILE"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_wheels_in_the_python_environment_are_found_cuda_13_first(tmp_path, no_lib_vars):
    site = tmp_path / "site-packages"
    # The file lists of nvidia-nvjpeg-cu12 12.4 and nvidia-nvjpeg 13.3, nvidia-cufile 1.20.
    fake_lib(site / "nvidia/nvjpeg/lib/libnvjpeg.so.12")
    want = fake_lib(site / "nvidia/cu13/lib/libnvjpeg.so.13")
    cufile = fake_lib(site / "nvidia/cu13/lib/libcufile.so.0")
    libs = _ramjet.gpu_info([str(site)])["libraries"]
    # nvJPEG is also loaded, for its version: these files are empty, so that fails by name.
    load_error = libs["nvjpeg"].pop("load_error")
    assert str(want.resolve()) in load_error, load_error
    assert libs["nvjpeg"] == {"path": str(want.resolve()), "origin": "python"}
    assert libs["cufile"] == {"path": str(cufile.resolve()), "origin": "python"}


def test_the_variable_wins_and_a_wrong_one_is_an_error(tmp_path, no_lib_vars):
    site = tmp_path / "site-packages"
    fake_lib(site / "nvidia/cu13/lib/libnvrtc.so.13")
    mine = fake_lib(tmp_path / "mine/libnvrtc.so.12")
    no_lib_vars.setenv("RAMJET_NVRTC", str(mine.parent))
    assert _ramjet.gpu_info([str(site)])["libraries"]["nvrtc"] == {"path": str(mine.resolve()), "origin": "env"}
    gone = tmp_path / "gone/libnvrtc.so.13"
    no_lib_vars.setenv("RAMJET_NVRTC", str(gone))
    err = _ramjet.gpu_info([str(site)])["libraries"]["nvrtc"]["error"]
    assert "RAMJET_NVRTC" in err and str(gone) in err


def test_a_missing_library_says_where_it_looked_and_how_to_install(tmp_path, no_lib_vars):
    no_lib_vars.setenv("LD_LIBRARY_PATH", str(tmp_path / "ld"))
    no_lib_vars.delenv("CUDA_HOME", raising=False)
    no_lib_vars.delenv("VIRTUAL_ENV", raising=False)
    got = _ramjet.gpu_info([str(tmp_path / "site")])["libraries"]["nvjpeg"]
    if "path" in got:  # a system copy exists on this machine: then it came from the system
        assert got["origin"] == "system" and os.path.isfile(got["path"])
    else:
        err = got["error"]
        for needle in ("libnvjpeg.so.13", "RAMJET_NVJPEG", str(tmp_path / "site"), str(tmp_path / "ld"),
                       "ramjet[cuda]"):
            assert needle in err, (needle, err)


def test_pageable_columns_are_copied_before_the_pinned_image():
    """Issue 40, item 3: a non_blocking copy from pageable memory is staged and waits on the host;
    queued after the pinned image's copy it would wait for that copy too. The batch's small
    pageable columns are copied first, the pinned ones after, each group in batch order."""
    from ramjet import _copy_order

    class T:
        def __init__(self, pinned):
            self.pinned = pinned

        def is_pinned(self):
            return self.pinned

        def to(self, *a, **k):
            return self

    batch = {"image": T(True), "_index": T(False), "label": T(False), "meta": "not a tensor", "mask": T(True)}
    assert _copy_order(batch) == ["_index", "label", "image", "mask"]


# ----- on a GPU (RAMJET_GPU_TESTS=1: the device check, tools/device-check/run.py) -------------
# Datasets are packed into local folders by the ramjet CLI (RAMJET_BIN: the bundle's), so these
# need no S3 server.

import subprocess  # noqa: E402

import torch  # noqa: E402

ON_GPU = pytest.mark.skipif(os.environ.get("RAMJET_GPU_TESTS") != "1", reason="needs a GPU: RAMJET_GPU_TESTS=1")
RAMJET = os.environ.get("RAMJET_BIN") or str(Path(__file__).resolve().parents[2] / "target/debug/ramjet")


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpu")
    for argv in ([RAMJET, "synth", str(d / "synth"), "--samples", "96"], [RAMJET, "pack", str(d / "synth"), str(d / "ds")]):
        out = subprocess.run(argv, capture_output=True, text=True)
        assert out.returncode == 0, out.stdout + out.stderr
    return str(d / "ds")


def _ds(url, **kw):
    kw.setdefault("batch_size", 8)
    kw.setdefault("image_size", 64)
    kw.setdefault("shuffle", False)
    kw.setdefault("seed", 3)
    return ramjet.StreamingDataset(url, **kw)


@ON_GPU
@pytest.mark.parametrize("normalize", [False, True])
def test_device_cuda_batches_are_the_cpu_path_s(packed, normalize):
    """The same augmentation (train: random crops and flips from the seed) on both paths: uint8
    equal bit for bit, normalised float32 equal too (the GPU path only copies); every column
    (labels, indices) on the GPU and equal. The device check runs this file, from a local
    dataset: the GPU machine has no S3 server."""
    cpu = list(_ds(packed, normalize=normalize))
    gpu = list(_ds(packed, normalize=normalize, device="cuda"))
    assert len(cpu) == len(gpu) == 12
    for a, b in zip(cpu, gpu):
        assert b["image"].device.type == "cuda" and b["image"].dtype == a["image"].dtype
        assert torch.equal(a["image"], b["image"].cpu())
        for k in a:
            if isinstance(a[k], torch.Tensor):
                assert b[k].device.type == "cuda", k
                assert torch.equal(a[k], b[k].cpu()), k


@ON_GPU
def test_batches_come_from_pinned_memory_shared_not_copied(packed):
    ds = _ds(packed, device="cuda")
    next(iter(ds))  # starts the loader with its pinned pool
    cols, _meta = ds._loader.next_batch()
    img = cols["image"]
    t = torch.from_dlpack(img)
    assert t.is_pinned(), "the loader's image buffer is not page-locked"
    assert t.data_ptr() == img.data_ptr, "DLPack copied the batch instead of sharing it"


@ON_GPU
def test_the_trainer_s_device_and_stream_are_unchanged(packed):
    torch.cuda.set_device(0)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        before = (torch.cuda.current_device(), torch.cuda.current_stream().cuda_stream)
        for _ in _ds(packed, device="cuda:0"):
            assert (torch.cuda.current_device(), torch.cuda.current_stream().cuda_stream) == before
        assert (torch.cuda.current_device(), torch.cuda.current_stream().cuda_stream) == before


@ON_GPU
def test_a_slow_consumer_never_sees_a_buffer_reused_early(packed):
    """Three epochs with every GPU batch held, the consumer's stream kept busy (so it lags the
    copies by far), and nothing read until the end: each batch still holds its own samples."""
    want = [b["image"].clone() for b in _ds(packed)] * 3
    ds = _ds(packed, device="cuda", prefetch_batches=2)
    held = []
    for epoch in range(3):
        ds.set_epoch(0)
        for b in ds:
            torch.cuda._sleep(2_000_000)  # ~1 ms of GPU time per step on the consumer's stream
            held.append(b["image"])
    torch.cuda.synchronize()
    assert len(held) == len(want)
    for i, (g, w) in enumerate(zip(held, want)):
        assert torch.equal(g.cpu(), w), f"batch {i} changed after it was yielded"


@ON_GPU
def test_no_pinned_allocation_or_free_in_steady_state(packed):
    ds = _ds(packed, device="cuda")
    for _ in range(3):
        ds.set_epoch(0)
        for b in ds:
            b["image"].float().mean()
    m = ds.metrics()
    assert m["host_buffer_late_allocs"] == 0 and m["host_buffer_late_frees"] == 0, m


def _random_images(sizes, seed=5):
    g = torch.Generator().manual_seed(seed)
    jobs, chunks, off = [], [], 0
    for i, (w, h) in enumerate(sizes):
        img = torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, generator=g)
        cw, ch = max(1.0, w * 0.61), max(1.0, h * 0.73)
        cx, cy = (w - cw) * 0.37, (h - ch) * (0.0 if i % 3 == 0 else 0.9)
        jobs.append((off, w, h, 3 * w, i % 2, cx, cy, cw, ch))
        chunks.append(img.flatten())
        off += img.numel()
    return torch.cat(chunks), jobs


@ON_GPU
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float16, torch.bfloat16, torch.float32])
def test_the_fused_kernel_on_torch_tensors_is_its_reference_bit_for_bit(dtype):
    from ramjet._fused import FusedAugment, reference

    src, jobs = _random_images([(500, 375), (375, 500), (64, 48), (1200, 900), (224, 224), (31, 17)])
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    want = reference(src.numpy().tobytes(), jobs, (96, 112), dtype, mean, std)
    aug = FusedAugment("cuda:0")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # on torch's stream of the moment, not the default one
        got = aug(src.cuda(), jobs, (96, 112), dtype, mean, std)
    side.synchronize()
    assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))
    with pytest.raises(ramjet.InvalidInputError, match="image 1"):
        bad = list(jobs)
        bad[1] = (src.numel(), *bad[1][1:])  # past the source's end
        aug(src.cuda(), bad, (96, 112), dtype, mean, std)


@ON_GPU
@pytest.mark.parametrize("decode", ["gpu", "auto", "cpu"])
def test_gpu_decode_batches_are_the_cpu_path_s_within_the_decoders_tolerance(packed, decode):
    """decode= on a GPU: the image column is a CUDA tensor in ramjet's own device memory
    (DLPack shared it, no copy), every other column as on the CPU path, and each image the CPU
    path's within a decoder's tolerance. With decode="cpu" only the fused kernel differs (mean
    difference at most 0.35 of a step, no pixel more than 2 off:
    ramjet_cuda::kernel::TOLERANCE_U8*); nvJPEG's IDCT, DCT scaling and chroma upsampling are
    not libjpeg-turbo's, so "gpu" and "auto" are held to a mean of 4 a pixel per image (as
    tests/tests/nvjpeg_gpu.rs's DECODE_MEAN_MAX), and no pixel off by more than 64."""
    cpu = list(_ds(packed))
    ds = _ds(packed, device="cuda", decode=decode)
    gpu = list(ds)
    assert len(cpu) == len(gpu) == 12
    for a, b in zip(cpu, gpu):
        img = b["image"]
        assert img.device.type == "cuda" and img.dtype == torch.uint8 and img.shape == a["image"].shape
        d = (img.cpu().int() - a["image"].int()).abs()
        mean_max, max_max = (0.35, 2) if decode == "cpu" else (4.0, 64)
        assert d.float().mean().item() <= mean_max and d.max().item() <= max_max, (decode, d.float().mean().item(), d.max().item())
        assert torch.equal(a["_index"], b["_index"].cpu())
    m = ds.metrics()
    assert sum(m[f"decode_{p}"] for p in ("hardware", "hybrid", "cpu")) == 96, m
    assert m["images_decoded"] == 96, m
    if decode == "cpu":
        assert m["decode_cpu"] == 96, m


@ON_GPU
def test_gpu_decode_tensors_are_ramjet_s_buffer_and_memory_stays_flat(packed):
    """torch.from_dlpack of a GPU-decoded batch gives a CUDA tensor whose data pointer is the
    ramjet tensor's; ten epochs keep torch's and the driver's device memory flat."""
    ds = _ds(packed, device="cuda", decode="gpu")
    next(iter(ds))
    cols, _meta = ds._session.next_batch()
    img = cols["image"]
    assert img.__dlpack_device__() == (2, 0)
    t = torch.from_dlpack(img)
    assert t.is_cuda and t.data_ptr() == img.data_ptr, "DLPack copied the GPU batch instead of sharing it"
    del t, img, cols
    used = []
    for epoch in range(10):
        ds.set_epoch(epoch)
        for b in ds:
            pass
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        used.append(total - free)
    assert max(used[2:]) - min(used[2:]) <= 64 << 20, [u >> 20 for u in used]


def test_decode_needs_a_cuda_device_and_a_known_decoder(packed):
    """Without a GPU: decode= with device="cpu" is refused by name; an unknown decoder is
    refused by the engine, naming the option and the choices."""
    with pytest.raises(ramjet.InvalidInputError, match='decode=.gpu. decodes on a GPU'):
        _ds(packed, decode="gpu")
    with pytest.raises(ramjet.InvalidInputError, match="decode"):
        _ds(packed, decode="nvdec", device="auto")
