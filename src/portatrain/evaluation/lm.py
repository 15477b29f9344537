"""portatrain's model as an lm-evaluation-harness ``LM``: log-likelihoods and greedy generation.

:class:`PortatrainLM` is a ``lm_eval.api.model.TemplateLM`` (the base of lm-eval's own Hugging Face
model, ``lm_eval/models/huggingface.py``'s ``HFLM``) around a *forward function* -- token ids
``[B, S]`` (and optionally RoPE positions and an attention mask) to logits ``[B, S, vocab]`` -- and a
portatrain tokenizer. It knows nothing of devices, meshes or checkpoints: the caller (``portatrain
eval``, or the Trainer between steps) hands it the model's forward under its own autocast, with the
model already sharded however the run shards it.

It scores requests the way ``HFLM`` does, so per-sample numbers are comparable with lm-eval's HF
model on the exported checkpoint (a test holds them equal within 1e-4):

- ``loglikelihood``: ``TemplateLM`` splits ``context + continuation`` into tokens (an empty context
  becomes the prefix token: BOS, else EOS); the input is ``(context + continuation)[-(max_length+1):-1]``,
  right-padded in a batch (causal attention: padding on the right changes nothing before it), and the
  result is the summed log-probability of the continuation and whether greedy decoding produces it.
- ``loglikelihood_rolling``: lm-eval's disjoint rolling windows of ``max_length`` tokens (each token
  predicted once, every window given as much context as fits), summed per document.
- ``generate_until``: greedy decoding, left-padded batches (RoPE positions start at each row's first
  real token, padding masked out), until a stop string, EOS or ``max_gen_toks``. There is no KV
  cache: each new token re-runs the batch's whole sequence, which is fine for the short answers
  evaluation tasks ask for.

Tokens are encoded like a Hugging Face tokenizer with ``add_special_tokens=True`` (what ``HFLM`` does
for a causal model): BOS first when the tokenizer has one -- the way portatrain's training documents
start too.

Every rank of a sharded model must run the same forwards: the adapter reports ``rank=0`` and
``world_size=1`` to lm-eval on every rank, so each rank evaluates every request (only rank 0 logs).
Rows are padded to a multiple of ``pad_multiple`` positions (tensor parallel shards the sequence).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import Collator, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

logger = logging.getLogger(__name__)

Forward = Callable[..., torch.Tensor]
"""``forward(tokens, positions=None, attn_mask=None) -> logits``, as ``Decoder.forward``."""

# (request key or None, context tokens, continuation tokens): TemplateLM's token-level request.
TokenRequest = tuple[Any, list[int], list[int]]


class PortatrainLM(TemplateLM):
    """An lm-eval model over ``forward`` and a portatrain tokenizer (see the module docstring).

    Args:
        forward: the model's forward (eval mode, no grad, under the run's autocast: the caller's job).
        tokenizer: a ``portatrain.data.tokenizer`` tokenizer (``encode``/``decode``, ``bos_id``, ``eos_id``).
        max_length: the longest input in tokens (the model's ``max_seq_len``).
        device: where input ids are placed.
        batch_size: requests per forward.
        max_gen_toks: default generation budget when a task sets none (lm-eval's default is 256).
        pad_multiple: rows are padded to a multiple of this many positions (tensor parallel degree).
        progress: show progress bars (off between training steps).
    """

    def __init__(
        self,
        forward: Forward,
        tokenizer: Any,
        *,
        max_length: int,
        device: torch.device | str = "cpu",
        batch_size: int = 8,
        max_gen_toks: int = 256,
        pad_multiple: int = 1,
        progress: bool = True,
    ) -> None:
        super().__init__()
        self._forward = forward
        self.tokenizer = tokenizer
        self._max_length = int(max_length)
        self._device = torch.device(device)
        self.batch_size = int(batch_size)
        self.max_gen_toks = int(max_gen_toks)
        self.pad_multiple = max(int(pad_multiple), 1)
        self.progress = progress
        self.pad_id = int(getattr(tokenizer, "pad_id", tokenizer.eos_id))

    # -- what lm-eval asks of a model --------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return int(self.tokenizer.eos_id)

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_id
        return int(bos) if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name", "portatrain")).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """Token ids of ``string``; BOS first unless ``add_special_tokens`` is False (as HF's ``encode``)."""
        return self.tokenizer.encode(string, bos=add_special_tokens is not False, eos=False)

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens)

    # -- scoring -----------------------------------------------------------------------------------
    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm or not self.progress)

    def _loglikelihood_tokens(
        self, requests: list[TokenRequest], disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        """Summed log-probability of each continuation given its context, and whether it is greedy."""

        def longest_first(req: TokenRequest) -> tuple[int, tuple[int, ...]]:
            toks = req[1] + req[2]
            return -len(toks), tuple(toks)

        order = Collator(requests, sort_fn=longest_first)
        results: list[tuple[float, bool]] = []
        bar = tqdm(
            total=len(requests), disable=disable_tqdm or not self.progress, desc="loglikelihood requests"
        )
        for chunk in order.get_batched(n=self.batch_size):
            # The input drops the last token (it is only predicted) and keeps the last max_length.
            inputs = [(ctx + cont)[-(self.max_length + 1) :][:-1] for _, ctx, cont in chunk]
            logprobs = self._logprobs(self._right_padded(inputs))
            for (key, _, cont), row, logp in zip(chunk, inputs, logprobs):
                scored = logp[len(row) - len(cont) : len(row)]  # the positions predicting ``cont``
                target = torch.tensor(cont, dtype=torch.long, device=scored.device)
                greedy = bool((scored.argmax(dim=-1) == target).all())
                answer = (float(scored.gather(-1, target[:, None]).sum()), greedy)
                results.append(answer)
                if key is not None:
                    self.cache_hook.add_partial("loglikelihood", key, answer)
                bar.update(1)
        bar.close()
        return order.get_original(results)

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of each whole document, over lm-eval's disjoint rolling windows."""
        windows: list[TokenRequest] = []
        counts = []
        for (text,) in (req.args for req in requests):
            doc_windows = [
                (None, *make_disjoint_window(w))
                for w in get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                )
            ]
            windows += doc_windows
            counts.append(len(doc_windows))
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals, start = [], 0
        for req, count in zip(requests, counts):
            total = sum(logp for logp, _ in scores[start : start + count])
            start += count
            totals.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations, cut at the first stop string (lm-eval's ``until``)."""

        def longest_first(req: tuple[str, dict]) -> tuple[int, str]:
            return -len(self.tok_encode(req[0])), req[0]

        order = Collator([req.args for req in requests], sort_fn=longest_first, group_by="gen_kwargs")
        results: list[str] = []
        bar = tqdm(
            total=len(requests), disable=disable_tqdm or not self.progress, desc="generate_until requests"
        )
        for chunk in order.get_batched(n=self.batch_size):
            contexts = [context for context, _ in chunk]
            settings = normalize_gen_kwargs(chunk[0][1], self.max_gen_toks)  # one kind per chunk
            if settings.get("do_sample"):
                raise ValueError(
                    f"generation settings {chunk[0][1]} ask for sampling; portatrain eval decodes greedily "
                    "only (set do_sample: false in the task's generation_kwargs)"
                )
            until = [s for s in settings["until"] if s]
            max_new = int(settings["max_gen_toks"])
            if max_new >= self.max_length:
                raise ValueError(
                    f"max_gen_toks={max_new} leaves no room for a context within the model's "
                    f"{self.max_length} positions; lower it in the task's generation_kwargs"
                )
            prompts = [self.tok_encode(c)[-(self.max_length - max_new) :] for c in contexts]
            for context, generated in zip(contexts, self._greedy(prompts, max_new, until)):
                text = postprocess_generated_text(self.tok_decode(generated), until, None)
                results.append(text)
                self.cache_hook.add_partial("generate_until", (context, chunk[0][1]), text)
                bar.update(1)
        bar.close()
        return order.get_original(results)

    # -- model calls -------------------------------------------------------------------------------
    def _padded_length(self, longest: int) -> int:
        return -(-longest // self.pad_multiple) * self.pad_multiple

    def _right_padded(self, rows: list[list[int]]) -> torch.Tensor:
        width = self._padded_length(max(len(r) for r in rows))
        return torch.tensor([r + [self.pad_id] * (width - len(r)) for r in rows], dtype=torch.long)

    def _logprobs(self, tokens: torch.Tensor) -> torch.Tensor:
        """Log-softmax over the vocabulary, in fp32, of every position of ``tokens``."""
        logits = self._forward(tokens.to(self._device))
        return F.log_softmax(logits.float(), dim=-1)

    def _greedy(self, prompts: list[list[int]], max_new: int, until: list[str]) -> list[list[int]]:
        """Generate up to ``max_new`` tokens after each prompt, stopping a row at EOS or a stop string."""
        generated: list[list[int]] = [[] for _ in prompts]
        done = [False] * len(prompts)
        for _ in range(max_new):
            rows = [p + g for p, g in zip(prompts, generated)]
            width = self._padded_length(max(len(r) for r in rows))
            pads = [width - len(r) for r in rows]
            tokens = torch.tensor([[self.pad_id] * n + r for n, r in zip(pads, rows)], dtype=torch.long)
            real = tokens.new_ones(tokens.shape, dtype=torch.bool)
            for i, n in enumerate(pads):
                real[i, :n] = False
            # Positions count real tokens only; a query attends to earlier real tokens (and to itself,
            # so that a padding row is never all masked: SDPA would return NaN there).
            positions = (real.long().cumsum(-1) - 1).clamp(min=0)
            causal = torch.ones(width, width, dtype=torch.bool).tril()
            mask = (causal & (real[:, None, :] | torch.eye(width, dtype=torch.bool)))[:, None]
            logits = self._forward(
                tokens.to(self._device),
                positions=positions.to(self._device),
                attn_mask=mask.to(self._device),
            )
            next_ids = logits[:, -1].argmax(dim=-1).tolist()
            for i, token in enumerate(next_ids):
                if done[i]:
                    continue
                if token == self.eot_token_id:
                    done[i] = True
                    continue
                generated[i].append(token)
                if until and any(stop in self.tok_decode(generated[i]) for stop in until):
                    done[i] = True
            if all(done):
                break
        return generated
