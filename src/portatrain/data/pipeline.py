"""The data stage's entry point: a ``data`` config -> tokenizer, train loader, eval loader.

What this file does:
- ``build_data(data_cfg, seed=..., dp_rank=..., dp_world_size=...)`` returns a :class:`DataPipeline`
  that the Trainer (and ``bench``, ``compile`` warm-up) use without knowing where documents come from.

Two paths, one batch contract (``collate.py``):
- a **prepared corpus** (``data.dataset`` is a directory written by ``portatrain prepare``) streams
  from memory maps through :class:`~portatrain.data.stream.StreamingLoader`: nothing is read before
  the first batch but the manifest and the first window's index entries, and each rank reads only
  its own rows. The last ``data.eval_fraction`` of its documents are held out for evaluation;
- anything else (``builtin``, files, directories, globs, ``hf:`` datasets, ``data.mix``) is read and
  tokenized in memory at start-up -- fine for small data; prepare large corpora first. Pre-training
  text keeps today's in-memory loader (``loader.build_dataloader``: whole-corpus best-fit packing,
  length-grouped sampler); fine-tuning formats (``prompt_response``, ``chat``) carry a target mask
  and go through the streaming loader over a :class:`~portatrain.data.store.MemoryCorpus`.
"""

from __future__ import annotations

import logging
import random
from typing import Any

from omegaconf import OmegaConf

from portatrain.data.documents import encode_payloads, iter_payloads
from portatrain.data.errors import DataError
from portatrain.data.loader import build_dataloader
from portatrain.data.store import MemoryCorpus, PreparedCorpus, is_prepared
from portatrain.data.stream import StreamingLoader
from portatrain.data.tokenizer import Tokenizer, build_tokenizer

logger = logging.getLogger(__name__)


def _get(cfg: Any, key: str, default: Any) -> Any:
    return getattr(cfg, key, default) if cfg is not None else default


def data_sources(data_cfg: Any) -> tuple[list[str], list[float] | None]:
    """``data.mix`` (datasets and weights) when set, else ``[data.dataset]``."""
    mix = list(_get(data_cfg, "mix", None) or [])
    if not mix:
        return [str(data_cfg.dataset)], None
    return [str(m["dataset"]) for m in mix], [float(m.get("weight", 1.0)) for m in mix]


class DataPipeline:
    """Tokenizer plus train/eval loaders for one rank (see the module docstring for the two paths)."""

    def __init__(self, data_cfg: Any, *, seed: int, dp_rank: int = 0, dp_world_size: int = 1) -> None:
        self.cfg = data_cfg
        self.seed = seed
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        sources, weights = data_sources(data_cfg)
        fmt = _get(data_cfg, "format", "text")
        self.corpus: MemoryCorpus | PreparedCorpus | None = None
        self.train_documents: list[list[int]] = []
        self.eval_documents: list[list[int]] = []
        if len(sources) == 1 and is_prepared(sources[0]):
            self.corpus = PreparedCorpus(sources[0])
            self.tokenizer = self._prepared_tokenizer(self.corpus)
            n = self.corpus.num_documents
            n_eval = int(n * float(data_cfg.eval_fraction))
            self.train_range, self.eval_range = (0, n - n_eval), (n - n_eval, n)
            return
        self.tokenizer = build_tokenizer(str(data_cfg.tokenizer))
        payloads = [
            p
            for _, p in iter_payloads(
                sources,
                weights=weights,
                seed=seed,
                text_field=_get(data_cfg, "text_field", "text"),
                format=fmt,
                num_documents=int(data_cfg.num_documents),
            )
        ]
        if not payloads:
            raise DataError(f"data.dataset={', '.join(sources)} holds no documents")
        documents = encode_payloads(self.tokenizer, payloads, fmt)
        order = list(range(len(documents)))
        random.Random(seed).shuffle(order)
        n_eval = int(len(documents) * float(data_cfg.eval_fraction))
        if fmt == "text":
            self.train_documents = [documents[i][0].tolist() for i in order[n_eval:]]
            self.eval_documents = [documents[i][0].tolist() for i in order[:n_eval]]
            return
        # Held-out documents last, so the eval range is a contiguous tail as for a prepared corpus.
        self.corpus = MemoryCorpus([documents[i] for i in order[n_eval:] + order[:n_eval]], name=sources[0])
        n = len(documents)
        self.train_range, self.eval_range = (0, n - n_eval), (n - n_eval, n)

    def _prepared_tokenizer(self, corpus: PreparedCorpus) -> Tokenizer:
        """The prepared corpus's tokenizer; ``data.tokenizer`` must name the same one."""
        recorded = corpus.tokenizer
        name = str(self.cfg.tokenizer)
        tokenizer = build_tokenizer(name)
        if tokenizer.fingerprint() != recorded and {**tokenizer.fingerprint(), "name": None} != {
            **recorded,
            "name": None,
        }:
            raise DataError(
                f"data.dataset={corpus.name} was prepared with tokenizer {recorded['name']!r} "
                f"({recorded['vocab_size']} tokens) but data.tokenizer={name!r} "
                f"({tokenizer.vocab_size} tokens); set data.tokenizer={recorded['name']} or prepare again"
            )
        return tokenizer

    @property
    def streaming(self) -> bool:
        return self.corpus is not None

    @property
    def has_eval(self) -> bool:
        if self.streaming:
            return self.eval_range[1] > self.eval_range[0]
        return bool(self.eval_documents)

    def _stream(self, doc_range: tuple[int, int], *, train: bool) -> StreamingLoader:
        cfg = self.cfg
        return StreamingLoader(
            self.corpus,
            collator=cfg.collator,
            batch_size=int(cfg.batch_size),
            seq_len=int(cfg.seq_len),
            buckets=list(cfg.buckets),
            overlong=cfg.overlong,
            sampler=cfg.sampler if train else "sequential",
            last_batch=cfg.last_batch if train else "pad",
            group_size_multiplier=int(cfg.group_size_multiplier),
            packing_attention=_get(cfg, "packing_attention", "document"),
            pad_id=self.tokenizer.pad_id,
            seed=self.seed,
            dp_rank=self.dp_rank,
            dp_world_size=self.dp_world_size,
            infinite=train,
            prefetch=int(_get(cfg, "prefetch", 2)) if train else 0,
            doc_range=doc_range,
        )

    def train_loader(self) -> Any:
        """This rank's endless training loader (``state_dict``/``load_state_dict`` resume it)."""
        if self.streaming:
            return self._stream(self.train_range, train=True)
        return self.memory_loader(self.train_documents, train=True)

    def eval_loader(self) -> Any:
        """One pass over the held-out documents, in order, the last batch padded."""
        if self.streaming:
            return self._stream(self.eval_range, train=False)
        return self.memory_loader(self.eval_documents, train=False)

    def memory_loader(self, documents: list[list[int]], *, train: bool) -> Any:
        """A loader over ``documents`` in memory (training: infinite, shuffled as configured;
        evaluation: sequential, the last batch padded)."""
        data_cfg = self.cfg
        if not train:
            data_cfg = OmegaConf.merge(
                OmegaConf.structured(data_cfg) if not OmegaConf.is_config(data_cfg) else data_cfg,
                {"sampler": "sequential", "last_batch": "pad"},
            )
        return build_dataloader(
            data_cfg,
            documents,
            pad_id=self.tokenizer.pad_id,
            seed=self.seed,
            dp_rank=self.dp_rank,
            dp_world_size=self.dp_world_size,
            infinite=train,
        )


def build_data(data_cfg: Any, *, seed: int, dp_rank: int = 0, dp_world_size: int = 1) -> DataPipeline:
    """The data stage for one rank: see :class:`DataPipeline`."""
    return DataPipeline(data_cfg, seed=seed, dp_rank=dp_rank, dp_world_size=dp_world_size)
