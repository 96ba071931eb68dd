"""Task declarations, raw-file parsing, tokenisation, tokenised batches, task sampling and masking."""
