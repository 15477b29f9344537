"""The worker of ``tests.helpers.spawn``: ``python -m tests.spawn_entry MODULE:QUALNAME ARGS_JSON``
under ``torchrun`` calls ``MODULE.QUALNAME(LOCAL_RANK, *ARGS)`` -- the call
``torch.multiprocessing.start_processes`` makes -- in a fork of the test process's fork server
(``tests/fork_server.py``) instead of a new interpreter importing torch (~6 CPU-s per rank).

The worker finds its peers through torchrun's environment (``MASTER_ADDR``, ``MASTER_PORT``,
``RANK``, ``WORLD_SIZE``): ``dist.init_process_group("gloo")`` needs no address of its own.
``record`` writes a raising worker's traceback where torchrun's error summary prints it
(https://pytorch.org/docs/stable/elastic/errors.html).
"""

from __future__ import annotations

import importlib
import json
import os
import sys

from torch.distributed.elastic.multiprocessing.errors import record


@record
def main(target: str, args_json: str) -> None:
    module, _, qualname = target.partition(":")
    fn = importlib.import_module(module)
    for name in qualname.split("."):
        fn = getattr(fn, name)
    fn(int(os.environ["LOCAL_RANK"]), *json.loads(args_json))


if __name__ == "__main__":
    main(*sys.argv[1:])
