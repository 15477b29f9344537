"""Documents: records from the sources -> token ids (and, for fine-tuning, which tokens are trained).

What this file does:
- ``encode_payloads``: a batch of checked records (see ``sources.record_payload``) -> one
  ``(tokens, mask)`` pair per document. ``tokens`` is ``[BOS] + ids + [EOS]``; ``mask`` is ``None`` for
  pre-training text (every token is a target) or a uint8 array, 1 where the token is a training
  target: the response (and EOS) of a prompt/response record, the assistant turns of a chat;
- ``read_texts`` / ``load_documents``: the small in-memory path (the bundled corpus, or a source
  read whole), split into train and eval documents.

Chat records are rendered with the tokenizer's own ``chat_template`` through ``transformers``
(optional): each conversation is rendered prefix by prefix, so the text an assistant turn adds is
known exactly and only its tokens are trained.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from functools import lru_cache
from typing import Any

import numpy as np

from portatrain.data.corpus import generate_corpus
from portatrain.data.errors import DataError
from portatrain.data.sources import iter_mixed, iter_source, record_payload
from portatrain.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

Document = tuple[np.ndarray, "np.ndarray | None"]
"""``(tokens, mask)``: int64 token ids; uint8 target mask or ``None`` (all targets)."""


def iter_payloads(
    sources: Sequence[str],
    *,
    weights: Sequence[float] | None = None,
    seed: int = 0,
    text_field: str = "text",
    format: str = "text",
    num_documents: int = 4000,
) -> Iterator[tuple[str, Any]]:
    """``(location, payload)`` of every document of the (mixed) sources, checked for ``format``."""

    def open_source(spec: str) -> Iterator[tuple[str, Any]]:
        if spec == "builtin":
            return ((f"builtin:{i}", t) for i, t in enumerate(generate_corpus(num_documents)))
        return iter_source(spec, text_field=text_field, format=format)

    for location, record in iter_mixed(sources, weights, seed=seed, open_source=open_source):
        yield location, record_payload(location, record, format=format, text_field=text_field)


def encode_payloads(tokenizer: Tokenizer, payloads: Sequence[Any], format: str = "text") -> list[Document]:
    """Tokenize a batch of payloads of one ``format`` (see the module docstring)."""
    bos = np.asarray([] if tokenizer.bos_id is None else [tokenizer.bos_id], dtype=np.int64)
    eos = np.asarray([tokenizer.eos_id], dtype=np.int64)
    if format == "text":
        return [(np.concatenate([bos, ids, eos]), None) for ids in tokenizer.encode_ids(payloads)]
    if format == "prompt_response":
        prompts = tokenizer.encode_ids([p for p, _ in payloads])
        responses = tokenizer.encode_ids([r for _, r in payloads])
        docs = []
        for p, r in zip(prompts, responses):
            tokens = np.concatenate([bos, p, r, eos])
            mask = np.zeros(len(tokens), dtype=np.uint8)
            mask[len(bos) + len(p) :] = 1  # the response and EOS are targets; BOS and prompt are not
            docs.append((tokens, mask))
        return docs
    if format == "chat":
        return [_encode_chat(tokenizer, messages) for messages in payloads]
    raise DataError(f"data.format={format!r} is not one of text, prompt_response, chat")


@lru_cache(maxsize=4)
def _chat_tokenizer(path: str) -> Any:
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise DataError(
            "data.format=chat renders messages with the tokenizer's chat template through transformers: "
            "pip install transformers (or use data.format=prompt_response)"
        ) from None
    return AutoTokenizer.from_pretrained(path)


def _encode_chat(tokenizer: Tokenizer, messages: list[dict[str, str]]) -> Document:
    if not isinstance(tokenizer, HFTokenizer) or not tokenizer.chat_template:
        raise DataError(
            f"data.format=chat needs a tokenizer with a chat_template in tokenizer_config.json; "
            f"data.tokenizer={tokenizer.name!r} has none (use data.format=prompt_response, or add one)"
        )
    hf = _chat_tokenizer(str(tokenizer.path))
    # Render prefix by prefix: each message adds a piece of text, trained when the message is the
    # assistant's. A template whose renders are not prefixes of each other cannot be split this way.
    pieces: list[tuple[str, bool]] = []
    done = ""
    for i, message in enumerate(messages):
        assistant = message["role"] == "assistant"
        if assistant:
            prompt = hf.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
            pieces.append((prompt[len(done) :], False))
            done = prompt
        text = hf.apply_chat_template(messages[: i + 1], tokenize=False)
        if not text.startswith(done):
            raise DataError(
                "the tokenizer's chat_template does not render conversations prefix by prefix, so the "
                "assistant turns cannot be located; use data.format=prompt_response"
            )
        pieces.append((text[len(done) :], assistant))
        done = text
    ids_list = tokenizer.encode_ids([p for p, _ in pieces])
    tokens = np.concatenate([ids for ids in ids_list] + [np.zeros(0, np.int64)]).astype(np.int64)
    mask = np.concatenate(
        [np.full(len(ids), t, np.uint8) for ids, (_, t) in zip(ids_list, pieces)] + [np.zeros(0, np.uint8)]
    )
    if len(tokens) == 0 or tokens[-1] != tokenizer.eos_id:
        tokens = np.append(tokens, tokenizer.eos_id)
        mask = np.append(mask, np.uint8(mask[-1] if len(mask) else 1))
    return tokens, mask


def read_texts(dataset: str, num_documents: int, *, text_field: str = "text") -> list[str]:
    """The texts of one source: ``builtin`` generates the bundled corpus."""
    return [p for _, p in iter_payloads([dataset], text_field=text_field, num_documents=num_documents)]


def load_documents(
    dataset: str,
    tokenizer: ByteTokenizer | HFTokenizer,
    *,
    num_documents: int,
    eval_fraction: float,
    seed: int,
    text_field: str = "text",
) -> tuple[list[list[int]], list[list[int]]]:
    """Tokenize every document of a text source and hold out a seeded random ``eval_fraction``."""
    texts = read_texts(dataset, num_documents, text_field=text_field)
    if not texts:
        raise DataError(f"data.dataset={dataset!r} holds no documents")
    docs = [tokens.tolist() for tokens, _ in encode_payloads(tokenizer, texts)]
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    n_eval = int(len(docs) * eval_fraction)
    return [docs[i] for i in order[n_eval:]], [docs[i] for i in order[:n_eval]]
