"""The transfer set: inputs beyond the members' training rows, for the ensemble to label and its students to
learn from.

On the very rows the members were trained on, their predictions are close to the gold labels, so a student
taught there learns little beyond the labels and keeps none of the ensemble's gain. A transfer set gives the
teacher inputs it was not fitted to (Augmented SBERT, Thakur et al. 2021). Every text in it comes from the
tasks' training splits: dev and test text would be transductive, and dev chooses the recipe.

Per task, `distill.transfer.rows` rows:
- a one-sentence task (SST): sentences of the other tasks' training splits, drawn without replacement, none
  that is already one of the task's own training sentences (`sentences_from: others`); or word spans of its own
  training sentences, each shorter than its sentence and new (`spans`: phrases of the task's domain, as the
  Stanford Sentiment Treebank labels its sentences' phrases);
- a pair task (QQP, STS): the share `swapped` are training pairs in the order (b, a); of the rest, the share
  `neighbours` join a drawn sentence to one of its `top_k` nearest sentences by the encoder's embedding,
  and the others join two drawn sentences at random. The sentences are the task's own training sentences
  (`pairs_from: own`) or every task's (`all`). No new pair is a training pair (in either order), a sentence
  with itself, or a repeat.

Everything is drawn from one generator seeded by `distill.transfer.seed` and the task's name, so the same
params and data give the same set.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable

import numpy as np
import pandas as pd

from mtbert.data.tasks import Task
from mtbert.params import TransferParams

SOURCES = ("sentence", "span", "swapped", "neighbour", "random")  # how a row was made; the `source` column
MAX_DRAWS_PER_ROW = 20  # random pairs and spans: draws tried per row wanted before giving up on a small pool
MIN_SPAN_WORDS = 3  # a shorter span rarely carries a sentiment of its own

# (texts) -> (N, D) unit-length sentence embeddings; the stage passes the pretrained encoder's
Embed = Callable[[list[str]], np.ndarray]


@dataclasses.dataclass(frozen=True)
class TrainingText:
    """One task's training split as text: a column of sentences per text column."""
    task: Task
    columns: list[list[str]]

    @classmethod
    def from_table(cls, task: Task, table: pd.DataFrame) -> TrainingText:
        return cls(task, [table[column].astype(str).tolist() for column in task.text_columns])

    def sentences(self) -> list[str]:
        """Every sentence once, in order of first appearance."""
        return list(dict.fromkeys(text for column in self.columns for text in column))

    def pairs(self) -> set[tuple[str, str]]:
        return set(zip(*self.columns, strict=True)) if self.task.is_pair else set()


def task_generator(seed: int, task: str) -> np.random.Generator:
    """The same draws for the same seed and task, whatever the other tasks."""
    return np.random.default_rng([seed, zlib.crc32(task.encode())])


def transfer_rows(task: Task, training: dict[str, TrainingText], params: TransferParams, wanted: int,
                  embed: Embed | None) -> pd.DataFrame:
    """The task's `wanted` transfer rows (fewer if its pool runs out): `id`, its text columns and `source`
    (one of SOURCES)."""
    rng = task_generator(params.seed, task.name)
    if task.is_pair:
        texts = pair_rows(training, task.name, wanted, params, rng, embed)
    elif params.sentences_from == "spans":
        texts = span_rows(training[task.name], wanted, rng)
    else:
        texts = sentence_rows(training, task.name, wanted, rng)
    columns = {"id": [f"transfer-{task.name}-{index}" for index in range(len(texts))]}
    for position, column in enumerate(task.text_columns):
        columns[column] = [row[position] for row in texts]
    columns["source"] = [row[-1] for row in texts]
    return pd.DataFrame(columns)


def sentence_rows(training: dict[str, TrainingText], task: str, wanted: int,
                  rng: np.random.Generator) -> list[tuple[str, str]]:
    """Sentences of the other tasks' training splits that are not among the task's own."""
    own = set(training[task].sentences())
    pool = [text for name, text_of in training.items() if name != task for text in text_of.sentences()
            if text not in own]
    pool = list(dict.fromkeys(pool))
    chosen = rng.choice(len(pool), size=min(wanted, len(pool)), replace=False) if pool else []
    return [(pool[i], "sentence") for i in sorted(chosen)]


def span_rows(own: TrainingText, wanted: int, rng: np.random.Generator) -> list[tuple[str, str]]:
    """Contiguous word spans of the task's training sentences: MIN_SPAN_WORDS words or more, shorter than their
    sentence, none a training sentence or a repeat. A sentence drawn at random, then a length and a start."""
    sentences = [words for words in (text.split() for text in own.sentences()) if len(words) > MIN_SPAN_WORDS]
    seen = set(own.sentences())
    rows: list[tuple[str, str]] = []
    for _ in range(MAX_DRAWS_PER_ROW * max(wanted, 0) if sentences else 0):
        if len(rows) >= wanted:
            break
        words = sentences[rng.integers(len(sentences))]
        length = int(rng.integers(MIN_SPAN_WORDS, len(words)))  # up to one word fewer than the sentence
        start = int(rng.integers(len(words) - length + 1))
        span = " ".join(words[start:start + length])
        if span not in seen:
            seen.add(span)
            rows.append((span, "span"))
    return rows


def pair_rows(training: dict[str, TrainingText], task: str, wanted: int, params: TransferParams,
              rng: np.random.Generator, embed: Embed | None) -> list[tuple[str, str, str]]:
    """Swapped training pairs, then neighbour pairs, then random pairs, as (a, b, source)."""
    own = training[task]
    seen = own.pairs() | {(b, a) for a, b in own.pairs()}  # a new pair must be new in either order
    rows: list[tuple[str, str, str]] = []
    swapped = round(wanted * params.swapped)
    originals = list(zip(*own.columns, strict=True))
    for index in sorted(rng.choice(len(originals), size=min(swapped, len(originals)), replace=False)):
        a, b = originals[index]
        if a != b:
            rows.append((b, a, "swapped"))
    pool = own.sentences() if params.pairs_from == "own" else list(dict.fromkeys(
        text for text_of in training.values() for text in text_of.sentences()))
    rest = wanted - len(rows)
    neighbours = round(rest * params.neighbours) if embed is not None else 0
    if neighbours:
        rows += neighbour_pairs(pool, embed(pool), neighbours, params.top_k, seen, rng)
    rows += random_pairs(pool, wanted - len(rows), seen, rng)
    return rows


def neighbour_pairs(pool: list[str], embeddings: np.ndarray, wanted: int, top_k: int, seen: set,
                    rng: np.random.Generator, chunk: int = 512) -> list[tuple[str, str, str]]:
    """Each drawn sentence with one of its top_k nearest others (cosine of unit embeddings) not paired yet."""
    rows: list[tuple[str, str, str]] = []
    anchors = rng.permutation(len(pool))
    for start in range(0, len(anchors), chunk):
        block = anchors[start:start + chunk]
        similarity = embeddings[block] @ embeddings.T
        similarity[np.arange(len(block)), block] = -np.inf  # not itself
        nearest = np.argsort(-similarity, axis=1, kind="stable")[:, :top_k + 4]
        for anchor, candidates in zip(block, nearest, strict=True):
            a = pool[anchor]
            free = [pool[c] for c in candidates if (a, pool[c]) not in seen][:top_k]
            if not free:
                continue
            b = free[rng.integers(len(free))]
            seen.update({(a, b), (b, a)})
            rows.append((a, b, "neighbour"))
            if len(rows) == wanted:
                return rows
    return rows


def random_pairs(pool: list[str], wanted: int, seen: set, rng: np.random.Generator) -> list[tuple[str, str, str]]:
    """Two sentences drawn at random, a pair not seen yet."""
    rows: list[tuple[str, str, str]] = []
    if len(pool) < 2:
        return rows
    for _ in range(MAX_DRAWS_PER_ROW * max(wanted, 0)):
        if len(rows) >= wanted:
            break
        i, j = rng.integers(len(pool), size=2)
        a, b = pool[i], pool[j]
        if i != j and (a, b) not in seen:
            seen.update({(a, b), (b, a)})
            rows.append((a, b, "random"))
    return rows
