"""Masked-LM further pretraining of the backbone on the tasks' own text: the loop, and the pass-through.

Read `Pretrainer.run` top to bottom: resume if a checkpoint of this very run exists, evaluate the
held-out loss at step 0, then per step one masked batch (BERT's 15% / 80-10-10 masking, no
next-sentence task), a held-out evaluation every `eval_every` steps and a checkpoint every
`runtime.checkpoint_every.pretrain` steps; at the end the encoder goes to models/pretrained/ in Hugging
Face format (with the backbone's pooler, which masked-LM does not train).

Public interface (the `pretrain` stage and the tests use these): `Pretrainer(params, paths)`,
`run(stop_after=None)`, `train_step()`, `evaluate(live)`, `checkpoint()`, `parameter_count()`, the
attributes `model`, `corpus`, `held_out`, `step`, `history`; and `pass_through(params, paths)`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import shutil
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from stages.core import io
from stages.core.data.batches import TokenColumn, eval_batches, load_split
from stages.core.data.masking import IGNORE_INDEX, MaskingVocab, mask_tokens
from stages.core.data.sampling import TaskStream
from stages.core.data.tasks import tasks_from_params, tokenized_path
from stages.core.model.backbone import PROVENANCE_FILE, load_encoder, load_masked_lm, load_tokenizer
from stages.core.params import Params, as_dict
from stages.core.runtime import limit_memory_growth
from stages.core.training.distributed import average_tensor, broadcast, setup_process, shard, shutdown, sync_parameters
from stages.core.training.optim import LayerwiseLR, layerwise_optimizer
from stages.core.training.run import Paths, ResumableRun

log = logging.getLogger("pretrain")


def pass_through(params: Params, paths: Paths) -> None:
    """The backbone, unchanged, as models/pretrained/ (pretrain.enabled is false)."""
    log.info("pretrain.enabled is false: passing the backbone %s through unchanged", params.model.name)
    encoder = load_encoder(params.model.name)
    save_encoder(encoder, load_tokenizer(params.model.name), paths.model_out,
                 {"backbone": params.model.name, "pretrained": False})
    shutil.rmtree(paths.live_dir, ignore_errors=True)
    io.write_metrics(paths.metrics_out, {"enabled": False, "backbone": params.model.name})


def save_encoder(encoder, tokenizer, out_dir: Path, provenance: dict) -> None:
    with io.atomic_dir(out_dir) as temp:
        encoder.save_pretrained(temp)
        tokenizer.save_pretrained(temp)
        (temp / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2) + "\n", encoding="utf-8")


# --- the text ---------------------------------------------------------------------------------------
def sentences(tokenized_dir: Path, params: Params, splits: list[str]) -> TokenColumn:
    """Every sentence of the given splits of every task, each alone as `[CLS] s [SEP]`."""
    columns = []
    for task in tasks_from_params(params.tasks).values():
        names = ("input_ids_1", "input_ids_2") if task.is_pair else ("input_ids",)
        for split in splits:
            data = load_split(tokenized_dir, task, split)
            columns.extend(data.tokens[name] for name in names)
    return TokenColumn.concat(columns)


def held_out_sentences(tokenized_dir: Path, params: Params) -> TokenColumn:
    """A fixed random sample of eval_examples dev sentences (all of them when 0)."""
    p = params.pretrain
    dev = sentences(tokenized_dir, params, ["dev"])
    count = len(dev.lengths()) if p.eval_examples == 0 else min(p.eval_examples, len(dev.lengths()))
    rows = np.sort(np.random.default_rng([p.seed, 31]).permutation(len(dev.lengths()))[:count])
    return dev.take(rows)


# --- training ---------------------------------------------------------------------------------------
class Pretrainer(ResumableRun):
    """The state of one masked-LM run; `run()` goes from wherever the state is to the end."""

    def __init__(self, params: Params, paths: Paths):
        self.params, self.p = params, params.pretrain
        limit_memory_growth(params.runtime.onednn_cache, params.runtime.malloc_threshold_mb)
        ranks, device = setup_process(self.p.seed, params.runtime.threads)
        super().__init__(paths, ranks, device, run_fingerprint(params, paths.tokenized, ranks.world_size), self.p.bf16)
        self.tokenizer = load_tokenizer(params.model.name)
        self.vocab = MaskingVocab.from_tokenizer(self.tokenizer)
        self.model, self.head_from_checkpoint = load_masked_lm(params.model.name)
        self.model.to(self.device).train()
        sync_parameters(self.model, self.ranks)
        if not self.head_from_checkpoint:
            log.info("%s has no masked-LM head: training a fresh one, its decoder tied to the word embeddings",
                     params.model.name)
        self.corpus = sentences(paths.tokenized, params, self.p.corpus)
        if "dev" in self.p.corpus:
            log.warning("pretrain.corpus includes dev: the held-out perplexity is measured on trained-on text")
        self.stream = TaskStream(self.corpus.lengths(), self.p.batch_size, self.p.bucket_batches, self.p.seed, 0)
        self.held_out = self.masked_held_out(held_out_sentences(paths.tokenized, params))
        self.generator = torch.Generator().manual_seed(self.p.seed)  # the training masks
        # The same layer-wise grouping as fine-tuning; the masked-LM head (outside the encoder) gets lr.
        # Its tied decoder is the word embeddings (named_parameters lists it once), so it decays with them.
        rule = LayerwiseLR(self.p.lr, self.p.weight_decay, self.p.layer_decay,
                           encoder_prefix=f"{self.model.base_model_prefix}.")
        self.optimizer, self.scheduler = layerwise_optimizer(self.model, self.model.config.num_hidden_layers, rule,
                                                             "linear", self.p.warmup_fraction, self.p.steps)
        self.step = 0
        self.running = {"loss_sum": 0.0, "batches": 0, "tokens": 0}

    def masked_held_out(self, column: TokenColumn) -> list[tuple[torch.Tensor, ...]]:
        """Held-out batches with masks drawn once, so every evaluation scores the same corruption."""
        generator = torch.Generator().manual_seed(self.p.seed + 1)
        batches = []
        for rows in eval_batches(np.minimum(column.lengths(), self.p.max_length), self.p.batch_size * 4):
            ids, mask = column.padded_to(rows, self.p.max_length)
            corrupted, labels = mask_tokens(ids, mask, self.vocab, mask_prob=self.p.mask_prob,
                                            whole_word=self.p.whole_word, generator=generator)
            batches.append((corrupted, mask, labels))
        return batches

    # --- the state beyond the skeleton's ------------------------------------------------------------
    def loop_state(self) -> dict:
        return {"stream": self.stream.state(), "step": self.step}

    def load_loop_state(self, state: dict) -> None:
        self.stream.load_state(state["stream"])
        self.step = state["step"]

    def rank_state(self) -> dict:
        return {"generator": self.generator.get_state()}  # each rank's masks

    def load_rank_state(self, state: dict) -> None:
        self.generator.set_state(state["generator"])

    # --- the loop -----------------------------------------------------------------------------------
    def run(self, stop_after: int | None = None) -> dict | None:
        """Train to pretrain.steps; `stop_after` ends early after a checkpoint (as a kill would)."""
        if self.resume():
            log.info("resuming masked-LM training at step %d", self.step)
        log.info("masked-LM on %s sentences (%s), %d steps of %d, held-out %d dev sentences",
                 f"{len(self.corpus.lengths()):,}", "+".join(self.p.corpus), self.p.steps, self.p.batch_size,
                 sum(len(b[0]) for b in self.held_out))
        live = self.open_live(log_record)
        if not self.history:
            self.evaluate(live)  # step 0: the backbone (and a fresh head) before any training
        progress = tqdm(total=self.p.steps, initial=self.step, desc="masked-LM", unit="step", mininterval=2.0,
                        disable=not self.ranks.is_main)
        self.stopwatch.start()
        while self.step < self.p.steps:
            self.train_step()
            progress.update(1)
            if self.step % self.p.eval_every == 0 or self.step == self.p.steps:
                with self.stopwatch.paused():
                    self.evaluate(live)
            if self.step % self.params.runtime.checkpoint_every.pretrain == 0 and self.step < self.p.steps:
                self.checkpoint()
                if stop_after is not None and self.step >= stop_after:
                    progress.close()
                    return None
        self.stopwatch.stop()
        progress.close()
        if live is not None:
            live.end()
        summary = self.summary()
        if self.ranks.is_main:
            self.save_encoder()
        self.finish(summary)
        shutdown(self.ranks)
        return summary if self.ranks.is_main else {}

    def train_step(self) -> None:
        rows = self.stream.next()
        ids, mask = self.corpus.padded_to(rows, self.p.max_length)
        # Every rank masks the whole global batch (the same draws) and keeps its rows, so the masks do
        # not depend on the number of processes.
        corrupted, labels = mask_tokens(ids, mask, self.vocab, mask_prob=self.p.mask_prob,
                                        whole_word=self.p.whole_word, generator=self.generator)
        mine = torch.from_numpy(shard(np.arange(len(rows)), self.ranks))
        corrupted, mask, labels = corrupted[mine], mask[mine], labels[mine]
        loss, chosen = self.loss(corrupted, mask, labels)
        self.check_finite(loss, "masked-LM loss", f"at step {self.step + 1}",
                          "Lower pretrain.lr or turn off pretrain.bf16.")
        # The mean over all ranks' chosen tokens: weight this rank's mean by its share of them.
        mean_chosen = average_tensor(torch.tensor(float(chosen), device=self.device), self.ranks)
        (loss * (chosen / mean_chosen.clamp(min=1e-9)).item() if self.ranks.distributed else loss).backward()
        self.optimizer_step(self.p.grad_clip)
        self.step += 1
        self.running["loss_sum"] += loss.item()
        self.running["batches"] += 1
        self.running["tokens"] += int(mask.sum())

    def loss(self, corrupted: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Mean cross-entropy over the chosen tokens, and their count.

        The vocabulary projection runs on the chosen positions only (~15% of tokens): over every
        position it would cost about as much as the whole 6-layer encoder.
        """
        corrupted, mask, labels = corrupted.to(self.device), mask.to(self.device), labels.to(self.device)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            hidden = self.model.base_model(input_ids=corrupted, attention_mask=mask).last_hidden_state
            chosen = labels != IGNORE_INDEX
            logits = self.mlm_head(hidden[chosen])
        count = int(chosen.sum())
        if count == 0:
            return hidden.sum() * 0.0, 0  # keeps the graph; nothing to predict in this batch
        return torch.nn.functional.cross_entropy(logits.float(), labels[chosen]), count

    @property
    def mlm_head(self) -> torch.nn.Module:
        """The module mapping hidden states to vocabulary logits (BERT: `cls`, RoBERTa: `lm_head`)."""
        heads = [module for name, module in self.model.named_children() if name != self.model.base_model_prefix]
        if len(heads) != 1:
            raise TypeError(f"{type(self.model).__name__}: expected one masked-LM head beside the encoder, "
                            f"found {[name for name, _ in self.model.named_children()]}")
        return heads[0]

    def evaluate(self, live) -> None:
        """Held-out loss on the main rank; every rank appends the same record."""
        record = self.held_out_record() if self.ranks.is_main else None
        record = broadcast(record, self.ranks)
        self.history.append(record)
        self.running = {"loss_sum": 0.0, "batches": 0, "tokens": self.running["tokens"]}
        if live is not None:
            log_record(live, record)

    def held_out_record(self) -> dict:
        self.model.eval()
        total, count = 0.0, 0
        with torch.inference_mode():
            for corrupted, mask, labels in self.held_out:
                loss, chosen = self.loss(corrupted, mask, labels)
                total, count = total + loss.item() * chosen, count + chosen
        self.model.train()
        loss = total / max(count, 1)
        record = {"step": self.step, "loss": loss, "perplexity": math.exp(loss),
                  "train_loss": self.running["loss_sum"] / self.running["batches"] if self.running["batches"]
                  else None}
        log.info("step %d: held-out masked-LM loss %.4f, perplexity %.2f%s", self.step, loss, record["perplexity"],
                 "" if record["train_loss"] is None else f", train loss {record['train_loss']:.4f}")
        return record

    # --- outputs ------------------------------------------------------------------------------------
    def save_encoder(self) -> None:
        """The trained encoder, with the backbone's pooler (which masked-LM leaves alone)."""
        encoder = load_encoder(self.params.model.name)
        missing, unexpected = encoder.load_state_dict(self.model.base_model.state_dict(), strict=False)
        if unexpected or any(not key.startswith("pooler.") for key in missing):
            raise RuntimeError(f"masked-LM encoder does not match the backbone: missing {missing}, "
                               f"unexpected {unexpected}")
        save_encoder(encoder, self.tokenizer, self.paths.model_out,
                     {"backbone": self.params.model.name, "pretrained": True,
                      "pretrain": as_dict(self.p), "head_from_checkpoint": self.head_from_checkpoint})

    def summary(self) -> dict:
        tokens = average_tensor(torch.tensor(float(self.running["tokens"]), device=self.device), self.ranks)
        self.running["tokens"] = int(tokens.item() * self.ranks.world_size)  # summed over ranks
        held_out = self.held_out
        return {"enabled": True, "backbone": self.params.model.name, "steps": self.step,
                "corpus_sentences": len(self.corpus.lengths()),
                "held_out": {"sentences": sum(len(b[0]) for b in held_out),
                             "masked_tokens": sum(int((b[2] != IGNORE_INDEX).sum()) for b in held_out)},
                "head_from_checkpoint": self.head_from_checkpoint,
                "before": {k: self.history[0][k] for k in ("loss", "perplexity")},
                "after": {k: self.history[-1][k] for k in ("loss", "perplexity")},
                "history": self.history,
                "speed": self.speed(self.step, None, self.running["tokens"])}


def log_record(live, record: dict) -> None:
    live.step = record["step"]  # the x axis is the optimiser step
    live.log_metric("held_out/loss", io.rounded(record["loss"]))
    live.log_metric("held_out/perplexity", io.rounded(record["perplexity"]))
    if record["train_loss"] is not None:
        live.log_metric("train/loss", io.rounded(record["train_loss"]))
    live.next_step()


def run_fingerprint(params: Params, tokenized_dir: Path, world_size: int = 1) -> str:
    """Identifies a run: the pretrain params, backbone and text (`runtime` changes no result)."""
    digest = hashlib.sha256(json.dumps({"pretrain": as_dict(params.pretrain), "backbone": params.model.name,
                                        "world_size": world_size}, sort_keys=True).encode())
    for task in params.tasks:
        for split in sorted(set(params.pretrain.corpus) | {"dev"}):
            digest.update(tokenized_path(tokenized_dir, task, split).read_bytes())
    return digest.hexdigest()
