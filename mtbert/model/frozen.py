"""An encoder run in two parts: its frozen bottom (the embeddings and the bottom `depth` layers), once per input,
and the layers above, from the states the bottom gave (train.freeze_layers; mtbert/training/frozen_states.py).

transformers' encoders have no entry point between two layers, and their own forward builds what every layer
reads (the attention mask for the attention implementation in use, MPNet's relative-position bias), so both
parts run the encoder's own forward, with its layer list cut; the upper part has the embeddings' output
replaced by the saved states.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


@contextlib.contextmanager
def only_layers(encoder: nn.Module, layers: slice) -> Iterator[None]:
    """Within: the encoder's forward runs only `layers` of its layer list; the whole list after."""
    whole = encoder.encoder.layer
    encoder.encoder.layer = nn.ModuleList(list(whole)[layers])
    try:
        yield
    finally:
        encoder.encoder.layer = whole


def bottom_states(encoder: nn.Module, depth: int, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  **types) -> torch.Tensor:
    """The output of the embeddings and the bottom `depth` layers: (B, T, hidden)."""
    with only_layers(encoder, slice(0, depth)):
        return encoder(input_ids=input_ids, attention_mask=attention_mask, **types).last_hidden_state


@contextlib.contextmanager
def starting_from(encoder: nn.Module, depth: int, states: torch.Tensor) -> Iterator[None]:
    """Within: the encoder's forward takes `states` as what its bottom `depth` layers gave and runs only the
    layers above (the embeddings still look up their ids, a cost of nothing beside a layer, and are discarded)."""
    handle = encoder.embeddings.register_forward_hook(lambda module, args, output: states)
    try:
        with only_layers(encoder, slice(depth, None)):
            yield
    finally:
        handle.remove()
