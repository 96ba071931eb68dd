"""BERT's masked-LM corruption, vectorised over a padded batch and driven by one seeded generator.

Of the real, non-special tokens, each is chosen with probability `mask_prob` (whole-word: each word
is chosen with that probability and all its WordPiece pieces go together); a chosen token becomes
[MASK] 80% of the time, a random ordinary token 10%, and stays itself 10%. Labels are the original
ids at chosen positions and -100 elsewhere.

Why not transformers' DataCollatorForLanguageModeling: its whole-word mode needs the tokenizer's
offset mapping (the Parquet files hold ids only), turns the 80/10/10 split into 100% [MASK], and
builds a batch x length x length array; its random replacements may also draw special tokens.
"""

from __future__ import annotations

import dataclasses

import torch

IGNORE_INDEX = -100  # the label torch's cross-entropy skips
MASK_TOKEN_SHARE = 0.8  # of the chosen tokens: [MASK]
RANDOM_TOKEN_SHARE = 0.1  # a random ordinary token; the remaining 10% stay unchanged
WORDPIECE_CONTINUATION = "##"


@dataclasses.dataclass(frozen=True)
class MaskingVocab:
    """What the masker needs to know of a tokenizer's vocabulary."""
    mask_id: int
    special: torch.Tensor  # (vocab,) bool: never chosen, never drawn as a random replacement
    continuation: torch.Tensor  # (vocab,) bool: a piece that continues the previous token's word
    ordinary_ids: torch.Tensor  # the ids random replacements are drawn from
    pad_id: int = 0  # what batches are padded with (BERT 0, MPNet 1)

    @classmethod
    def from_tokenizer(cls, tokenizer) -> MaskingVocab:
        if tokenizer.mask_token_id is None:
            raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no mask token; masked-LM needs one")
        size = len(tokenizer)
        special = torch.zeros(size, dtype=torch.bool)
        special[tokenizer.all_special_ids] = True
        pieces = tokenizer.convert_ids_to_tokens(list(range(size)))
        continuation = torch.tensor([piece.startswith(WORDPIECE_CONTINUATION) for piece in pieces])
        return cls(mask_id=tokenizer.mask_token_id, special=special, continuation=continuation,
                   ordinary_ids=torch.nonzero(~special).squeeze(1), pad_id=tokenizer.pad_token_id or 0)


def mask_tokens(input_ids: torch.Tensor, attention_mask: torch.Tensor, vocab: MaskingVocab, *,
                mask_prob: float, whole_word: bool, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(corrupted input ids, labels) for one padded batch; the inputs are not modified."""
    eligible = attention_mask.bool() & ~vocab.special[input_ids]
    if whole_word:
        chosen = _choose_whole_words(input_ids, eligible, vocab, mask_prob, generator)
    else:
        chosen = eligible & (torch.rand(input_ids.shape, generator=generator) < mask_prob)
    labels = torch.where(chosen, input_ids, torch.full_like(input_ids, IGNORE_INDEX))
    action = torch.rand(input_ids.shape, generator=generator)
    to_mask = chosen & (action < MASK_TOKEN_SHARE)
    to_random = chosen & (action >= MASK_TOKEN_SHARE) & (action < MASK_TOKEN_SHARE + RANDOM_TOKEN_SHARE)
    random_ids = vocab.ordinary_ids[torch.randint(len(vocab.ordinary_ids), input_ids.shape, generator=generator)]
    corrupted = torch.where(to_mask, torch.full_like(input_ids, vocab.mask_id), input_ids)
    corrupted = torch.where(to_random, random_ids, corrupted)
    return corrupted, labels


def _choose_whole_words(input_ids: torch.Tensor, eligible: torch.Tensor, vocab: MaskingVocab, mask_prob: float,
                        generator: torch.Generator) -> torch.Tensor:
    """Chosen tokens where each word (a piece and the '##' pieces after it) is chosen with mask_prob."""
    starts_word = eligible & ~vocab.continuation[input_ids]
    # A continuation piece right after a special token (no word to continue) starts its own word.
    previous_eligible = torch.nn.functional.pad(eligible[:, :-1], (1, 0), value=False)
    starts_word |= eligible & ~previous_eligible
    word_index = torch.cumsum(starts_word.long(), dim=1)  # the pieces of one word share an index
    word_chosen = starts_word & (torch.rand(input_ids.shape, generator=generator) < mask_prob)
    chosen_by_word = torch.zeros(input_ids.shape[0], input_ids.shape[1] + 1, dtype=torch.long)
    chosen_by_word.scatter_reduce_(1, word_index, word_chosen.long(), reduce="amax")
    return eligible & chosen_by_word.gather(1, word_index).bool()
