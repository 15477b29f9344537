"""``examples/cuda_first_train.py`` ported to portatrain: the same training, on any device.

The CUDA-first script's own logic is two things, and they are all that is left here: a
label-smoothed cross-entropy, and keeping the best loss seen. Everything else it did by hand
has a home in portatrain, which is why this file audits clean (``portatrain audit
examples/ported_train.py``):

=============================================  ====================================================
CUDA-first script (audit finding)               portatrain
=============================================  ====================================================
``"cuda" if ... else "cpu"``, ``.cuda()``,      ``device=auto|cpu|cuda|tpu|neuron``: the accelerator
``torch.cuda.set_device``, ``f"cuda:{rank}"``   adapter picks and sets the device (it never falls
                                                back to "cuda")
``init_process_group("nccl")``, ``DDP(device_   the adapter's process-group backend; ``parallel.*``
ids=...)``                                      shards with FSDP2 on a DeviceMesh
``torch.cuda.amp`` autocast + ``GradScaler``    ``trainer.dtype=auto`` (bf16 autocast on
                                                accelerators, no scaler needed)
TF32 / cuDNN flags, ``pin_memory=True``         the adapter's defaults
GPT with softmax(QK^T) or flash_attn            ``model=llama3_debug`` (attention through SDPA only)
``collate`` padding to the batch's longest      ``data.collator=bucket`` (or ``packing``): a fixed
line                                            set of shapes, so compiled graphs are reused
CUDA events, ``torch.cuda.synchronize``,        the metrics stage: tokens/s, MFU and memory
``max_memory_allocated``                        high-water marks, read on logging steps only
``loss.item()``, ``if loss < best``,            the loss stays on the device between logging
``y[y != -100]`` every step                     steps; the best loss is tracked on evaluations
``torch.load``, ``pickle.dump(vars(args))``     DCP checkpoints (``weights_only``-safe) and
                                                ``config.yaml`` in the run directory
=============================================  ====================================================

Run it like ``portatrain`` (same config groups and overrides), e.g. on the bundled corpus:

    python examples/ported_train.py device=cpu data.collator=bucket trainer.steps=50

or on the original script's text file: ``data.dataset=corpus.txt``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from portatrain.cli import main
from portatrain.trainer import Trainer


class LabelSmoothingTrainer(Trainer):
    """Cross-entropy with label smoothing, and the best evaluation loss seen so far."""

    label_smoothing = 0.1
    best_eval_loss = float("inf")

    def compute_loss(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        # The hook contract: a SUM over target tokens (the trainer divides by the step's token
        # count). Padding positions carry label -100 and are ignored: no boolean indexing needed.
        return F.cross_entropy(
            logits.flatten(0, 1).float(),
            batch["labels"].flatten(),
            ignore_index=-100,
            reduction="sum",
            label_smoothing=self.label_smoothing,
        )

    def on_eval_end(self, step: int, metrics: dict[str, float]) -> None:
        # Evaluation metrics are host floats already: comparing them costs no device sync.
        if metrics["eval_loss"] < self.best_eval_loss:
            self.best_eval_loss = metrics["eval_loss"]
            print(f"step {step}: new best eval loss {self.best_eval_loss:.4f}")


if __name__ == "__main__":
    main(trainer_cls=LabelSmoothingTrainer)
