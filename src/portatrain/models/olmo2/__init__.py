"""The OLMo 2 family: arguments and flavours (``model.py``) and Hugging Face config (``hf.py``); the
rest is the shared decoder (``portatrain.models.common``) with post-norm blocks and q/k norms over
the whole projection. ``OLMO2`` is what the registry lists.
"""

from __future__ import annotations

from portatrain.models.common import decoder_spec
from portatrain.models.olmo2 import hf
from portatrain.models.olmo2.model import OLMO2_FLAVORS, OLMO2_PUBLISHED_PARAMS, Olmo2, Olmo2Args

OLMO2 = decoder_spec("olmo2", Olmo2, Olmo2Args, OLMO2_FLAVORS, hf, published_params=OLMO2_PUBLISHED_PARAMS)

__all__ = ["OLMO2", "OLMO2_FLAVORS", "Olmo2", "Olmo2Args"]
