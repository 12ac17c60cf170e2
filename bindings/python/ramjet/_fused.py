"""The fused augmentation kernel on torch's CUDA tensors (internal).

Used by the GPU parity test (``bindings/tests/test_gpu.py``) and the kernel benchmark
(``benches/python/kernel_bench.py``, issue 40's step 5), which run it beside torchvision over
the same decoded images. Not a public API: the data path calls the kernel itself.
"""

import sys
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import torch

from . import _ramjet

_OUT = {torch.uint8: "uint8", torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}

# (offset, w, h, stride, flip, crop left, crop top, crop width, crop height)
Job = Tuple[int, int, int, int, int, float, float, float, float]


class FusedAugment:
    """Crop, antialiased resize, flip, normalise and cast, one kernel for a whole batch.

    ``src`` is one contiguous uint8 CUDA tensor holding every image as HWC rows at the jobs'
    byte offsets (as a batched decoder writes them); the output is ``[n, 3, oh, ow]``."""

    def __init__(self, device: Optional[torch.device] = None) -> None:
        dev = torch.device(device if device is not None else "cuda")
        self.device = torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())
        roots = [Path(p) for p in sys.path if p.endswith("site-packages")]
        self._k = _ramjet.FusedAugment(self.device.index, roots)

    def __call__(self, src: torch.Tensor, jobs: Sequence[Job], size: Tuple[int, int],
                 dtype: torch.dtype = torch.uint8, mean: Sequence[float] = (0.0, 0.0, 0.0),
                 std: Sequence[float] = (1.0, 1.0, 1.0), out: Optional[torch.Tensor] = None) -> torch.Tensor:
        if src.dtype != torch.uint8 or src.device != self.device or not src.is_contiguous():
            raise ValueError(f"src must be a contiguous uint8 tensor on {self.device}, not {src.dtype} on {src.device}")
        if dtype not in _OUT:
            raise ValueError(f"dtype must be one of {list(_OUT)}, not {dtype}")
        oh, ow = size
        if out is None:
            out = torch.empty((len(jobs), 3, oh, ow), dtype=dtype, device=self.device)
        elif out.dtype != dtype or out.device != self.device or not out.is_contiguous() \
                or tuple(out.shape) != (len(jobs), 3, oh, ow):
            raise ValueError(f"out must be a contiguous {dtype} tensor of {(len(jobs), 3, oh, ow)} on {self.device}")
        stream = torch.cuda.current_stream(self.device)
        self._k.run(src.data_ptr(), src.numel(), list(jobs), out.data_ptr(), out.numel() * out.element_size(),
                    ow, oh, _OUT[dtype], [float(m) for m in mean], [float(s) for s in std], stream.cuda_stream)
        # The kernel reads `src` on this stream: torch's allocator must not hand its block to
        # another stream before the kernel is done (the caller's own uses are ordered already).
        src.record_stream(stream)
        return out


def reference(src: bytes, jobs: List[Job], size: Tuple[int, int], dtype: torch.dtype = torch.uint8,
              mean: Sequence[float] = (0.0, 0.0, 0.0), std: Sequence[float] = (1.0, 1.0, 1.0)) -> torch.Tensor:
    """The kernel's arithmetic on the CPU: what :class:`FusedAugment` must return bit for bit."""
    oh, ow = size
    raw = _ramjet.fused_reference(src, list(jobs), ow, oh, _OUT[dtype], [float(m) for m in mean],
                                  [float(s) for s in std])
    return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(len(jobs), 3, oh, ow)
