"""Data: documents -> token ids -> length-grouped sampler -> static-shape collator -> stateful loader."""
