"""An encoder run in two parts: its frozen bottom (the embeddings and the bottom `depth` layers), once per input,
and the layers above, from the states the bottom gave (train.freeze_layers; mtbert/training/frozen_states.py).

transformers' encoders have no entry point between two layers, and their own forward builds what every layer
reads (the attention mask for the attention implementation in use, MPNet's relative-position bias), so both
parts run the encoder's own forward, with its layer list cut; the upper part has its embeddings replaced by a
stand-in that gives the saved states.

Once every row's states are computed, nothing reads the bottom's weights but a save of the whole model, so a run
releases them (`ReleasedBottom`: for all-mpnet-base-v2 with ten frozen layers, 95M of 140M weights) and reads
them back from a file for each save.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from transformers import PreTrainedModel

from mtbert import io
from mtbert.model.files import load_safetensors


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


class GivenStates(nn.Module):
    """Stands in for an encoder's embeddings: whatever the forward asks it, it gives the saved states."""

    def __init__(self, states: torch.Tensor):
        super().__init__()
        self.states = states

    def forward(self, *args, **kwargs) -> torch.Tensor:
        return self.states


@contextlib.contextmanager
def starting_from(encoder: nn.Module, depth: int, states: torch.Tensor) -> Iterator[None]:
    """Within: the encoder's forward takes `states` as what its embeddings and bottom `depth` layers gave and runs
    only the layers above; it reads none of the bottom's weights."""
    embeddings = encoder.embeddings
    encoder.embeddings = GivenStates(states)
    try:
        with only_layers(encoder, slice(depth, None)):
            yield
    finally:
        encoder.embeddings = embeddings


def device_of(module: nn.Module) -> torch.device:
    """Where the module computes: the device of its first weight that holds data (a released bottom's do not);
    `meta` for a module wholly there (tests trace a forward on it)."""
    return next((weight.device for weight in module.parameters() if not weight.is_meta), torch.device("meta"))


def bottom_weights(encoder: nn.Module, depth: int) -> Iterator[tuple[str, nn.Module, str]]:
    """Every weight of the embeddings and the bottom `depth` layers: (its key in the encoder's state_dict, the
    module that holds it, its name there)."""
    parts = [("embeddings", encoder.embeddings),
             *((f"encoder.layer.{index}", layer) for index, layer in enumerate(list(encoder.encoder.layer)[:depth]))]
    for prefix, part in parts:
        for name, module in part.named_modules(prefix=prefix):
            for weight_name, _ in module.named_parameters(recurse=False):
                yield f"{name}.{weight_name}", module, weight_name


@dataclasses.dataclass
class ReleasedBottom:
    """The frozen bottom's weights out of memory while the run reads its states instead: in each encoder module
    that holds them (the trained model's shared encoder and its moving average's), each weight is a meta
    tensor (its shape, no data), and the weights wait in a file, read back for a save of the whole model."""
    path: Path
    encoders: list[nn.Module]
    depth: int
    device: torch.device

    @classmethod
    def release(cls, models: list[nn.Module], depth: int, path: Path) -> ReleasedBottom:
        """Write the bottom's weights of the models' shared encoder (frozen, so the same in each of `models`, the
        MultitaskModel and its moving average) to `path`, then release them."""
        encoders = list({id(model.encoders.shared): model.encoders.shared for model in models}.values())
        found = list(bottom_weights(encoders[0], depth))
        trained = [key for key, module, name in found if module.get_parameter(name).requires_grad]
        if trained:
            raise ValueError(f"the bottom {depth} layers are released only when frozen; {trained[0]} is trained")
        weights = {key: module.get_parameter(name).detach() for key, module, name in found}
        with io.atomic_path(path) as temp:
            save_file({key: weight.cpu() for key, weight in weights.items()}, str(temp))
        device = device_of(encoders[0])
        for model in models:  # transformers reads an encoder's device from its first weight, the embeddings'
            for module in model.modules():
                if isinstance(module, PreTrainedModel):
                    module._kernels_device = device.type  # its place for this, made for weights offloaded to meta
        bottom = cls(path, encoders, depth, device)
        bottom.put({key: weight.to("meta") for key, weight in weights.items()})
        return bottom

    def put(self, weights: dict[str, torch.Tensor]) -> None:
        """Each encoder's bottom made of `weights` (one tensor shared by every encoder)."""
        shared = {key: nn.Parameter(weight, requires_grad=False) for key, weight in weights.items()}
        for encoder in self.encoders:
            for key, module, name in bottom_weights(encoder, self.depth):
                module.register_parameter(name, shared[key])

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        """Within: the bottom's weights back from the file, as the run started (they are frozen)."""
        weights = load_safetensors(self.path, "the run wrote it when it released them; delete its checkpoint "
                                              "folder and train again")
        self.put({key: weight.to(self.device) for key, weight in weights.items()})
        try:
            yield
        finally:
            self.put({key: weight.to("meta") for key, weight in weights.items()})
