"""A CUDA-first training script, of the kind teams bring to portatrain. Do not copy it.

It trains a small GPT (label-smoothed next-byte prediction) on a text file, written the way much
research code is: one NVIDIA GPU per process, launched with ``torchrun``, mixed precision with
``torch.cuda.amp``, an optional flash-attn kernel, hand-rolled attention as the fallback, batches
padded to their own longest line, timing with CUDA events, the loss read every step, pickled
configs. It runs -- on NVIDIA. This is the *before* of the README's worked example:

    portatrain audit examples/cuda_first_train.py      # what breaks or slows down off NVIDIA
    portatrain audit examples/ported_train.py          # the same training on portatrain: clean

    torchrun --nproc-per-node 8 examples/cuda_first_train.py --data corpus.txt   # (NVIDIA only)
"""

import argparse
import math
import os
import pickle
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.cuda.amp import GradScaler, autocast
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

try:
    from flash_attn import flash_attn_func
except ImportError:
    flash_attn_func = None


class LineDataset(Dataset):
    """Each non-empty line of a UTF-8 text file, as bytes (0..255), cut at ``block_size + 1``."""

    def __init__(self, path, block_size):
        with open(path, "rb") as handle:
            self.lines = [
                list(line[: block_size + 1]) for line in handle.read().splitlines() if len(line) > 1
            ]

    def __len__(self):
        return len(self.lines)

    def __getitem__(self, index):
        return self.lines[index]


def collate(batch):
    max_len = max(len(ids) for ids in batch) - 1
    x = torch.zeros(len(batch), max_len, dtype=torch.long)
    y = torch.full((len(batch), max_len), -100, dtype=torch.long)
    for i, ids in enumerate(batch):
        ids = torch.tensor(ids)
        x[i, : len(ids) - 1] = ids[:-1]
        y[i, : len(ids) - 1] = ids[1:]
    return x, y


class CausalSelfAttention(nn.Module):
    def __init__(self, dim, n_head, block_size):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        mask = torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size)
        self.register_buffer("mask", mask)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head) for t in (q, k, v))
        if flash_attn_func is not None and x.dtype in (torch.float16, torch.bfloat16):
            y = flash_attn_func(q, k, v, causal=True)
        else:
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.mask[:, :, :T, :T] == 0, float("-inf"))
            att = F.softmax(att, dim=-1)
            y = (att @ v).transpose(1, 2)
        return self.proj(y.reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, dim, n_head, block_size):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, n_head, block_size)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size=256, dim=256, n_layer=4, n_head=4, block_size=256):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, dim)
        self.pos = nn.Embedding(block_size, dim)
        self.blocks = nn.ModuleList(Block(dim, n_head, block_size) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, idx):
        positions = torch.arange(idx.size(1), device=idx.device)
        x = self.tok(idx) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--label-smoothing", type=float, default=0.1)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--out", default="out")
    args = parser.parse_args()

    ddp = int(os.environ.get("RANK", -1)) != -1
    if ddp:
        dist.init_process_group(backend="nccl")
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        device = f"cuda:{local_rank}"
        master = dist.get_rank() == 0
    else:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        master = True
    torch.manual_seed(1337)
    torch.cuda.manual_seed_all(1337)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cudnn.benchmark = True

    dataset = LineDataset(args.data, args.block_size)
    sampler = DistributedSampler(dataset) if ddp else None
    loader = DataLoader(
        dataset,
        batch_size=args.batch_size,
        sampler=sampler,
        shuffle=sampler is None,
        collate_fn=collate,
        num_workers=2,
        pin_memory=True,
    )

    model = GPT(block_size=args.block_size).cuda()
    if ddp:
        model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=True)
    scaler = GradScaler(enabled=args.dtype == "float16")
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float16
    if args.resume:
        checkpoint = torch.load(args.resume, map_location=device)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])

    step, best_loss = 0, float("inf")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for epoch in range(args.epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
            start.record()
            with autocast(dtype=dtype):
                logits = model(x)
                loss = F.cross_entropy(
                    logits.view(-1, logits.size(-1)),
                    y.view(-1),
                    ignore_index=-100,
                    label_smoothing=args.label_smoothing,
                )
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            end.record()
            torch.cuda.synchronize()
            loss_value = loss.item()
            if loss < best_loss:
                best_loss = loss.detach()
            n_tokens = y[y != -100].numel()
            if master and step % args.log_interval == 0:
                memory = torch.cuda.max_memory_allocated() / 2**30
                tokens_per_s = n_tokens / (start.elapsed_time(end) / 1000)
                print(f"step {step}: loss {loss_value:.4f} | {tokens_per_s:,.0f} tok/s | {memory:.1f} GiB")
            step += 1

    if master:
        os.makedirs(args.out, exist_ok=True)
        raw = model.module if ddp else model
        torch.save({"model": raw.state_dict(), "optimizer": optimizer.state_dict()}, f"{args.out}/ckpt.pt")
        with open(f"{args.out}/config.pkl", "wb") as handle:
            pickle.dump(vars(args), handle)
        print(f"best loss {best_loss:.4f}, {time.strftime('%H:%M:%S')}")
    if ddp:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
