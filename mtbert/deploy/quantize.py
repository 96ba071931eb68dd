"""int8 graphs: ONNX Runtime's dynamic quantization of an exported graph.

The weights of the matrix products are stored as int8 (per tensor, or per output channel); activations
are quantized on the fly, per batch, so no calibration data is needed. Whether it pays is a property of the
CPU (integer dot-product units) and whether it costs quality is one of the model: the `export` stage
measures both on dev before making int8 the default engine (mtbert/deploy/export.py).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path


def quantize(source: Path, target: Path, *, per_channel: bool) -> None:
    """Write the int8 version of the fp32 graph `source` to `target`."""
    from onnx import TensorProto
    from onnxruntime.quantization import QuantType, quantize_dynamic

    # ONNX's shape inference gives no type to the outputs of ONNX Runtime's fused ops (Attention,
    # SkipLayerNormalization): in a graph of BERT in float32 every such tensor is float32.
    with _quiet_preprocessing_advice():
        quantize_dynamic(str(source), str(target), weight_type=QuantType.QInt8, per_channel=per_channel,
                         extra_options={"DefaultTensorType": TensorProto.FLOAT})


class _DropAdvice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "pre-processing before quantization" not in record.getMessage()


@contextlib.contextmanager
def _quiet_preprocessing_advice() -> Iterator[None]:
    """The quantizer advises (on the root logger, every time) a pre-processing pass whose symbolic shape
    inference fails on graphs of torch's exporter: the advice is noise here."""
    root = logging.getLogger()
    advice = _DropAdvice()
    root.addFilter(advice)  # a logger's filters see every record logged on it, whichever handler writes it
    try:
        yield
    finally:
        root.removeFilter(advice)
