"""specrt: lossless speculative decoding on onnxruntime, for edge and offline hardware.

    import specrt
    pair = specrt.load("PAIR_DIR")
    res = pair.generate("def quicksort(xs):", max_new_tokens=64)
"""
from specrt.api.pair import Pair, Result, load
from specrt.errors import ConfigError, ExportError, FetchError, PairError, SpecrtError

__all__ = ["load", "Pair", "Result", "SpecrtError", "PairError", "ConfigError", "ExportError", "FetchError"]
__version__ = "0.1.0"
