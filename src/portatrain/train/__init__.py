"""The training core as parts, each used by every trainer (``portatrain.trainer.Trainer``, DPO, a
research subclass) and by the commands that run a model without training it (eval, bench, parity):

* :mod:`~portatrain.train.runtime` -- the device, process group, parallel layout and precision;
* :mod:`~portatrain.train.build` -- the model from meta to the device: the family's runtime hooks,
  kernels, model converters, the parallel plan or pipeline stages, materialization;
* :mod:`~portatrain.train.step` -- one optimizer step (replica-group averaging, clipping, the
  non-finite guard, post-step hooks, the LR schedule);
* :mod:`~portatrain.train.state` -- what a resume restores, read by the checkpointer and by
  fault-tolerance recovery alike.

The Trainer keeps the loop and its documented hooks. The split follows torchtitan's
(``torchtitan/trainer.py`` over ``torchtitan/components/``).
"""
