"""The encoder(s) behind each task's head, built from one pretrained encoder according to model.arch.

- shared: one encoder for every task.
- cerbertus: the embeddings and the bottom L - k encoder layers are shared; every task has its own copy
  of the top k layers and the pooler, all starting from the same pretrained weights. k = 0 is `shared`;
  k = L shares nothing, which is `independent`.
- independent: one whole encoder per task.
- shared+independent: the shared encoder and one encoder per task; a task's head sees both pooled
  embeddings, concatenated.
- static: the shared encoder and a frozen copy of the pretrained one (always without dropout),
  concatenated.

Sharing is by module identity: a task's encoder is a full transformers model whose shared parts are the
very modules of the shared encoder, so every form runs the library's own forward pass.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from pathlib import Path

from torch import nn

from mtbert.model.backbone import save_tokenizer
from mtbert.model.dropout import EAGER_ATTENTION
from mtbert.model.families import family_of
from mtbert.model.frozen import device_of

ARCHS = ("shared", "cerbertus", "independent", "shared+independent", "static")
SHARED_DIR = "encoder"


def replicate_top(encoder: nn.Module, task_layers: int) -> nn.Module:
    """A copy of `encoder` that owns its top `task_layers` layers and pooler and shares everything else: the
    embeddings, the lower layers and what every layer reads (its family's `shared_parts`, e.g. MPNet's
    relative-position bias)."""
    tower = copy.deepcopy(encoder)
    num_layers = encoder.config.num_hidden_layers
    if task_layers < num_layers:
        tower.embeddings = encoder.embeddings
        for path in family_of(encoder.config).shared_parts:
            owner, _, name = path.rpartition(".")
            setattr(tower.get_submodule(owner), name, encoder.get_submodule(path))
    for index in range(num_layers - task_layers):
        tower.encoder.layer[index] = encoder.encoder.layer[index]
    if task_layers == 0 and getattr(encoder, "pooler", None) is not None:
        tower.pooler = encoder.pooler
    return tower


def attention_for(encoder: nn.Module) -> str:
    """The attention implementation for the encoder's mode and device: its family's own where it cannot be
    switched (MPNet: eager, always). For BERT, PyTorch's fused attention (`sdpa`)
    has no CPU kernel with dropout: a CPU encoder training with attention dropout would run sdpa's unfused
    math path, which is slower than the encoder's own eager attention. That one runs instead, with
    mtbert/model/dropout.py's cheaper masks (`mtbert-eager`) where the encoder takes a registered attention
    function. Everything else (evaluation, prediction, training on a GPU) keeps the fused kernels."""
    family = family_of(encoder.config)
    if not family.switchable_attention:
        return family.attention
    on_cpu = device_of(encoder).type == "cpu"
    dropout = getattr(encoder.config, "attention_probs_dropout_prob", 0.0) > 0  # a BERT-family config
    if not (encoder.training and on_cpu and dropout):
        return "sdpa"
    return EAGER_ATTENTION if getattr(encoder, "_supports_attention_backend", False) else "eager"


def match_attention_to_mode(encoder: nn.Module) -> None:
    """Switch the encoder to the attention implementation `attention_for` its mode and device, if it runs
    another (a switch costs about half a millisecond, so it is skipped when nothing changes)."""
    implementation = attention_for(encoder)
    if encoder.config._attn_implementation != implementation:
        encoder.set_attn_implementation(implementation)


@contextlib.contextmanager
def attention_implementation(model: nn.Module, implementation: str) -> Iterator[None]:
    """Every transformers encoder in `model` whose family can switch (mtbert/model/families.py) with this
    attention implementation inside; their own after."""
    encoders = [module for module in model.modules() if hasattr(module, "set_attn_implementation")
                and family_of(module.config).switchable_attention]
    before = [encoder.config._attn_implementation for encoder in encoders]
    for encoder in encoders:
        encoder.set_attn_implementation(implementation)
    try:
        yield
    finally:
        for encoder, previous in zip(encoders, before, strict=True):
            encoder.set_attn_implementation(previous)


class TaskEncoders(nn.Module):
    def __init__(self, encoder: nn.Module, task_names: list[str], arch: str, task_layers: int):
        super().__init__()
        if arch not in ARCHS:
            raise ValueError(f"model.arch: expected one of {', '.join(ARCHS)}, got {arch!r}")
        num_layers = encoder.config.num_hidden_layers
        if arch == "cerbertus" and not 0 <= task_layers <= num_layers:
            raise ValueError(f"model.task_layers: expected 0 to {num_layers} (the encoder's layers) for "
                             f"arch cerbertus, got {task_layers}")
        self.arch, self.task_layers, self.task_names = arch, task_layers, list(task_names)
        self.shared = encoder
        self.towers = nn.ModuleDict()
        self.static = None
        if arch in ("cerbertus", "independent"):
            k = task_layers if arch == "cerbertus" else num_layers
            # The first task uses the shared encoder itself, so no layer goes unused.
            for task in self.task_names:
                self.towers[task] = encoder if task == self.task_names[0] else replicate_top(encoder, k)
        elif arch == "shared+independent":
            for task in self.task_names:
                self.towers[task] = copy.deepcopy(encoder)
        elif arch == "static":
            self.static = copy.deepcopy(encoder).requires_grad_(False).eval()

    def for_task(self, task: str) -> list[nn.Module]:
        """The encoders whose pooled outputs, concatenated, feed the task's head; the first is perturbed
        by SMART."""
        if self.arch in ("cerbertus", "independent"):
            return [self.towers[task]]
        if self.arch == "shared+independent":
            return [self.shared, self.towers[task]]
        if self.arch == "static":
            return [self.shared, self.static]
        return [self.shared]

    @property
    def shared_depth(self) -> int:
        """How many bottom layers (with the embeddings) are one module in every task's one encoder: all for
        `shared`, all but the task layers for `cerbertus`; none where a task owns a whole encoder or its head
        reads two."""
        layers = self.shared.config.num_hidden_layers
        return {"shared": layers, "cerbertus": layers - self.task_layers}.get(self.arch, 0)

    @property
    def width(self) -> int:
        """How many encoders' pooled outputs each head sees."""
        return len(self.for_task(self.task_names[0]))

    def train(self, mode: bool = True):
        super().train(mode)
        if self.static is not None:
            self.static.eval()  # frozen: no dropout either
        for encoder in self.distinct_encoders():
            match_attention_to_mode(encoder)
        return self

    def distinct_encoders(self) -> list[nn.Module]:
        """Every encoder once (cerbertus and independent: the first task's tower is the shared encoder)."""
        encoders = [self.shared, *self.towers.values(), *([self.static] if self.static is not None else [])]
        return list({id(encoder): encoder for encoder in encoders}.values())

    # --- files ---------------------------------------------------------------------------------------
    def extra_encoders(self) -> dict[str, nn.Module]:
        """The encoders saved beside `encoder/` (the shared one), by folder name."""
        extra = {f"encoder-{task}": tower for task, tower in self.towers.items() if tower is not self.shared}
        if self.static is not None:
            extra["encoder-static"] = self.static
        return extra

    def save(self, directory: Path, tokenizer) -> None:
        """save_pretrained folders: `encoder/` (with the tokenizer) and one per other encoder; shared
        modules are written in each folder that uses them, so every folder loads on its own."""
        self.shared.save_pretrained(directory / SHARED_DIR, safe_serialization=True)
        save_tokenizer(tokenizer, directory / SHARED_DIR)
        for name, encoder in self.extra_encoders().items():
            encoder.save_pretrained(directory / name, safe_serialization=True)

    def load_extra(self, directory: Path, remedy: str) -> None:
        """Weights of the other encoders from their folders (the structure comes from the constructor); a
        folder cut short or damaged is one line naming the file, ending with `remedy`."""
        from mtbert.model.files import load_local_encoder

        for name, encoder in self.extra_encoders().items():
            saved = load_local_encoder(directory / name, remedy)
            encoder.load_state_dict(saved.state_dict())
