"""Masked-LM further pretraining of the backbone on the tasks' own text: the loop, and the pass-through.

Built as fine-tuning is (training/finetune.py, build.py, progress.py), and called by the `pretrain` stage:

    run = prepare(params, paths, ranks, device, fingerprint)
    progress = resume(run)
    summary = train(run, progress)

`train` evaluates the held-out loss at step 0, then per step one masked batch (`train_step`: BERT's
15% / 80-10-10 masking, no next-sentence task), a held-out evaluation every `eval_every` steps and a
checkpoint every `runtime.checkpoint_every.pretrain` steps; at the end the encoder goes to
models/pretrained/ in Hugging Face format (with the backbone's pooler, which masked-LM does not train).
`pass_through` writes the backbone there unchanged when pretraining is off.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import shutil
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from mtbert import io
from mtbert.data.batches import TokenColumn, eval_batches, load_split, tokenized_input
from mtbert.data.masking import IGNORE_INDEX, MaskingVocab, mask_tokens
from mtbert.data.sampling import TaskStream
from mtbert.data.tasks import tasks_from_params
from mtbert.model.backbone import PROVENANCE_FILE, load_encoder, load_masked_lm, load_tokenizer, save_tokenizer
from mtbert.model.families import family_of
from mtbert.params import Params, PretrainParams, as_dict
from mtbert.rng import HELD_OUT_SENTENCES, generator
from mtbert.runtime import open_live, use_bf16
from mtbert.training.checkpoint import every_rank
from mtbert.training.distributed import Ranks, average_gradients, average_tensor, broadcast, shard, sync_parameters
from mtbert.training.loop import (
    Paths,
    Stopwatch,
    TrainingError,
    fingerprint,
    finish,
    load_latest,
    speed,
    trainable,
    write_checkpoint,
)
from mtbert.training.optim import LayerwiseLR, layerwise_optimizer

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
        save_tokenizer(tokenizer, temp)
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
    rows = np.sort(generator(p.seed, HELD_OUT_SENTENCES).permutation(len(dev.lengths()))[:count])
    return dev.take(rows)


# --- training ---------------------------------------------------------------------------------------
@dataclasses.dataclass
class Totals:
    """Running sums since the last held-out evaluation (tokens: since the start)."""
    loss_sum: float = 0.0
    batches: int = 0
    tokens: int = 0


@dataclasses.dataclass
class Progress:
    step: int
    totals: Totals
    history: list[dict]  # one held-out record per evaluation, step 0 first
    train_seconds: float = 0.0

    @classmethod
    def start(cls) -> Progress:
        return cls(step=0, totals=Totals(), history=[])

    @classmethod
    def from_json(cls, state: dict) -> Progress:
        return cls(**{**state, "totals": Totals(**state["totals"])})


@dataclasses.dataclass
class MaskedLMCheckpoint:
    """Everything a resumed run needs to end exactly as an uninterrupted one."""
    fingerprint: str
    progress: Progress
    model: dict
    optimizer: dict
    scheduler: dict
    stream: dict  # the position in the corpus's batches
    ranks: list[dict]  # per rank: torch's RNG and the masking generator


@dataclasses.dataclass
class MaskedLM:
    """What the loop works with: built by `prepare`, its state loaded by `resume` from a checkpoint."""
    params: Params
    paths: Paths
    fingerprint: str  # the pretrain params, backbone and text of this run
    ranks: Ranks
    device: torch.device
    bf16: bool
    tokenizer: object
    vocab: MaskingVocab
    model: torch.nn.Module  # the backbone with its masked-LM head
    head_from_checkpoint: bool
    corpus: TokenColumn
    stream: TaskStream
    held_out: list[tuple[torch.Tensor, ...]]  # masked once, so every evaluation scores the same corruption
    generator: torch.Generator  # the training masks
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    stopwatch: Stopwatch

    @property
    def pretrain(self) -> PretrainParams:
        return self.params.pretrain


def prepare(params: Params, paths: Paths, ranks: Ranks, device: torch.device, fingerprint: str) -> MaskedLM:
    """The masked-LM model, corpus, held-out set and optimiser. Torch must be seeded already (a fresh head
    starts random)."""
    p = params.pretrain
    bf16 = use_bf16(p.bf16, device)
    log.info("bf16 autocast %s (bf16: %s on %s)", "on" if bf16 else "off", p.bf16, device.type)
    tokenizer = load_tokenizer(params.model.name)
    vocab = MaskingVocab.from_tokenizer(tokenizer)
    model, head_from_checkpoint = load_masked_lm(params.model.name)
    # its family's attention in training too (BERT: sdpa, even on a CPU): the eager attention fine-tuning
    # switches to there was slower for masked-LM steps (docs/training.md, masked-LM pretraining)
    model.to(device).train()
    sync_parameters(model, ranks)
    if not head_from_checkpoint:
        log.info("%s has no masked-LM head: training a fresh one, its decoder tied to the word embeddings",
                 params.model.name)
    corpus = sentences(paths.tokenized, params, p.corpus)
    if "dev" in p.corpus:
        log.warning("pretrain.corpus includes dev: the held-out perplexity is measured on trained-on text")
    stream = TaskStream(corpus.lengths(), p.batch_size, p.bucket_batches, p.seed, 0)
    held_out = masked_held_out(held_out_sentences(paths.tokenized, params), vocab, p)
    generator = torch.Generator().manual_seed(p.seed)
    # The same layer-wise grouping as fine-tuning; the masked-LM head (outside the encoder) gets lr.
    # Its tied decoder is the word embeddings (named_parameters lists it once), so it decays with them.
    rule = LayerwiseLR(p.lr, p.weight_decay, p.layer_decay, encoder_prefix=f"{model.base_model_prefix}.",
                       depth_zero=family_of(model.config).depth_zero)
    optimizer, scheduler = layerwise_optimizer(model, model.config.num_hidden_layers, rule, "linear",
                                               p.warmup_fraction, p.steps)
    return MaskedLM(params, paths, fingerprint, ranks, device, bf16, tokenizer, vocab, model, head_from_checkpoint,
                    corpus, stream, held_out, generator, optimizer, scheduler, Stopwatch())


def masked_held_out(column: TokenColumn, vocab: MaskingVocab, p: PretrainParams) -> list[tuple[torch.Tensor, ...]]:
    """Held-out batches with masks drawn once, so every evaluation scores the same corruption."""
    generator = torch.Generator().manual_seed(p.seed + 1)
    batches = []
    for rows in eval_batches(np.minimum(column.lengths(), p.max_length), p.batch_size * 4):
        ids, mask = column.padded_to(rows, p.max_length, vocab.pad_id)
        corrupted, labels = mask_tokens(ids, mask, vocab, mask_prob=p.mask_prob, whole_word=p.whole_word,
                                        generator=generator)
        batches.append((corrupted, mask, labels))
    return batches


# --- checkpoints ------------------------------------------------------------------------------------
def checkpoint(run: MaskedLM, progress: Progress) -> None:
    """Write the state atomically (the main rank; every rank contributes its RNG); not training time."""
    with run.stopwatch.paused():
        write_checkpoint(run, progress, MaskedLMCheckpoint, stream=run.stream.state(),
                         ranks=every_rank({"generator": run.generator.get_state()}, run.ranks))


def resume(run: MaskedLM) -> Progress:
    """The progress of this very run's newest whole checkpoint, loaded into `run`; else a fresh start."""
    latest = load_latest(run, MaskedLMCheckpoint, Progress)
    if latest is None:
        return Progress.start()
    state, own = latest
    run.generator.set_state(own["generator"])
    run.stream.load_state(state.stream)
    log.info("resuming masked-LM training at step %d", state.progress.step)
    return state.progress


# --- the loop ---------------------------------------------------------------------------------------
def train(run: MaskedLM, progress: Progress, stop_after: int | None = None) -> dict | None:
    """Train to pretrain.steps; `stop_after` ends early after a checkpoint (as a kill would), returning None."""
    p = run.pretrain
    log.info("masked-LM on %s sentences (%s), %d steps of %d, held-out %d dev sentences",
             f"{len(run.corpus.lengths()):,}", "+".join(p.corpus), p.steps, p.batch_size,
             sum(len(b[0]) for b in run.held_out))
    live = open_live(run.paths.live_dir, progress.history, log_record) if run.ranks.is_main else None
    if not progress.history:
        evaluate(run, progress, live)  # step 0: the backbone (and a fresh head) before any training
    # a context, so that an error closes the bar first and the error's one line does not run into it
    with tqdm(total=p.steps, initial=progress.step, desc="masked-LM", unit="step", mininterval=2.0,
              disable=not run.ranks.is_main) as bar:
        run.stopwatch.start()
        while progress.step < p.steps:
            train_step(run, progress)
            bar.update(1)
            if progress.step % p.eval_every == 0 or progress.step == p.steps:
                with run.stopwatch.paused():
                    evaluate(run, progress, live)
            if progress.step % run.params.runtime.checkpoint_every.pretrain == 0 and progress.step < p.steps:
                checkpoint(run, progress)
                if stop_after is not None and progress.step >= stop_after:
                    return None
        run.stopwatch.stop()
    if live is not None:
        live.end()
    result = summary(run, progress)
    finish(run, result, lambda: save_trained_encoder(run))
    return result if run.ranks.is_main else {}


def train_step(run: MaskedLM, progress: Progress) -> None:
    """One masked batch: its loss over the chosen tokens, backward, an optimiser update."""
    p = run.pretrain
    rows = run.stream.next()
    ids, mask = run.corpus.padded_to(rows, p.max_length, run.vocab.pad_id)
    # Every rank masks the whole global batch (the same draws) and keeps its rows, so the masks do
    # not depend on the number of processes.
    corrupted, labels = mask_tokens(ids, mask, run.vocab, mask_prob=p.mask_prob, whole_word=p.whole_word,
                                    generator=run.generator)
    mine = torch.from_numpy(shard(np.arange(len(rows)), run.ranks))
    corrupted, mask, labels = corrupted[mine], mask[mine], labels[mine]
    loss, chosen = masked_loss(run, corrupted, mask, labels)
    check_finite(loss, "masked-LM loss", f"at step {progress.step + 1}", run.paths.checkpoints,
                 "Lower pretrain.lr or turn off pretrain.bf16.")
    # The mean over all ranks' chosen tokens: weight this rank's mean by its share of them.
    mean_chosen = average_tensor(torch.tensor(float(chosen), device=run.device), run.ranks)
    (loss * (chosen / mean_chosen.clamp(min=1e-9)).item() if run.ranks.distributed else loss).backward()
    average_gradients(trainable(run.model), run.ranks)
    clip_and_step(run.model, run.optimizer, run.scheduler, p.grad_clip)
    progress.step += 1
    progress.totals.loss_sum += loss.item()
    progress.totals.batches += 1
    progress.totals.tokens += int(mask.sum())


def clip_and_step(model: torch.nn.Module, optimizer, scheduler, grad_clip: float) -> None:
    """The gradients (already averaged over the ranks) clipped to a global norm (0: not clipped), the optimiser's
    and the LR schedule's step, and the gradients freed."""
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)


def check_finite(loss: torch.Tensor, what: str, where: str, checkpoints: Path, hint: str) -> None:
    """Stop on a non-finite loss, keeping the last good checkpoint."""
    if not torch.isfinite(loss):
        raise TrainingError(f"non-finite {what} ({loss.item()}) {where}; the last good checkpoint is kept "
                            f"in {checkpoints}. {hint}")


def masked_loss(run: MaskedLM, corrupted: torch.Tensor, mask: torch.Tensor,
                labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Mean cross-entropy over the chosen tokens, and their count.

    The vocabulary projection runs on the chosen positions only (~15% of tokens): over every
    position it would cost about as much as the whole 6-layer encoder.
    """
    corrupted, mask, labels = corrupted.to(run.device), mask.to(run.device), labels.to(run.device)
    with torch.autocast(run.device.type, dtype=torch.bfloat16, enabled=run.bf16):
        hidden = run.model.base_model(input_ids=corrupted, attention_mask=mask).last_hidden_state
        chosen = labels != IGNORE_INDEX
        logits = mlm_head(run.model)(hidden[chosen])
    count = int(chosen.sum())
    if count == 0:
        return hidden.sum() * 0.0, 0  # keeps the graph; nothing to predict in this batch
    return torch.nn.functional.cross_entropy(logits.float(), labels[chosen]), count


def mlm_head(model: torch.nn.Module) -> torch.nn.Module:
    """The module mapping hidden states to vocabulary logits (BERT: `cls`, RoBERTa: `lm_head`)."""
    heads = [module for name, module in model.named_children() if name != model.base_model_prefix]
    if len(heads) != 1:
        raise TypeError(f"{type(model).__name__}: expected one masked-LM head beside the encoder, "
                        f"found {[name for name, _ in model.named_children()]}")
    return heads[0]


def evaluate(run: MaskedLM, progress: Progress, live) -> None:
    """Held-out loss on the main rank; every rank appends the same record."""
    record = held_out_record(run, progress) if run.ranks.is_main else None
    record = broadcast(record, run.ranks)
    progress.history.append(record)
    progress.totals = Totals(tokens=progress.totals.tokens)
    if live is not None:
        log_record(live, record)


def held_out_record(run: MaskedLM, progress: Progress) -> dict:
    run.model.eval()
    total, count = 0.0, 0
    with torch.inference_mode():
        for corrupted, mask, labels in run.held_out:
            loss, chosen = masked_loss(run, corrupted, mask, labels)
            total, count = total + loss.item() * chosen, count + chosen
    run.model.train()
    loss = total / max(count, 1)
    totals = progress.totals
    record = {"step": progress.step, "loss": loss, "perplexity": math.exp(loss),
              "train_loss": totals.loss_sum / totals.batches if totals.batches else None}
    log.info("step %d: held-out masked-LM loss %.4f, perplexity %.2f%s", progress.step, loss, record["perplexity"],
             "" if record["train_loss"] is None else f", train loss {record['train_loss']:.4f}")
    return record


# --- outputs ----------------------------------------------------------------------------------------
def save_trained_encoder(run: MaskedLM) -> None:
    """The trained encoder, with the backbone's pooler (which masked-LM leaves alone)."""
    params = run.params
    encoder = load_encoder(params.model.name)
    missing, unexpected = encoder.load_state_dict(run.model.base_model.state_dict(), strict=False)
    if unexpected or any(not key.startswith("pooler.") for key in missing):
        raise RuntimeError(f"masked-LM encoder does not match the backbone: missing {missing}, "
                           f"unexpected {unexpected}")
    save_encoder(encoder, run.tokenizer, run.paths.model_out,
                 {"backbone": params.model.name, "pretrained": True, "pretrain": as_dict(run.pretrain),
                  "head_from_checkpoint": run.head_from_checkpoint})


def summary(run: MaskedLM, progress: Progress) -> dict:
    tokens = average_tensor(torch.tensor(float(progress.totals.tokens), device=run.device), run.ranks)
    all_tokens = int(tokens.item() * run.ranks.world_size)  # summed over ranks
    history, held_out = progress.history, run.held_out
    return {"enabled": True, "backbone": run.params.model.name, "steps": progress.step,
            "corpus_sentences": len(run.corpus.lengths()),
            "held_out": {"sentences": sum(len(b[0]) for b in held_out),
                         "masked_tokens": sum(int((b[2] != IGNORE_INDEX).sum()) for b in held_out)},
            "head_from_checkpoint": run.head_from_checkpoint,
            "before": {k: history[0][k] for k in ("loss", "perplexity")},
            "after": {k: history[-1][k] for k in ("loss", "perplexity")},
            "history": history,
            "speed": speed(run.stopwatch.seconds, run.ranks, run.bf16, progress.step, None, all_tokens)}


def log_record(live, record: dict) -> None:
    live.step = record["step"]  # the x axis is the optimiser step
    live.log_metric("held_out/loss", io.rounded(record["loss"]))
    live.log_metric("held_out/perplexity", io.rounded(record["perplexity"]))
    if record["train_loss"] is not None:
        live.log_metric("train/loss", io.rounded(record["train_loss"]))
    live.next_step()


def run_fingerprint(params: Params, tokenized_dir: Path, world_size: int = 1) -> str:
    """Identifies a run: the pretrain params, backbone and text (`runtime` changes no result)."""
    settings = {"pretrain": as_dict(params.pretrain), "backbone": params.model.name, "world_size": world_size}
    return fingerprint(settings, [tokenized_input(tokenized_dir, task, split) for task in params.tasks
                                  for split in sorted(set(params.pretrain.corpus) | {"dev"})])
