"""``portatrain prepare out=DIR [data.dataset=...] [data.tokenizer=...]``: tokenize a corpus once into
memory-mapped shards (``portatrain.data.prepare``); train on it with ``data.dataset=DIR``."""

from __future__ import annotations

from portatrain.commands import CommandContext
from portatrain.config import Config

SHORTHANDS = {"out": "prepare.out", "workers": "prepare.workers"}

SECTIONS = ("prepare", "data")
EXAMPLE = "portatrain prepare out=data/mycorpus data.dataset='corpus/*.jsonl' data.tokenizer=byte"


def run(cfg: Config, ctx: CommandContext) -> None:
    from portatrain.data.errors import DataError
    from portatrain.data.pipeline import data_sources
    from portatrain.data.prepare import prepare, verify

    if not cfg.prepare.out:
        raise DataError("portatrain prepare needs out=DIR: the directory to write the prepared corpus to")
    sources, weights = data_sources(cfg.data)
    manifest = prepare(
        sources,
        cfg.prepare.out,
        tokenizer=str(cfg.data.tokenizer),
        weights=weights,
        seed=int(cfg.trainer.seed),
        text_field=str(cfg.data.text_field),
        format=str(cfg.data.format),
        num_documents=int(cfg.data.num_documents),
        workers=int(cfg.prepare.workers),
        shard_chars=int(cfg.prepare.shard_chars),
        progress=bool(cfg.trainer.progress),
    )
    if cfg.prepare.verify:
        verify(cfg.prepare.out)
    print(
        f"prepared {manifest['documents']:,} documents, {manifest['tokens']:,} tokens ({manifest['dtype']}, "
        f"{len(manifest['shards'])} shard(s)) in {cfg.prepare.out}; train with data.dataset={cfg.prepare.out}"
    )
