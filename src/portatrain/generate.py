"""``portatrain generate``: text from a checkpoint's model, greedy or sampled, over a static-shape KV cache.

What this file does:

- :func:`generate_command` is the CLI command: ``portatrain generate checkpoint=PATH|auto prompt=TEXT``.
  It loads the checkpoint's model and tokenizer as ``portatrain eval`` does
  (:func:`portatrain.evaluation.model.load_checkpoint_model`: the family, arguments and tokenizer
  the checkpoint records, on the configured device), generates and prints the continuation.
- :class:`Generation` decodes with one model: a prefill of the prompt, then one forward per token,
  each writing its keys and values into a :class:`~portatrain.models.common.kv_cache.KVCache` and
  attending over all of it. The cache is preallocated to prompt + ``max_new_tokens`` rounded up
  to ``generate.bucket`` positions (:func:`cache_length`), and the prompt is right-padded to a bucket
  too, so the decode step sees the same shapes for every token and every prompt of a bucket: with
  ``compile.enabled=true`` it is compiled once per cache length (``dynamic=False``, the adapter's
  backend), which is what XLA-style compilers need. The prefill runs eagerly: it allocates the cache.
- :func:`next_token` picks a token: greedy at ``temperature=0``, else sampled after temperature,
  top-k and top-p (nucleus, Holtzman et al. 2019, https://arxiv.org/abs/1904.09751) filtering, the
  order Hugging Face's ``generate`` applies them in.
- :func:`generate_problems` checks the ``generate`` section for the validator; what needs the
  checkpoint (an empty prompt, a prompt too long for the model) is checked by the command.

Each new token is read back to the host, to stop at EOS: one sync per token, inherent to stopping.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from portatrain.config import Config, GenerateConfig
from portatrain.errors import ConfigError
from portatrain.models.common.kv_cache import KVCache

logger = logging.getLogger(__name__)


def generate_problems(cfg: GenerateConfig) -> list[str]:
    """The problems of the ``generate`` section, each with its fix (for ``portatrain.validate``)."""
    problems = []
    if cfg.max_new_tokens <= 0:
        problems.append(f"generate.max_new_tokens={cfg.max_new_tokens} must be positive, e.g. 64")
    if cfg.temperature < 0:
        problems.append(f"generate.temperature={cfg.temperature} must be >= 0 (0: greedy; 0.7-1.0 samples)")
    if cfg.top_k < 0:
        problems.append(f"generate.top_k={cfg.top_k} must be >= 0 (0: no top-k filter)")
    if not 0 < cfg.top_p <= 1:
        problems.append(f"generate.top_p={cfg.top_p} must be in (0, 1] (1: no nucleus filter), e.g. 0.9")
    if cfg.bucket <= 0:
        problems.append(f"generate.bucket={cfg.bucket} must be positive, e.g. 256")
    return problems


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def cache_length(positions: int, bucket: int, max_seq_len: int) -> int:
    """The KV cache's length for ``positions`` positions: a multiple of ``bucket``, at most ``max_seq_len``."""
    return min(_round_up(positions, bucket), max_seq_len)


def next_token(logits: torch.Tensor, settings: GenerateConfig) -> torch.Tensor:
    """The next token of each row of ``logits [B, vocab]``: ``[B]`` ids.

    ``temperature=0`` is the argmax. Otherwise the logits are divided by the temperature, all but the
    ``top_k`` largest dropped, then all but the most likely tokens whose probabilities reach ``top_p``
    (the token that crosses it is kept, so one always is), and a token drawn from the rest with
    torch's default generator (seeded by the caller). Every shape is the vocabulary's: nothing here
    depends on the values, so it runs on the device without a host read.
    """
    if settings.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / settings.temperature
    if 0 < settings.top_k < logits.shape[-1]:
        kth = logits.topk(settings.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if settings.top_p < 1:
        ordered, order = logits.sort(dim=-1, descending=True)
        probs = ordered.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # the mass of the more likely tokens
        ordered = ordered.masked_fill(before >= settings.top_p, float("-inf"))
        logits = logits.scatter(-1, order, ordered)
    return torch.multinomial(logits.softmax(dim=-1), num_samples=1).squeeze(-1)


def _last_logits(
    model: nn.Module, tokens: torch.Tensor, positions: torch.Tensor, last: torch.Tensor, cache: KVCache
) -> torch.Tensor:
    """Logits ``[B, vocab]`` of position ``last`` (a one-element index) of a cached forward: the
    projection through ``output_fn`` on that position only, not the whole (padded) prompt."""

    def project(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden.index_select(1, last).squeeze(1), weight)

    return model(tokens, positions=positions, output_fn=project, cache=cache)


@dataclass
class GenerationStats:
    """What one :meth:`Generation.generate` did, for the log line."""

    prompt_tokens: int
    new_tokens: int
    cache_positions: int
    cache_bytes: int
    prefill_s: float
    """The prompt's forward (eager) and the first token."""
    first_step_s: float
    """The first decode step: where it compiles, its compilation too."""
    decode_s: float
    """Every decode step after the first."""

    @property
    def tokens_per_s(self) -> float:
        """Steady decoding speed: the steps after the first (0 with fewer than two)."""
        steps = self.new_tokens - 2  # the prefill gave the first token, the first step the second
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else 0.0


class Generation:
    """Greedy or sampled decoding with ``model`` (a family's decoder, eval mode, loaded); reusable
    across prompts, so the compiled decode step is too.

    Args:
        model: the model, called as ``model(tokens, positions=, output_fn=, cache=)``.
        eos_id, pad_id: the tokenizer's end of text (generation stops there) and padding ids.
        dtype: the compute dtype (autocast on the model's device unless fp32).
        compile_backend: compile the decode step with this ``torch.compile`` backend
            (``dynamic=False``: one graph per cache length); None runs it eagerly.
        manual_seed: seeds the host and device generators before sampling (the accelerator
            adapter's ``manual_seed``).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        eos_id: int,
        pad_id: int,
        dtype: torch.dtype = torch.float32,
        compile_backend: str | None = None,
        manual_seed: Callable[[int], None] = torch.manual_seed,
    ) -> None:
        if getattr(model.args, "attention_sinks", False):
            raise ConfigError(
                "this checkpoint's model has attention sinks (GPT-OSS), which portatrain generate's KV cache "
                "does not implement yet; export it (portatrain export) and generate with transformers"
            )
        self.model = model
        self.eos_id, self.pad_id = eos_id, pad_id
        self.dtype = dtype
        self.manual_seed = manual_seed
        self.device = next(model.parameters()).device
        # Shapes are bucketed on purpose: static, so a new cache length is a new graph rather than
        # torch's switch to a dynamic-shape graph after the second shape (which XLA cannot use).
        self.decode_step = (
            _last_logits
            if compile_backend is None
            else torch.compile(_last_logits, backend=compile_backend, dynamic=False)
        )
        self.stats: GenerationStats | None = None

    @torch.no_grad()
    def generate(self, prompt: list[int], settings: GenerateConfig) -> list[int]:
        """Up to ``settings.max_new_tokens`` token ids after ``prompt`` (ids), stopping before EOS."""
        max_seq_len = self.model.args.max_seq_len
        if not prompt:
            raise ConfigError("the prompt encodes to no tokens; give generate.prompt some text")
        if len(prompt) + settings.max_new_tokens > max_seq_len:
            raise ConfigError(
                f"the prompt ({len(prompt)} tokens) + generate.max_new_tokens={settings.max_new_tokens} "
                f"exceeds the model's max_seq_len={max_seq_len}; set generate.max_new_tokens<="
                f"{max(max_seq_len - len(prompt), 0)} or shorten the prompt"
            )
        length = cache_length(len(prompt) + settings.max_new_tokens, settings.bucket, max_seq_len)
        cache = KVCache(length)
        padded = min(_round_up(len(prompt), settings.bucket), length)
        tokens = torch.tensor([prompt + [self.pad_id] * (padded - len(prompt))], device=self.device)
        position = torch.tensor([len(prompt)], device=self.device)  # where the next token goes
        first = torch.zeros(1, dtype=torch.long, device=self.device)  # the one position a step projects
        self.manual_seed(settings.seed)
        generated: list[int] = []
        start = time.perf_counter()
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32):
            # The prefill: the padded prompt's keys and values fill the cache from slot 0 (the
            # padding's slots are overwritten by the tokens generated there before anything reads them).
            logits = _last_logits(
                self.model, tokens, torch.arange(padded, device=self.device), position - 1, cache
            )
            token = next_token(logits, settings)
            marks = []  # when the prefill's token, then the first step's, was read back
            while True:
                value = int(token)  # the host read: stop at EOS
                if len(marks) < 2:
                    marks.append(time.perf_counter())
                if value == self.eos_id:
                    break
                generated.append(value)
                if len(generated) == settings.max_new_tokens:
                    break
                logits = self.decode_step(self.model, token.view(1, 1), position, first, cache)
                position += 1
                token = next_token(logits, settings)
        done = time.perf_counter()
        prefilled, stepped = [*marks, done][:2]
        self.stats = GenerationStats(
            prompt_tokens=len(prompt),
            new_tokens=len(generated),
            cache_positions=length,
            cache_bytes=cache.nbytes,
            prefill_s=prefilled - start,
            first_step_s=stepped - prefilled,
            decode_s=done - stepped,
        )
        return generated


def generate_command(cfg: Config) -> str:
    """The ``generate`` subcommand: load ``generate.checkpoint``, continue ``generate.prompt``, print it."""
    from portatrain.checkpoint import find_checkpoint
    from portatrain.compile import compile_options
    from portatrain.evaluation.model import load_checkpoint_model

    settings = cfg.generate
    if not settings.prompt:
        raise ConfigError(
            'generate.prompt is empty: give the text to continue, e.g. prompt="Once upon a time"'
        )
    checkpoint = find_checkpoint(settings.checkpoint, Path(cfg.run_dir))
    loaded = load_checkpoint_model(cfg, checkpoint)
    prompt = loaded.tokenizer.encode(settings.prompt, bos=True, eos=False)
    backend = compile_options(cfg.compile, loaded.accelerator)[0] if cfg.compile.enabled else None
    generation = Generation(
        loaded.model,
        eos_id=loaded.tokenizer.eos_id,
        pad_id=loaded.tokenizer.pad_id,
        dtype=loaded.dtype,
        compile_backend=backend,
        manual_seed=loaded.accelerator.manual_seed,
    )
    text = loaded.tokenizer.decode(generation.generate(prompt, settings))
    _log(checkpoint, generation.stats)
    print(text)
    return text


def _log(checkpoint: Path, stats: GenerationStats) -> None:
    logger.info(
        "%s: %d prompt tokens, %d generated; prefill %.3f s, first decode step %.3f s, then %.1f tokens/s; "
        "KV cache %d positions, %.1f MB",
        checkpoint,
        stats.prompt_tokens,
        stats.new_tokens,
        stats.prefill_s,
        stats.first_step_s,
        stats.tokens_per_s,
        stats.cache_positions,
        stats.cache_bytes / 1e6,
    )
