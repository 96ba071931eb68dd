"""Stage `pretrain`: optional masked-LM further pretraining of the backbone on the tasks' own text.

Enabled (`pretrain.enabled`), it trains the backbone with a masked-LM head on every sentence of the
`pretrain.corpus` splits (each sentence of a pair alone; BERT's 15% / 80-10-10 masking, no
next-sentence task), measures the masked-LM loss and perplexity on held-out dev sentences with fixed
masks every `eval_every` steps, and writes the trained encoder to models/pretrained/ in Hugging Face
format (with the backbone's pooler, which masked-LM does not train). Disabled, it writes the backbone
itself there, unchanged. `train` always starts from models/pretrained/.

Resume: every `checkpoint_every` steps the full state (model, optimiser, scheduler, RNG, masking
generator, data position, history) goes atomically to checkpoints/pretrain/; a killed run started
again continues from it and ends as an uninterrupted run would.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import typer
from tqdm.auto import tqdm

from stages.core import io
from stages.core.data.batches import TokenColumn, eval_batches, load_split
from stages.core.data.masking import IGNORE_INDEX, MaskingVocab, mask_tokens
from stages.core.data.sampling import TaskStream
from stages.core.data.tasks import TASKS, tokenized_path
from stages.core.model.backbone import PROVENANCE_FILE, load_encoder, load_masked_lm, load_tokenizer
from stages.core.params import Params, PretrainParams, as_dict, load_params
from stages.core.runtime import open_live, setup_logging
from stages.core.training.distributed import (
    average_gradients,
    average_tensor,
    broadcast,
    gather,
    relaunch_with_torchrun,
    setup_process,
    shard,
    shutdown,
    sync_parameters,
    under_torchrun,
)
from stages.core.training.optim import adamw, layer_of, no_weight_decay
from stages.core.training.resume import load_checkpoint, rng_state, save_checkpoint, set_rng_state

log = logging.getLogger("pretrain")
app = typer.Typer(add_completion=False)


@dataclasses.dataclass
class Paths:
    tokenized: Path
    model_out: Path
    metrics_out: Path
    live_dir: Path
    checkpoints: Path


@app.command()
def main(params_file: Path = typer.Option(Path("params.yaml")),
         tokenized_dir: Path = typer.Option(Path("data/tokenized")),
         out_dir: Path = typer.Option(Path("models/pretrained")),
         metrics_file: Path = typer.Option(Path("metrics/pretrain.json")),
         live_dir: Path = typer.Option(Path("metrics/pretrain")),
         checkpoints_dir: Path = typer.Option(Path("checkpoints/pretrain"))) -> None:
    setup_logging()
    params = load_params(params_file)
    if params.pretrain.enabled and params.pretrain.nproc > 1 and not under_torchrun():
        relaunch_with_torchrun(params.pretrain.nproc, "stages.pretrain", sys.argv[1:])
    paths = Paths(tokenized=tokenized_dir, model_out=out_dir, metrics_out=metrics_file, live_dir=live_dir,
                  checkpoints=checkpoints_dir)
    if params.pretrain.enabled:
        summary = Pretrainer(params, paths).run()
        if summary:  # the main rank's
                log.info("done: held-out perplexity %.2f -> %.2f", summary["before"]["perplexity"],
                     summary["after"]["perplexity"])
    else:
        pass_through(params, paths)


def pass_through(params: Params, paths: Paths) -> None:
    """The backbone, unchanged, as models/pretrained/ (pretrain.enabled is false)."""
    log.info("pretrain.enabled is false: passing the backbone %s through unchanged", params.model.name)
    encoder = load_encoder(params.model.name)
    save_encoder(encoder, load_tokenizer(params.model.name), paths.model_out,
                 {"backbone": params.model.name, "pretrained": False})
    shutil.rmtree(paths.live_dir, ignore_errors=True)
    io.write_json(paths.metrics_out, {"enabled": False, "backbone": params.model.name})


def save_encoder(encoder, tokenizer, out_dir: Path, provenance: dict) -> None:
    with io.atomic_dir(out_dir) as temp:
        encoder.save_pretrained(temp)
        tokenizer.save_pretrained(temp)
        (temp / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2) + "\n", encoding="utf-8")


# --- the text ---------------------------------------------------------------------------------------
def sentences(tokenized_dir: Path, splits: list[str]) -> TokenColumn:
    """Every sentence of the given splits of every task, each alone as `[CLS] s [SEP]`."""
    columns = []
    for task in TASKS.values():
        names = ("input_ids_1", "input_ids_2") if task.is_pair else ("input_ids",)
        for split in splits:
            data = load_split(tokenized_dir, task.name, split)
            columns.extend(data.tokens[name] for name in names)
    return TokenColumn.concat(columns)


def held_out_sentences(tokenized_dir: Path, p: PretrainParams) -> TokenColumn:
    """A fixed random sample of eval_examples dev sentences (all of them when 0)."""
    dev = sentences(tokenized_dir, ["dev"])
    count = len(dev.lengths()) if p.eval_examples == 0 else min(p.eval_examples, len(dev.lengths()))
    rows = np.sort(np.random.default_rng([p.seed, 31]).permutation(len(dev.lengths()))[:count])
    return dev.take(rows)


# --- training ---------------------------------------------------------------------------------------
class Pretrainer:
    """The state of one masked-LM run; `run()` goes from wherever the state is to the end."""

    def __init__(self, params: Params, paths: Paths):
        self.params, self.p, self.paths = params, params.pretrain, paths
        self.ranks, self.device = setup_process(self.p.seed, self.p.threads)
        self.tokenizer = load_tokenizer(params.model.name)
        self.vocab = MaskingVocab.from_tokenizer(self.tokenizer)
        self.model, self.head_from_checkpoint = load_masked_lm(params.model.name)
        self.model.to(self.device).train()
        sync_parameters(self.model, self.ranks)
        if not self.head_from_checkpoint:
            log.info("%s has no masked-LM head: training a fresh one, its decoder tied to the word embeddings",
                     params.model.name)
        self.corpus = sentences(paths.tokenized, self.p.corpus)
        if "dev" in self.p.corpus:
            log.warning("pretrain.corpus includes dev: the held-out perplexity is measured on trained-on text")
        self.stream = TaskStream(self.corpus.lengths(), self.p.batch_size, self.p.bucket_batches, self.p.seed, 0)
        self.held_out = self._masked_held_out(held_out_sentences(paths.tokenized, self.p))
        self.generator = torch.Generator().manual_seed(self.p.seed)  # the training masks
        self.optimizer, self.scheduler = self._optimizer()
        self.fingerprint = run_fingerprint(params, paths.tokenized, self.ranks.world_size)
        self.step, self.history, self.train_seconds = 0, [], 0.0
        self.running = {"loss_sum": 0.0, "batches": 0, "tokens": 0}

    def _masked_held_out(self, column: TokenColumn) -> list[tuple[torch.Tensor, ...]]:
        """Held-out batches with masks drawn once, so every evaluation scores the same corruption."""
        generator = torch.Generator().manual_seed(self.p.seed + 1)
        batches = []
        for rows in eval_batches(np.minimum(column.lengths(), self.p.max_length), self.p.batch_size * 4):
            ids, mask = column.padded_to(rows, self.p.max_length)
            corrupted, labels = mask_tokens(ids, mask, self.vocab, mask_prob=self.p.mask_prob,
                                            whole_word=self.p.whole_word, generator=generator)
            batches.append((corrupted, mask, labels))
        return batches

    def _optimizer(self):
        from transformers import get_linear_schedule_with_warmup

        num_layers = self.model.config.num_hidden_layers
        groups: dict[tuple[float, float], list[torch.nn.Parameter]] = {}
        for name, parameter in self.model.named_parameters():  # the tied decoder is the word embeddings
            scale = self.p.layer_decay ** max(num_layers - layer_of(name, num_layers), 0)
            decay = 0.0 if no_weight_decay(name, parameter) else self.p.weight_decay
            groups.setdefault((scale, decay), []).append(parameter)
        optimizer = adamw([{"params": ps, "lr": self.p.lr * scale, "weight_decay": decay}
                           for (scale, decay), ps in groups.items()], self.p.lr)
        scheduler = get_linear_schedule_with_warmup(optimizer, int(self.p.warmup_fraction * self.p.steps),
                                                    self.p.steps)
        return optimizer, scheduler

    # --- resume -----------------------------------------------------------------------------------
    def state(self) -> dict:
        return {"fingerprint": self.fingerprint, "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "ranks": gather({"rng": rng_state(), "generator": self.generator.get_state()}, self.ranks),
                "stream": self.stream.state(),
                "step": self.step, "history": json.dumps(self.history), "running": json.dumps(self.running),
                "train_seconds": self.train_seconds}

    def load_state(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        own = state["ranks"][self.ranks.rank]  # what differs between ranks: the dropout RNG
        set_rng_state(own["rng"])
        self.generator.set_state(own["generator"])
        self.stream.load_state(state["stream"])
        self.step, self.train_seconds = state["step"], state["train_seconds"]
        self.history, self.running = json.loads(state["history"]), json.loads(state["running"])

    # --- the loop ---------------------------------------------------------------------------------
    def run(self, stop_after: int | None = None) -> dict | None:
        """Train to pretrain.steps; `stop_after` ends early after a checkpoint (as a kill would)."""
        state = load_checkpoint(self.paths.checkpoints / "last.pt", self.fingerprint)
        if state is not None:
            self.load_state(state)
            log.info("resuming masked-LM training at step %d", self.step)
        log.info("masked-LM on %s sentences (%s), %d steps of %d, held-out %d dev sentences",
                 f"{len(self.corpus.lengths()):,}", "+".join(self.p.corpus), self.p.steps, self.p.batch_size,
                 sum(len(b[0]) for b in self.held_out))
        live = self._open_live()
        if not self.history:
            self._evaluate(live)  # step 0: the backbone (and a fresh head) before any training
        progress = tqdm(total=self.p.steps, initial=self.step, desc="masked-LM", unit="step", mininterval=2.0,
                        disable=not self.ranks.is_main)
        started = time.perf_counter()
        while self.step < self.p.steps:
            self._train_step()
            progress.update(1)
            if self.step % self.p.eval_every == 0 or self.step == self.p.steps:
                self.train_seconds += time.perf_counter() - started
                self._evaluate(live)
                started = time.perf_counter()
            if self.step % self.p.checkpoint_every == 0 and self.step < self.p.steps:
                self.train_seconds += time.perf_counter() - started
                started = time.perf_counter()
                self._checkpoint()
                if stop_after is not None and self.step >= stop_after:
                    progress.close()
                    return None
        progress.close()
        if live is not None:
            live.end()
        summary = self._finish()
        shutdown(self.ranks)
        return summary

    def _checkpoint(self) -> None:
        state = self.state()  # on every rank: it gathers each rank's RNG
        if self.ranks.is_main:
            save_checkpoint(self.paths.checkpoints / "last.pt", state)

    def _train_step(self) -> None:
        rows = self.stream.next()
        ids, mask = self.corpus.padded_to(rows, self.p.max_length)
        # Every rank masks the whole global batch (the same draws) and keeps its rows, so the masks do
        # not depend on the number of processes.
        corrupted, labels = mask_tokens(ids, mask, self.vocab, mask_prob=self.p.mask_prob,
                                        whole_word=self.p.whole_word, generator=self.generator)
        mine = torch.from_numpy(shard(np.arange(len(rows)), self.ranks))
        corrupted, mask, labels = corrupted[mine], mask[mine], labels[mine]
        loss, chosen = self._loss(corrupted, mask, labels)
        if not torch.isfinite(loss):
            raise RuntimeError(f"non-finite masked-LM loss ({loss.item()}) at step {self.step + 1}; "
                               f"the last good checkpoint is kept in {self.paths.checkpoints}. "
                               "Lower pretrain.lr or turn off pretrain.bf16.")
        # The mean over all ranks' chosen tokens: weight this rank's mean by its share of them.
        mean_chosen = average_tensor(torch.tensor(float(chosen), device=self.device), self.ranks)
        (loss * (chosen / mean_chosen.clamp(min=1e-9)).item() if self.ranks.distributed else loss).backward()
        average_gradients([p for p in self.model.parameters() if p.requires_grad], self.ranks)
        if self.p.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.p.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.running["loss_sum"] += loss.item()
        self.running["batches"] += 1
        self.running["tokens"] += int(mask.sum())

    def _loss(self, corrupted: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Mean cross-entropy over the chosen tokens, and their count.

        The vocabulary projection runs on the chosen positions only (~15% of tokens): over every
        position it would cost about as much as the whole 6-layer encoder.
        """
        corrupted, mask, labels = corrupted.to(self.device), mask.to(self.device), labels.to(self.device)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.p.bf16):
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

    def _evaluate(self, live) -> None:
        """Held-out loss on the main rank; every rank appends the same record."""
        record = self._held_out_record() if self.ranks.is_main else None
        record = broadcast(record, self.ranks)
        self.history.append(record)
        self.running = {"loss_sum": 0.0, "batches": 0, "tokens": self.running["tokens"]}
        if live is not None:
            log_record(live, record)

    def _held_out_record(self) -> dict:
        self.model.eval()
        total, count = 0.0, 0
        with torch.inference_mode():
            for corrupted, mask, labels in self.held_out:
                loss, chosen = self._loss(corrupted, mask, labels)
                total, count = total + loss.item() * chosen, count + chosen
        self.model.train()
        loss = total / max(count, 1)
        record = {"step": self.step, "loss": loss, "perplexity": math.exp(loss),
                  "train_loss": self.running["loss_sum"] / self.running["batches"] if self.running["batches"]
                  else None}
        log.info("step %d: held-out masked-LM loss %.4f, perplexity %.2f%s", self.step, loss, record["perplexity"],
                 "" if record["train_loss"] is None else f", train loss {record['train_loss']:.4f}")
        return record

    # --- outputs ----------------------------------------------------------------------------------
    def _open_live(self):
        return open_live(self.paths.live_dir, self.history, log_record) if self.ranks.is_main else None

    def _finish(self) -> dict:
        tokens = average_tensor(torch.tensor(float(self.running["tokens"]), device=self.device), self.ranks)
        self.running["tokens"] = int(tokens.item() * self.ranks.world_size)  # summed over ranks
        if not self.ranks.is_main:
            return {}
        encoder = load_encoder(self.params.model.name)  # for the pooler, which masked-LM leaves alone
        missing, unexpected = encoder.load_state_dict(self.model.base_model.state_dict(), strict=False)
        if unexpected or any(not key.startswith("pooler.") for key in missing):
            raise RuntimeError(f"masked-LM encoder does not match the backbone: missing {missing}, "
                               f"unexpected {unexpected}")
        save_encoder(encoder, self.tokenizer, self.paths.model_out,
                     {"backbone": self.params.model.name, "pretrained": True,
                      "pretrain": as_dict(self.p), "head_from_checkpoint": self.head_from_checkpoint})
        held_out = self.held_out
        summary = {"enabled": True, "backbone": self.params.model.name, "steps": self.step,
                   "corpus_sentences": len(self.corpus.lengths()),
                   "held_out": {"sentences": sum(len(b[0]) for b in held_out),
                                "masked_tokens": sum(int((b[2] != IGNORE_INDEX).sum()) for b in held_out)},
                   "head_from_checkpoint": self.head_from_checkpoint,
                   "before": {k: self.history[0][k] for k in ("loss", "perplexity")},
                   "after": {k: self.history[-1][k] for k in ("loss", "perplexity")},
                   "history": self.history,
                   # The only part that differs between identical runs:
                   "speed": {"processes": self.ranks.world_size, "train_seconds": round(self.train_seconds, 1),
                             "steps_per_second": round(self.step / max(self.train_seconds, 1e-9), 3),
                             "tokens_per_second": round(self.running["tokens"] / max(self.train_seconds, 1e-9), 1)}}
        io.write_json(self.paths.metrics_out, summary)
        shutil.rmtree(self.paths.checkpoints, ignore_errors=True)
        return summary


def log_record(live, record: dict) -> None:
    live.step = record["step"]  # the x axis is the optimiser step
    live.log_metric("held_out/loss", record["loss"])
    live.log_metric("held_out/perplexity", record["perplexity"])
    if record["train_loss"] is not None:
        live.log_metric("train/loss", record["train_loss"])
    live.next_step()


def run_fingerprint(params: Params, tokenized_dir: Path, world_size: int = 1) -> str:
    """Identifies a run: the pretrain params (less threads and checkpointing), backbone and text."""
    relevant = {k: v for k, v in as_dict(params.pretrain).items() if k not in ("threads", "checkpoint_every")}
    digest = hashlib.sha256(json.dumps({"pretrain": relevant, "backbone": params.model.name, "world_size": world_size},
                                       sort_keys=True).encode())
    for task in TASKS:
        for split in sorted(set(params.pretrain.corpus) | {"dev"}):
            digest.update(tokenized_path(tokenized_dir, task, split).read_bytes())
    return digest.hexdigest()


if __name__ == "__main__":
    app()
