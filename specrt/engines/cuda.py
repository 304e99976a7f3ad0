"""The CUDA driver through ctypes (no toolkit, no cuda-python): whether there is a GPU here.

Used by engines/ort.py (can onnxruntime run on CUDA?) and api/memory.py (the GPU's free memory).
"""
from __future__ import annotations

import ctypes


def libcuda():
    """The CUDA driver library (libcuda.so.1), initialised; None without a driver or a usable device."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    return lib if lib.cuInit(0) == 0 else None


def cuda_device_count() -> int:
    """CUDA devices the driver shows this process (0 without a driver)."""
    lib = libcuda()
    n = ctypes.c_int(0)
    return n.value if lib is not None and lib.cuDeviceGetCount(ctypes.byref(n)) == 0 else 0
