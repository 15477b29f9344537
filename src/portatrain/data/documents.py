"""Where documents come from: the bundled corpus or a local text/JSONL file, split into train and eval."""

from __future__ import annotations

import json
import random
from pathlib import Path

from portatrain.data.corpus import generate_corpus
from portatrain.data.tokenizer import ByteTokenizer


def read_texts(dataset: str, num_documents: int) -> list[str]:
    """``builtin`` generates the bundled corpus; a ``.jsonl`` path reads its ``text`` fields; any other
    path is plain text with documents separated by blank lines."""
    if dataset == "builtin":
        return generate_corpus(num_documents)
    path = Path(dataset)
    if not path.is_file():
        raise FileNotFoundError(
            f"data.dataset={dataset!r} is not a file; use data.dataset=builtin or a .txt/.jsonl path"
        )
    if path.suffix == ".jsonl":
        with path.open() as f:
            return [json.loads(line)["text"] for line in f if line.strip()]
    return [doc.strip() for doc in path.read_text().split("\n\n") if doc.strip()]


def load_documents(
    dataset: str, tokenizer: ByteTokenizer, *, num_documents: int, eval_fraction: float, seed: int
) -> tuple[list[list[int]], list[list[int]]]:
    """Tokenize every document and hold out a seeded random ``eval_fraction`` for evaluation."""
    docs = [tokenizer.encode(text) for text in read_texts(dataset, num_documents)]
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    n_eval = int(len(docs) * eval_fraction)
    return [docs[i] for i in order[n_eval:]], [docs[i] for i in order[:n_eval]]
