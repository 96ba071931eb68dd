"""One encoder (or one per task, by arch), one head per declared task; predictions by task kind (the losses:
mtbert/training/losses.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mtbert.data.tasks import Task
from mtbert.model.architectures import TaskEncoders
from mtbert.model.families import family_of
from mtbert.model.frozen import starting_from
from mtbert.model.heads import CosineHead, MLPHead, RoutedHead, VectorRouting, is_cosine
from mtbert.model.pooling import pool
from mtbert.params import HeadParams


class MultitaskModel(nn.Module):
    """Outputs in loss space, by task kind: classification (B, C) logits, binary (B,) logit, regression
    (B,) score on the head's target scale.

    `arch` and `task_layers` (model.arch, model.task_layers) decide which encoders each head reads; see
    mtbert/model/architectures.py.

    A batch may carry, beside the token ids, the states of the encoder's frozen bottom (`states`, or
    `states_1` / `states_2` for a bi-encoder's sentences: mtbert/training/frozen_states.py); the encoder then
    runs only its layers above the bottom `states_depth`.
    """

    states_depth = 0  # the bottom layers whose output a batch's `states` hold (set by training/build.py)

    def __init__(self, encoder: nn.Module, tasks: dict[str, Task], heads: dict[str, HeadParams],
                 arch: str = "shared", task_layers: int = 0):
        super().__init__()
        self.tasks = tasks
        self.encoders = TaskEncoders(encoder, list(tasks), arch, task_layers)
        self.family = family_of(encoder.config)
        self.head_params = heads
        dim = encoder.config.hidden_size
        width = self.encoders.width
        self.heads = nn.ModuleDict({name: self._make_head(task, heads[name], dim, width)
                                    for name, task in tasks.items()})

    @property
    def encoder(self) -> nn.Module:
        """The shared encoder (for cerbertus and independent: the first task's)."""
        return self.encoders.shared

    def perturbation_site(self, task: str, where: str) -> tuple[nn.Module, int | None]:
        """Where SMART perturbs the task's input, in its first encoder: the word-embedding lookup (`words`)
        or the whole embeddings module, after LayerNorm (`embeddings`); and the padding token id."""
        encoder = self.encoders.for_task(task)[0]
        site = encoder.get_input_embeddings() if where == "words" else encoder.embeddings
        return site, self.family.pad_id

    def parameter_owners(self) -> dict[str, str]:
        """The task that alone uses each parameter, by name: its head, and the encoder layers of its own
        (cerbertus' top layers, independent's whole tower). Parameters that several tasks use are absent."""
        users: dict[int, set[str]] = {}
        for task, head in self.heads.items():
            for module in (*self.encoders.for_task(task), head):
                for parameter in module.parameters():
                    users.setdefault(id(parameter), set()).add(task)
        return {name: next(iter(users[id(parameter)])) for name, parameter in self.named_parameters()
                if len(users.get(id(parameter), ())) == 1}

    @staticmethod
    def _make_head(task: Task, params: HeadParams, dim: int, width: int) -> nn.Module:
        if params.pooling == "routing":  # the routed vectors, flattened, go straight to the output layer
            router = VectorRouting(width * dim, params.routing_vectors, params.routing_dim, params.routing_iters)
            routed = params.routing_vectors * params.routing_dim
            return RoutedHead(router, MultitaskModel._output_head(task, params, routed, routed, hidden_layers=0))
        return MultitaskModel._output_head(task, params, width * dim, dim, params.hidden_layers)

    @staticmethod
    def _output_head(task: Task, params: HeadParams, in_dim: int, hidden_dim: int, hidden_layers: int) -> nn.Module:
        """What follows the sentence embedding(s) of in_dim: the cosine head, or an MLP (of both sentences'
        features for a bi-encoder)."""
        out_dim = task.kind.output_size
        if params.is_bi:
            if params.combine == "cosine":
                return CosineHead(affine=task.kind.cosine_affine)
            return MLPHead(4 * in_dim, hidden_dim, out_dim, hidden_layers, params.dropout)
        return MLPHead(in_dim, hidden_dim, out_dim, hidden_layers, params.dropout)

    def embed(self, task: str, input_ids, attention_mask, pooling: str, token_type_ids=None,
              states=None) -> torch.Tensor:
        if pooling == "routing":
            return self._route(task, input_ids, attention_mask, token_type_ids, states)
        pooled = []
        for encoder in self.encoders.for_task(task):
            output = self._encode(encoder, input_ids, attention_mask, token_type_ids, states)
            pooled.append(pool(pooling, output.last_hidden_state, attention_mask,
                               getattr(output, "pooler_output", None)))
        return pooled[0] if len(pooled) == 1 else torch.cat(pooled, -1)

    def _route(self, task: str, input_ids, attention_mask, token_type_ids=None, states=None) -> torch.Tensor:
        """The token vectors of the task's encoder(s), side by side, routed by its head: (B, n_out * d_out)."""
        vectors = [self._encode(encoder, input_ids, attention_mask, token_type_ids, states).last_hidden_state
                   for encoder in self.encoders.for_task(task)]
        return self.heads[task].pool(torch.cat(vectors, -1), attention_mask)

    def _encode(self, encoder: nn.Module, input_ids, attention_mask, token_type_ids, states):
        """The encoder's output, from its embeddings, or from its frozen bottom's `states` where the batch
        brought them."""
        types = self.family.encoder_inputs(token_type_ids)  # none for a family without token types (MPNet)
        if states is None:
            if self.states_depth and encoder.embeddings.word_embeddings.weight.is_meta:
                raise ValueError("a batch without frozen states reached a model whose frozen bottom is released "
                                 "(mtbert/model/frozen.py); every split a run reads needs its states")
            return encoder(input_ids=input_ids, attention_mask=attention_mask, **types)
        if not self.states_depth or states.shape[:2] != input_ids.shape:
            raise ValueError(f"a batch brought frozen states of shape {tuple(states.shape)} to a model that reads "
                             f"the states of its bottom {self.states_depth} layers, for ids {tuple(input_ids.shape)}")
        with starting_from(encoder, self.states_depth, states):
            return encoder(input_ids=input_ids, attention_mask=attention_mask, **types)

    def forward(self, task: str, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        params = self.head_params[task]
        head = self.heads[task]
        cosine = is_cosine(head)
        if params.is_bi:
            u, v = self._embed_pair(task, batch, params.pooling)
            out = head(u, v) if cosine else head(torch.cat([u, v, (u - v).abs(), u * v], -1))
        else:
            out = head(self.embed(task, batch["input_ids"], batch["attention_mask"], params.pooling,
                                  batch.get("token_type_ids"), batch.get("states")))
        return self.tasks[task].kind.head_output(out, params, cosine)

    def _embed_pair(self, task: str, batch, pooling: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Both sentences through the encoder in one call of 2B rows, padded with the family's pad id."""
        ids_1, ids_2 = batch["input_ids_1"], batch["input_ids_2"]
        width, pad = max(ids_1.shape[1], ids_2.shape[1]), self.family.pad_id
        ids = torch.cat([F.pad(ids_1, (0, width - ids_1.shape[1]), value=pad),
                         F.pad(ids_2, (0, width - ids_2.shape[1]), value=pad)])
        mask = torch.cat([F.pad(batch["attention_mask_1"], (0, width - ids_1.shape[1])),
                          F.pad(batch["attention_mask_2"], (0, width - ids_2.shape[1]))])
        states = None
        if "states_1" in batch:  # (B, T, hidden): padded along T as the ids are
            states = torch.cat([F.pad(batch["states_1"], (0, 0, 0, width - ids_1.shape[1])),
                                F.pad(batch["states_2"], (0, 0, 0, width - ids_2.shape[1]))])
        pooled = self.embed(task, ids, mask, pooling, states=states)
        return pooled[: len(ids_1)], pooled[len(ids_1):]

    def predictions(self, task: str, outputs: torch.Tensor) -> torch.Tensor:
        """User-facing, by kind: class probabilities (B, C), P(label 1) (B,), or the score (B,)."""
        return self.tasks[task].kind.predictions(outputs, self.head_params[task])

    def divergence(self, task: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """SMART's and the Bregman teacher's l_s between two outputs in loss space, per example."""
        return self.tasks[task].kind.divergence(a, b)

    def encoding(self, task: str) -> str:
        """How the task's input is read: `bi` (each sentence alone) or `cross` (one sequence)."""
        return "bi" if self.head_params[task].is_bi else "cross"
