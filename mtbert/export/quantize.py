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
    with _quiet_quantizer(), _per_channel_at_once():
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


@contextlib.contextmanager
def _per_channel_at_once() -> Iterator[None]:
    """ONNX Runtime's dynamic quantization with each weight's per-channel scales computed in one array
    operation (per_channel_at_once) instead of the library's Python loop, a call per channel (3,456 in a BERT
    layer at MiniLM's width). The graph written is byte for byte the library's (tests/test_deploy.py;
    docs/inference.md)."""
    import importlib

    import onnx
    from onnxruntime.quantization import quantize_dynamic
    from onnxruntime.quantization.onnx_quantizer import ONNXQuantizer
    from onnxruntime.quantization.quant_utils import find_by_name

    library = importlib.import_module(quantize_dynamic.__module__)  # whose quantize_dynamic builds the quantizer

    class QuantizerPerChannelAtOnce(ONNXQuantizer):
        def quantize_weight_per_channel_impl(self, weight_name, weight_qType, channel_axis,  # noqa: N803
                                             reduce_range=True, keep_float_weight=False, **others):
            initializer = find_by_name(weight_name, self.model.initializer())
            if (others or initializer is None or initializer.data_type != onnx.TensorProto.FLOAT
                    or weight_qType != onnx.TensorProto.INT8 or not self.is_weight_symmetric(weight_qType)
                    or keep_float_weight or getattr(self, "min_real_range", None) is not None
                    or weight_name in self.tensor_quant_overrides):  # a case the library's code alone handles
                return super().quantize_weight_per_channel_impl(weight_name, weight_qType, channel_axis,
                                                                reduce_range, keep_float_weight, **others)
            tensors = per_channel_at_once(initializer, channel_axis, self.reduce_range and reduce_range)
            self.model.initializer_extend(tensors)  # in the library's order: scale, zero point, weight
            return tensors[2].name, tensors[1].name, tensors[0].name

    made_by = library.ONNXQuantizer
    library.ONNXQuantizer = QuantizerPerChannelAtOnce
    try:
        yield
    finally:
        library.ONNXQuantizer = made_by


def per_channel_at_once(initializer: onnx.TensorProto, channel_axis: int, reduce_range: bool) -> list:
    """The scale, zero point and int8 weight tensors of a float32 weight quantized symmetrically per channel,
    as ONNX Runtime's loop computes them (BaseQuantizer.quantize_weight_per_channel_impl and quant_utils'
    compute_scale_zp, quantize_nparray), operation for operation: each channel's range widened to hold 0,
    its float64 width over the int8 range's (7 bits with `reduce_range`), stored as a float32 scale, 1.0
    where the width is below float32's smallest normal; zero points 0; round(w / scale), clipped."""
    import numpy as np
    import onnx
    from onnxruntime.quantization import quant_utils as utils

    weights = onnx.numpy_helper.to_array(initializer)
    _, axis = utils.normalize_axis(channel_axis, weights.ndim)
    others = tuple(i for i in range(weights.ndim) if i != axis)
    qmin, qmax = utils.get_qmin_qmax_for_qType(onnx.TensorProto.INT8, reduce_range, symmetric=True)
    zero = np.zeros((), dtype=np.float32)
    rmin, rmax = np.minimum(weights.min(axis=others), zero), np.maximum(weights.max(axis=others), zero)
    absmax = np.maximum(np.abs(rmin), np.abs(rmax))
    width = absmax.astype(np.float64) - (-absmax).astype(np.float64)
    scale = width / (np.float64(qmax) - np.float64(qmin))
    scale = np.where(scale < np.finfo(np.float32).tiny, np.float32(1.0), scale.astype(np.float32))
    zero_point = np.full(scale.shape, np.round((qmin + qmax) / np.float64(2.0)), dtype=np.int8)
    shape = [1] * weights.ndim
    shape[axis] = -1
    quantized = (weights / scale.reshape(shape)).round() + zero_point.reshape(shape).astype(np.float32)
    quantized = np.clip(quantized, -128, 127).astype(np.int8)
    name, channels = initializer.name, [initializer.dims[axis]]
    return [onnx.helper.make_tensor(f"{name}_scale", onnx.TensorProto.FLOAT, channels, scale.tolist()),
            onnx.helper.make_tensor(f"{name}_zero_point", onnx.TensorProto.INT8, channels, zero_point.tolist()),
            onnx.numpy_helper.from_array(quantized, name + utils.TENSOR_NAME_QUANT_SUFFIX)]
