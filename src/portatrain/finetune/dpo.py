"""Direct preference optimization: the loss, the preference pairs and their loader.

DPO (Rafailov et al. 2023, https://arxiv.org/abs/2305.18290, eq. 7) trains the policy ``pi`` on pairs
of responses to one prompt, one ``chosen`` and one ``rejected``, against a frozen reference ``ref``::

    loss = -log sigmoid(beta * [(log pi(y_c|x) - log ref(y_c|x)) - (log pi(y_r|x) - log ref(y_r|x))])

``log pi(y|x)`` is the sum of the response tokens' log-probabilities (the prompt is not scored). The
two bracketed terms, times ``beta``, are the implicit *rewards* of the chosen and the rejected
response; their difference is the *margin*, and the *accuracy* is the share of pairs whose chosen
reward is the larger. What this file does:

* :func:`sequence_logps` / :func:`dpo_loss` -- the formula above, per pair;
* :func:`read_pairs` / :func:`encode_pairs` -- records -> token ids with the response marked:
  ``{"prompt": str, "chosen": str, "rejected": str}`` (``data.format=prompt_response`` or ``text``),
  or with ``data.format=chat`` ``{"chosen": [messages], "rejected": [messages]}`` (whole
  conversations, optionally after a shared ``"prompt": [messages]``), rendered with the tokenizer's
  chat template and trained on the assistant turns, as SFT's chat records are
  (``portatrain.data.documents``);
* :class:`PairLoader` -- batches of ``data.batch_size`` pairs per rank: the chosen rows then the
  rejected rows, each padded to ``data.seq_len`` positions, one static shape; resumable. A longer
  row loses the start of its prompt (the response is what is scored), or, when the response alone
  is longer than the row, the end of the response.

The reference's log-probabilities are computed once, before the first step, over every pair (one
no-grad forward pass over the data; 8 bytes a pair kept), by ``portatrain.dpo_trainer``. The other
choice, a frozen copy of the model scoring each batch, would hold a second set of weights for the
whole run (4 bytes a parameter in fp32, divided by the FSDP shards) and add a forward per step.
With LoRA the reference is the base model with the adapters off: no copy either way.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from portatrain.config import CompileConfig, DataConfig, DpoConfig
from portatrain.data.documents import Document, encode_payloads
from portatrain.data.errors import DataError
from portatrain.data.sources import iter_source
from portatrain.data.tokenizer import Tokenizer

IGNORE_INDEX = -100
FIX = 'DPO records look like {"prompt": "...", "chosen": "...", "rejected": "..."}'
CHAT_FIX = 'DPO chat records look like {"chosen": [messages], "rejected": [messages]}'

Pair = tuple[Any, Any]
"""``(chosen, rejected)`` payloads: ``(prompt, response)`` string pairs, or message lists (chat)."""


def dpo_problems(dpo: DpoConfig, data: DataConfig, compile: CompileConfig) -> list[str]:
    """``finetune.dpo``'s problems and its data's, each one line with the fix (every record is read)."""
    problems = []
    if not dpo.beta > 0:
        problems.append(f"finetune.dpo.beta={dpo.beta} must be positive (e.g. 0.1)")
    if list(data.mix):
        problems.append(
            "data.mix with finetune.method=dpo: preference pairs come from one data.dataset; unset data.mix"
        )
    elif data.dataset == "builtin":
        problems.append(
            "finetune.method=dpo needs preference pairs: set data.dataset to a .jsonl/.json file of "
            "records with prompt, chosen and rejected"
        )
    else:
        try:
            read_pairs(str(data.dataset), chat=data.format == "chat")
        except DataError as exc:
            problems.append(str(exc))
    if compile.enabled and compile.warmup:
        problems.append(
            "compile.warmup=true with finetune.method=dpo: the warm-up compiles the language-model batch "
            "shapes, not DPO's; set compile.warmup=false (DPO rows have one shape, compiled at step 1)"
        )
    return problems


def read_pairs(dataset: str, *, chat: bool) -> list[Pair]:
    """Every record of ``dataset`` as a :data:`Pair`; a record without ``chosen`` or ``rejected``
    (or of the wrong type) is a :class:`DataError` naming its file and line, and so are blank
    responses (how many, and the first one's line)."""
    pairs = []
    empty: dict[str, list[str]] = {}  # field -> where its response is blank
    for location, record in iter_source(dataset):
        if not isinstance(record, dict):
            raise DataError(f"{location}: the record is a {type(record).__name__}, not a JSON object; {FIX}")
        missing = [k for k in ("chosen", "rejected") if k not in record]
        if missing:
            keys = ", ".join(map(repr, list(record)[:8])) or "none"
            raise DataError(
                f"{location}: the record has no {' or '.join(map(repr, missing))} field (its fields: {keys}); "
                f"{CHAT_FIX if chat else FIX}"
            )
        kind = list if chat else str
        prompt = record.get("prompt", [] if chat else "")
        for name, value in (
            ("prompt", prompt),
            ("chosen", record["chosen"]),
            ("rejected", record["rejected"]),
        ):
            if not isinstance(value, kind):
                raise DataError(
                    f"{location}: field {name!r} is a {type(value).__name__}, not a {kind.__name__} "
                    f"(data.format={'chat' if chat else 'prompt_response'}); {CHAT_FIX if chat else FIX}"
                )
        for name in ("chosen", "rejected"):
            if _is_empty(record[name], chat=chat):
                empty.setdefault(name, []).append(str(location))
        if chat:
            pairs.append((prompt + record["chosen"], prompt + record["rejected"]))
        else:
            pairs.append(((prompt, record["chosen"]), (prompt, record["rejected"])))
    if not pairs:
        raise DataError(f"data.dataset={dataset!r} holds no preference pairs")
    if empty:
        # An empty response scores log-probability 0 (no target token but the end of text), which
        # any real response is below: the pair teaches nothing true, and accuracy reads 1.0.
        name, where = next(iter(empty.items()))
        raise DataError(
            f"data.dataset={dataset!r}: {len(where)} of {len(pairs)} records have an empty {name!r} "
            f"response (the first at {where[0]}); DPO compares two real responses: fill them in or "
            "drop those records"
        )
    return pairs


def _is_empty(response: Any, *, chat: bool) -> bool:
    """A blank response, or (chat) messages whose contents are all blank."""
    if chat:
        return not any(str(m.get("content") or "").strip() for m in response if isinstance(m, dict))
    return not response.strip()


def encode_pairs(
    tokenizer: Tokenizer, pairs: Sequence[Pair], *, chat: bool
) -> list[tuple[Document, Document]]:
    """Token ids of every pair, the response (chat: the assistant turns) marked as targets."""
    fmt = "chat" if chat else "prompt_response"
    chosen = encode_payloads(tokenizer, [c for c, _ in pairs], fmt)
    rejected = encode_payloads(tokenizer, [r for _, r in pairs], fmt)
    return list(zip(chosen, rejected, strict=True))


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``[B]``: each row's sum of log-probabilities of its target tokens (labels != -100), in fp32."""
    nll = F.cross_entropy(
        logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
    )
    return -nll.view(labels.shape).sum(-1)


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    reference_chosen: torch.Tensor,
    reference_rejected: torch.Tensor,
    beta: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per pair: ``(loss, chosen reward, rejected reward)``, the rewards detached (module docstring)."""
    chosen_reward = beta * (policy_chosen - reference_chosen)
    rejected_reward = beta * (policy_rejected - reference_rejected)
    loss = -F.logsigmoid(chosen_reward - rejected_reward)
    return loss, chosen_reward.detach(), rejected_reward.detach()


def _fit(tokens: np.ndarray, mask: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
    """At most ``length`` tokens: a long prompt loses its start (the response is what DPO scores),
    a response longer than the row its end."""
    if len(tokens) <= length:
        return tokens, mask
    first_target = int(np.argmax(mask)) if mask.any() else len(tokens)
    if len(tokens) - first_target < length:
        return tokens[-length:], mask[-length:]
    start = max(0, first_target - 1)  # the last prompt token, whose label is the response's first
    return tokens[start : start + length], mask[start : start + length]


class PairLoader:
    """This rank's batches of preference pairs: ``input_ids``/``labels`` ``[2B, S]`` (chosen rows, then
    rejected rows), ``pair_index`` ``[B]`` (the pairs' indices, for the reference's log-probabilities)
    and ``valid`` ``[B]`` (0 on the padding pairs of evaluation's last batch).

    Training shuffles the pairs each epoch (seeded), drops the last partial global batch and never
    ends; evaluation reads them once, in order, padding its last batch. Rank ``r`` of ``R`` takes the
    ``r``-th slice of each global batch of ``B * R`` pairs, so the position (``state_dict``) carries
    over to another number of ranks with the same global batch.
    """

    def __init__(
        self,
        pairs: Sequence[tuple[Document, Document]],
        indices: Sequence[int],
        *,
        batch_size: int,
        seq_len: int,
        pad_id: int,
        seed: int,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        train: bool = True,
    ) -> None:
        self.pairs, self.indices = pairs, list(indices)
        self.batch_size, self.seq_len, self.pad_id = batch_size, seq_len, pad_id
        self.seed, self.dp_rank, self.dp_world_size, self.train = seed, dp_rank, dp_world_size, train
        self.epoch, self.batch = 0, 0
        global_batch = batch_size * dp_world_size
        if train and len(self.indices) < global_batch:
            raise DataError(
                f"{len(self.indices)} training pairs are fewer than one global batch (data.batch_size="
                f"{batch_size} x {dp_world_size} data-parallel ranks); lower data.batch_size or add pairs"
            )

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch": self.batch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.batch = int(state["epoch"]), int(state["batch"])

    def _order(self) -> list[int]:
        if not self.train:
            return self.indices
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return [self.indices[i] for i in torch.randperm(len(self.indices), generator=generator).tolist()]

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        global_batch = self.batch_size * self.dp_world_size
        while True:
            order = self._order()
            n_batches = len(order) // global_batch if self.train else -(-len(order) // global_batch)
            while self.batch < n_batches:
                start = self.batch * global_batch + self.dp_rank * self.batch_size
                chunk = order[start : start + self.batch_size]
                self.batch += 1
                yield self._collate(chunk)
            self.epoch, self.batch = self.epoch + 1, 0
            if not self.train:
                return

    def _collate(self, chunk: list[int]) -> dict[str, torch.Tensor]:
        n, seq = self.batch_size, self.seq_len
        input_ids = np.full((2 * n, seq), self.pad_id, dtype=np.int64)
        labels = np.full((2 * n, seq), IGNORE_INDEX, dtype=np.int64)
        for i, index in enumerate(chunk):
            for row, (tokens, mask) in ((i, self.pairs[index][0]), (n + i, self.pairs[index][1])):
                tokens, mask = _fit(tokens, mask, seq + 1)
                length = len(tokens) - 1
                input_ids[row, :length] = tokens[:-1]
                labels[row, :length] = np.where(mask[1:] == 1, tokens[1:], IGNORE_INDEX)
        pair_index = np.full(n, -1, dtype=np.int64)
        pair_index[: len(chunk)] = chunk
        return {
            "input_ids": torch.from_numpy(input_ids),
            "labels": torch.from_numpy(labels),
            "pair_index": torch.from_numpy(pair_index),
            "valid": torch.from_numpy((pair_index >= 0).astype(np.float32)),
        }
