"""The data path, measured: prepare throughput, loader throughput per collator, time to first batch
and peak memory as the corpus grows, and packing attention ``document`` vs ``causal``.

    python scripts/bench_data.py             # a few minutes on 2 CPU cores
    python scripts/bench_data.py --quick     # smaller sizes, under a minute

Sections (each printed as a table):

1. ``prepare``: tokens/s of ``portatrain.data.prepare.prepare`` with the byte tokenizer and with a
   byte-level BPE tokenizer (Llama-3-style pre-tokenizer, 8k vocabulary, trained here), on one
   worker and on every core; per-core figures divide by the worker count.
2. ``loader``: real (labelled) tokens/s of the streaming loader over prepared shards, in one
   process with prefetching off (the loader's own cost), per collator at ``seq_len=2048``, batch 8,
   with the padding waste (share of positions that are padding). ``packing_attention=document``
   batches carry document ids; the ``[B, 1, S, S]`` mask is built where the batch is used, timed in
   section 5.
3. ``scale``: time to the first batch and peak resident memory of a fresh process that opens a
   prepared corpus of 10M and 100M tokens and reads 200 batches -- flat in the corpus size.
4. ``attention``: forward+backward of the debug Llama on packed rows with the document mask
   (``packing_attention=document``) vs plain causal (``causal``), same tokens.
5. ``mask``: ``collate.document_causal_mask`` (what the Trainer runs on the device after moving a
   packed batch) for one batch of 8 x 2048, on the CPU and, where present, on CUDA.

Corpora for sections 2-3 are written straight into the prepared layout (random token ids with
log-normal document lengths) so their size costs seconds, not a prepare run; section 1 measures
prepare itself on generated text.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

WORDS = (  # noqa: SIM905 (a word list reads better as one string)
    "the of and to in is was for on that with as by at from his her it an were are which this be or "
    "has had not but they their one all new more two first after who been also time its over only year "
    "river market garden bridge forest lamp letter basket drum otter crow hare wolf quick quiet bright"
).split()


def write_text_corpus(path: Path, num_chars: int, seed: int = 0) -> int:
    """JSONL of random-word documents (log-normal lengths) totalling about ``num_chars`` characters."""
    rng = np.random.default_rng(seed)
    words = np.array(WORDS)
    written = 0
    with path.open("w") as f:
        while written < num_chars:
            n = int(min(4000, max(5, rng.lognormal(np.log(150), 1.0))))
            text = " ".join(words[rng.integers(0, len(words), n)])
            f.write(json.dumps({"text": text}) + "\n")
            written += len(text)
    return written


def write_prepared(out: Path, num_tokens: int, *, vocab: int = 32_000, seed: int = 0) -> None:
    """A prepared corpus of random ids, document lengths log-normal around 600 tokens (16..8192)."""
    from portatrain.data.prepare import _json_bytes

    out.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    shards, left, index = [], num_tokens, 0
    while left > 0:
        n_tok = min(left, 10_000_000)
        lengths = np.clip(rng.lognormal(np.log(600), 1.0, size=n_tok // 300 + 1), 16, 8192).astype(np.int64)
        lengths = lengths[np.cumsum(lengths) <= n_tok]
        if len(lengths) == 0:  # less than one document left: the corpus is complete
            break
        n_tok = int(lengths.sum())
        name = f"shard_{index:05d}"
        rng.integers(0, vocab, n_tok, dtype=np.uint16).tofile(out / f"{name}.bin")
        np.concatenate([[0], np.cumsum(lengths)]).astype("<i8").tofile(out / f"{name}.idx")
        shards.append({"name": name, "documents": len(lengths), "tokens": n_tok, "sha256": {}})
        left -= n_tok
        index += 1
    manifest = {
        "format_version": 1,
        "dtype": "uint16",
        "has_mask": False,
        "shards": shards,
        "documents": sum(s["documents"] for s in shards),
        "tokens": sum(s["tokens"] for s in shards),
        "tokenizer": {"name": "synthetic", "vocab_size": vocab},
    }
    (out / "manifest.json").write_bytes(_json_bytes(manifest))


def make_bpe(out: Path, texts_file: Path) -> Path:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    pattern = (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+"
    )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=8000,
        special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    with texts_file.open() as f:
        tok.train_from_iterator((json.loads(line)["text"] for _, line in zip(range(2000), f)), trainer)
    out.mkdir(parents=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"})
    )
    return out


def bench_prepare(tmp: Path, num_chars: int) -> None:
    from portatrain.data.prepare import prepare

    src = tmp / "text.jsonl"
    write_text_corpus(src, num_chars)
    bpe = make_bpe(tmp / "bpe", src)
    cores = os.cpu_count() or 1
    print(f"\n## prepare ({num_chars / 1e6:.0f}M characters of text, {cores} cores)")
    print("| tokenizer | workers | tokens | seconds | tokens/s | tokens/s per core |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, tokenizer in (("byte", "byte"), ("BPE 8k (Llama-3 split)", str(bpe))):
        for workers in sorted({1, cores}):
            out = tmp / f"prep-{len(os.listdir(tmp))}"
            start = time.perf_counter()
            manifest = prepare(
                [str(src)],
                out,
                tokenizer=tokenizer,
                workers=workers,
                shard_chars=num_chars // 8,
                progress=False,
            )
            elapsed = time.perf_counter() - start
            rate = manifest["tokens"] / elapsed
            print(
                f"| {name} | {workers} | {manifest['tokens']:,} | {elapsed:.2f} | {rate / 1e6:.2f}M | {rate / workers / 1e6:.2f}M |"
            )


def _loader(corpus, collator: str, attention: str = "document", prefetch: int = 0):
    from portatrain.data.stream import StreamingLoader

    return StreamingLoader(
        corpus,
        collator=collator,
        batch_size=8,
        seq_len=2048,
        buckets=[256, 512, 1024, 2048],
        pad_id=0,
        seed=0,
        packing_attention=attention,
        prefetch=prefetch,
    )


def bench_loader(corpus_dir: Path, seconds: float) -> None:
    from portatrain.data.store import PreparedCorpus

    print("\n## loader (one process, prefetch off, seq_len 2048, batch 8, sampler length_grouped)")
    print("| collator | real tokens/s | padding waste | batches |")
    print("| --- | ---: | ---: | ---: |")
    for collator, attention in (
        ("packing", "document"),
        ("packing", "causal"),
        ("bucket", "document"),
        ("pad_to_max", "document"),
    ):
        corpus = PreparedCorpus(corpus_dir)
        it = iter(_loader(corpus, collator, attention))
        next(it)  # the first window
        real = total = batches = 0
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            batch = next(it)
            labels = batch["labels"]
            real += int((labels != -100).sum())
            total += labels.numel()
            batches += 1
        rate = real / (time.perf_counter() - start)
        label = f"{collator} ({attention} attention)" if collator == "packing" else collator
        print(f"| {label} | {rate / 1e6:.2f}M | {1 - real / total:.1%} | {batches} |")


def _scale_child(corpus_dir: str) -> None:
    """Run in a fresh process: time to first batch (after imports), 200 batches, peak RSS."""
    import torch  # noqa: F401  (imports are not the loader's time)

    from portatrain.data.store import PreparedCorpus

    start = time.perf_counter()

    corpus = PreparedCorpus(corpus_dir)
    it = iter(_loader(corpus, "packing", prefetch=2))
    next(it)
    first = time.perf_counter() - start
    for _ in range(200):
        next(it)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    # Resident memory splits into private (anonymous) pages and file pages mapped from the shards:
    # the latter are the page cache, shared and reclaimable, and grow with what was read, not held.
    status = dict(
        line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line
    )
    anon = int(status.get("RssAnon", "0 kB").split()[0]) / 1024
    mapped = int(status.get("RssFile", "0 kB").split()[0]) / 1024
    print(
        json.dumps(
            {
                "first_batch_s": first,
                "peak_rss_mb": rss,
                "anon_mb": anon,
                "file_mb": mapped,
                "tokens": corpus.num_tokens,
            }
        )
    )


def bench_scale(tmp: Path, sizes: list[int]) -> None:
    print(
        "\n## scale (fresh process: open the prepared corpus, first batch, 200 more; packing, seq_len 2048)"
    )
    print(
        "| corpus tokens | documents | time to first batch | peak RSS | of it private (anon) | of it mapped shard pages |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for size in sizes:
        out = tmp / f"scale-{size}"
        write_prepared(out, size)
        docs = json.loads((out / "manifest.json").read_text())["documents"]
        proc = subprocess.run(
            [sys.executable, __file__, "--scale-child", str(out)], capture_output=True, text=True, check=True
        )
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        print(
            f"| {r['tokens'] / 1e6:.0f}M | {docs:,} | {r['first_batch_s']:.2f} s | {r['peak_rss_mb']:.0f} MB "
            f"| {r['anon_mb']:.0f} MB | {r['file_mb']:.0f} MB |"
        )


def bench_attention(corpus_dir: Path, steps: int) -> None:
    import torch

    from portatrain.config import ModelConfig
    from portatrain.data.collate import with_attention_mask
    from portatrain.data.store import PreparedCorpus
    from portatrain.models import build_model

    print("\n## attention (debug Llama, fp32, forward+backward of one packed batch of 4 x 512, CPU)")
    print("| packing_attention | ms per step |")
    print("| --- | ---: |")
    torch.manual_seed(0)
    model = build_model(ModelConfig(flavor="debug"), vocab_size=1024)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(0.02)
    from portatrain.data.stream import StreamingLoader

    for attention in ("document", "causal"):
        loader = StreamingLoader(
            PreparedCorpus(corpus_dir),
            collator="packing",
            batch_size=4,
            seq_len=512,
            pad_id=0,
            packing_attention=attention,
        )
        batch = with_attention_mask(next(iter(loader)))  # the mask, as the Trainer builds it
        # A small vocabulary: the step is attention and MLPs, not the head.
        batch["input_ids"] = batch["input_ids"] % model.embed_tokens.num_embeddings
        times = []
        for _ in range(steps + 1):
            start = time.perf_counter()
            logits = model(batch["input_ids"], positions=batch["positions"], attn_mask=batch.get("attn_mask"))
            logits.float().sum().backward()
            times.append(time.perf_counter() - start)
        print(f"| {attention} | {1000 * sorted(times[1:])[len(times[1:]) // 2]:.0f} |")


def bench_mask(corpus_dir: Path, repeats: int) -> None:
    import torch

    from portatrain.data.collate import document_causal_mask
    from portatrain.data.store import PreparedCorpus

    batch = next(iter(_loader(PreparedCorpus(corpus_dir), "packing")))
    ids, real = batch["document_ids"], int((batch["labels"] != -100).sum())
    print(f"\n## mask (document_causal_mask of one packed batch {tuple(ids.shape)}, bool [B, 1, S, S] out)")
    print("| device | ms per batch | real tokens/s it could serve |")
    print("| --- | ---: | ---: |")
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        on_device = ids.to(device)
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        document_causal_mask(on_device)  # first call: allocator, kernel load
        sync()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            document_causal_mask(on_device)
            sync()
            times.append(time.perf_counter() - start)
        median = sorted(times)[len(times) // 2]
        print(f"| {device} | {1000 * median:.3f} | {real / median / 1e6:.2f}M |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes (under a minute)")
    parser.add_argument("--scale-child", help=argparse.SUPPRESS)
    parser.add_argument(
        "--skip", nargs="*", default=[], choices=["prepare", "loader", "scale", "attention", "mask"]
    )
    args = parser.parse_args()
    if args.scale_child:
        _scale_child(args.scale_child)
        return
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="bench_data-") as tmp_str:
        tmp = Path(tmp_str)
        if "prepare" not in args.skip:
            bench_prepare(tmp, 4_000_000 if args.quick else 40_000_000)
        corpus = tmp / "loader-corpus"
        write_prepared(corpus, 5_000_000 if args.quick else 20_000_000)
        if "loader" not in args.skip:
            bench_loader(corpus, 1.0 if args.quick else 5.0)
        if "scale" not in args.skip:
            bench_scale(tmp, [10_000_000] if args.quick else [10_000_000, 100_000_000])
        if "attention" not in args.skip:
            bench_attention(corpus, 2 if args.quick else 5)
        if "mask" not in args.skip:
            bench_mask(corpus, 10 if args.quick else 50)


if __name__ == "__main__":
    main()
