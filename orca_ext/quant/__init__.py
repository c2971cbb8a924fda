"""Quantized weights served as their ggml blocks: the formats (formats.py), the weight objects
(weight.py) and their products (kernels.py, dispatched to by orca_ext.ops)."""
from .formats import FORMATS, BlockFormat, QType, block_format, dequantize
from .weight import Quantized, QuantizedStack, QuantizedWeight, stack_rows

__all__ = ["FORMATS", "BlockFormat", "QType", "block_format", "dequantize",
           "Quantized", "QuantizedStack", "QuantizedWeight", "stack_rows"]
