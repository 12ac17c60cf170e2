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
