"""Pooling token states into one sentence vector: CLS, mean, max or CLS-anchored attention."""

from __future__ import annotations

import math

import numpy as np
import torch
from tqdm.auto import tqdm


def pool(kind: str, hidden: torch.Tensor, mask: torch.Tensor, pooler_output: torch.Tensor | None) -> torch.Tensor:
    """(B, T, d) hidden states and (B, T) mask -> (B, d); padding never contributes."""
    if kind == "cls":
        return pooler_output if pooler_output is not None else hidden[:, 0]
    mask_f = mask.unsqueeze(-1).to(hidden.dtype)
    if kind == "mean":
        return (hidden * mask_f).sum(1) / mask_f.sum(1).clamp(min=1.0)
    if kind == "max":
        return hidden.masked_fill(mask_f == 0, torch.finfo(hidden.dtype).min).max(1).values
    if kind == "attention":
        # CLS-anchored: alpha_t = softmax_t(<h_cls, h_t> / sqrt(d)), output h_cls + sum_t alpha_t h_t. The
        # 1/sqrt(d) keeps the softmax from collapsing onto the CLS token's own (largest) dot product.
        cls = hidden[:, 0]
        scores = torch.einsum("bd,btd->bt", cls, hidden) / math.sqrt(hidden.shape[-1])
        scores = scores.masked_fill(mask == 0, torch.finfo(scores.dtype).min)
        return cls + torch.einsum("bt,btd->bd", scores.softmax(-1), hidden)
    raise ValueError(f"unknown pooling {kind!r}")


def mean_pooled_embeddings(encoder, tokenizer, texts: list[str], max_length: int, bf16: bool = False,
                           batch_size: int = 128) -> np.ndarray:
    """(N, d) unit-length mean-pooled sentence embeddings of `texts` (the pooling all-MiniLM-L6-v2 was trained
    with), in batches of similar length so that little is padded."""
    lengths = np.array([len(text) for text in texts])
    order = np.argsort(lengths, kind="stable")
    out = np.empty((len(texts), encoder.config.hidden_size), dtype=np.float32)
    was_training = encoder.training
    encoder.eval()
    device = next(encoder.parameters()).device
    with torch.inference_mode(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        for start in tqdm(range(0, len(texts), batch_size), desc="embed", unit="batch", leave=False):
            rows = order[start:start + batch_size]
            batch = tokenizer([texts[i] for i in rows], truncation=True, max_length=max_length, padding=True,
                              return_tensors="pt")
            ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
            hidden = encoder(input_ids=ids, attention_mask=mask).last_hidden_state
            vectors = torch.nn.functional.normalize(pool("mean", hidden, mask, None).float(), dim=-1)
            out[rows] = vectors.cpu().numpy()
    encoder.train(was_training)
    return out
