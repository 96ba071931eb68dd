"""Encoder families: every way one family of encoders differs from another, in one descriptor each.

The rest of the code asks an encoder's `Family` (chosen by its config's `model_type`) and never the family's
name: how to load its attention and whether it can be switched at run time, what a task tower shares besides
the layers, which parameters sit at depth 0 for layer-wise LR decay, whether it reads token types, its pad id
and where its positions start, and what its ONNX graphs take and should fuse into. A family not listed here
stops at once with one line naming it, rather than training with a wrong assumption.

Adding a family: one `Family` in FAMILIES, a 2-layer slice of it in the tests (tests/test_families.py).
"""

from __future__ import annotations

import dataclasses

from mtbert.runtime import UserError


class FamilyError(UserError, ValueError):
    """The encoder is of a family mtbert has no descriptor for."""


@dataclasses.dataclass(frozen=True)
class Family:
    model_type: str  # config.model_type
    attention: str  # the implementation it loads with
    switchable_attention: bool  # whether `set_attn_implementation` may change it at run time
    shared_parts: tuple[str, ...]  # modules besides the embeddings and layers that every layer uses (dotted paths)
    depth_zero: tuple[str, ...]  # name parts of the parameters layer-wise LR decay puts with the embeddings
    token_types: bool  # whether the encoder reads token_type_ids (a pair's second sentence)
    pad_id: int  # its tokenizer's padding id (config.pad_token_id)
    position_offset: int  # the first position id: max_position_embeddings - offset tokens fit
    fusions: tuple[str, ...]  # the fused operators ONNX Runtime's BERT optimizer must find in its graphs

    def graph_inputs(self, encoding: str) -> tuple[str, ...]:
        """An exported graph's inputs for `single`, `cross` or `bi` (each sentence of a pair alone)."""
        if encoding == "bi":
            return ("input_ids_1", "attention_mask_1", "input_ids_2", "attention_mask_2")
        return ("input_ids", "attention_mask", *(("token_type_ids",) if self.token_types else ()))

    def max_tokens(self, config) -> int:
        """The longest input the encoder's position table holds."""
        return config.max_position_embeddings - self.position_offset

    def encoder_inputs(self, token_type_ids) -> dict:
        """The keyword arguments beyond ids and mask that a forward pass gives the encoder."""
        return {"token_type_ids": token_type_ids} if self.token_types else {}


FAMILIES = {family.model_type: family for family in (
    Family(model_type="bert", attention="sdpa", switchable_attention=True, shared_parts=(),
           depth_zero=("embeddings",), token_types=True, pad_id=0, position_offset=0,
           fusions=("SkipLayerNormalization", "BiasGelu")),
    # MPNet (all-mpnet-base-v2): no sdpa in transformers, one relative-position bias table that every layer
    # reads (so a tower must share it, and it is an input-side parameter like the embeddings), no token types,
    # pad id 1 and positions from 2, as RoBERTa.
    Family(model_type="mpnet", attention="eager", switchable_attention=False,
           shared_parts=("encoder.relative_attention_bias",), depth_zero=("embeddings", "relative_attention_bias"),
           token_types=False, pad_id=1, position_offset=2, fusions=("SkipLayerNormalization", "BiasGelu")),
)}


def family_of(config, name: str = "") -> Family:
    """The family of an encoder config; an unknown one is a FamilyError naming model.name and model_type."""
    model_type = getattr(config, "model_type", None)
    family = FAMILIES.get(model_type)
    where = f"model.name {name!r}" if name else "the encoder"
    if family is None:
        raise FamilyError(f"{where} is a {model_type!r} encoder; mtbert supports the families "
                          f"{', '.join(sorted(FAMILIES))} (mtbert/model/families.py)")
    if getattr(config, "pad_token_id", None) not in (None, family.pad_id):
        raise FamilyError(f"{where} pads with id {config.pad_token_id}, where its family {model_type} pads with "
                          f"{family.pad_id} (mtbert/model/families.py)")
    return family
