"""int8 graphs: ONNX Runtime's dynamic quantization of an exported graph.

The weights of the matrix products are stored as int8 (per tensor, or per output channel); activations
are quantized on the fly, per batch, so no calibration data is needed. Whether it pays is a property of the
CPU (integer dot-product units) and whether it costs quality is one of the model: the `export` stage
measures both on dev before making int8 the default engine (mtbert/export/variant.py).
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import onnx


def quantize(source: Path, target: Path, *, per_channel: bool, outliers_in_fp32: bool = False) -> None:
    """Write the int8 version of the fp32 graph `source` to `target`; with `outliers_in_fp32`, the products
    that quantize badly (`outlier_prone`) stay in fp32."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    graph = onnx.load(str(source), load_external_data=False)
    excluded = vector_products(graph) + (outlier_prone(graph) if outliers_in_fp32 else [])
    # ONNX's shape inference gives no type to the outputs of ONNX Runtime's fused ops (Attention,
    # SkipLayerNormalization): in a graph of BERT in float32 every such tensor is float32.
    # Weights in 7 bits (`reduce_range`): on a CPU without VNNI (the AVX2 EPYC) ONNX Runtime multiplies uint8
    # by int8 with VPMADDUBSW, whose int16 sums of two 8-bit products saturate; a graph is served on any CPU,
    # so every graph is made safe there, not only those exported on one.
    with _quiet_quantizer():
        quantize_dynamic(str(source), str(target), weight_type=QuantType.QInt8, per_channel=per_channel,
                         reduce_range=True, nodes_to_exclude=excluded,
                         extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})


# a bi-encoder's graph holds the encoder twice, one copy per sentence: the second's nodes end in `dense_1`
DOWN_PROJECTION = re.compile(r"/output/dense(_\d+)?/MatMul$")


def outlier_prone(graph: onnx.ModelProto) -> list[str]:
    """The nodes left in fp32 where quantizing everything costs a task too much: each layer's feed-forward
    down projection, whose input (after GELU) can hold a few large values that would set the one int8 scale
    a batch's activations get, and the embedding lookups, whose error every layer carries on."""
    def down_projection(name: str) -> bool:  # BERT's attention has an output/dense of its own
        return DOWN_PROJECTION.search(name) is not None and "/attention/" not in name

    return [node.name for node in graph.graph.node
            if node.op_type == "Gather" or (node.op_type == "MatMul" and down_projection(node.name))]


def vector_products(graph: onnx.ModelProto) -> list[str]:
    """The MatMul nodes whose weight is a vector (e.g. the routing head's activation score), left in fp32:
    ONNX Runtime quantizes them, but its MatMulInteger then refuses the per-channel zero point of a 1-D
    weight at run time ("b zero point is not valid"), and a vector has nothing to gain from int8."""
    ranks = {weight.name: len(weight.dims) for weight in graph.graph.initializer}
    return [node.name for node in graph.graph.node
            if node.op_type == "MatMul" and ranks.get(node.input[1], 2) < 2]


class _DropQuantizerChatter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING and "pre-processing before quantization" not in record.getMessage()


@contextlib.contextmanager
def _quiet_quantizer() -> Iterator[None]:
    """The quantizer logs on the root logger: an INFO line per tensor it quantizes (thousands for MPNet,
    which drowned the export's own log), and, every time, advice to run a pre-processing pass whose
    symbolic shape inference fails on graphs of torch's exporter. Both are noise here; its other warnings
    are kept. The filter sees only what is logged on the root logger itself (a logger's filters are not
    consulted for what its children propagate), so the project's own loggers are untouched."""
    root = logging.getLogger()
    chatter = _DropQuantizerChatter()
    root.addFilter(chatter)
    try:
        yield
    finally:
        root.removeFilter(chatter)
