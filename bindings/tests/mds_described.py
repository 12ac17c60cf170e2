"""How a test tells one decoded MosaicML value from another (imported by the peers' venv's
fixture writer and by the tests, so both describe alike)."""

import hashlib

import numpy as np
from PIL import Image


def described(v):
    """A decoded value as JSON: an image as mode, size and a hash of its pixels; NumPy values as
    dtype and value; anything else as its type and value."""
    if isinstance(v, Image.Image):
        return {"mode": v.mode, "size": list(v.size), "sha": hashlib.sha256(v.tobytes()).hexdigest()}
    if isinstance(v, np.ndarray):
        return {"dtype": str(v.dtype), "shape": list(v.shape), "list": v.tolist()}
    if isinstance(v, np.generic):
        return {"dtype": str(v.dtype), "value": v.item()}
    return {"type": type(v).__name__, "value": v}
