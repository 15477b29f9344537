"""The GPT-OSS family: sliding-window and full layers with attention sinks, biased clamped experts in
every block (``model.py``), and the Hugging Face mapping (``hf.py``). ``GPT_OSS`` is what the registry
lists."""

from __future__ import annotations

from portatrain.models.common import decoder_spec
from portatrain.models.gpt_oss import hf
from portatrain.models.gpt_oss.model import GPT_OSS_FLAVORS, GPT_OSS_PUBLISHED_PARAMS, GptOss, GptOssArgs

GPT_OSS = decoder_spec(
    "gpt_oss", GptOss, GptOssArgs, GPT_OSS_FLAVORS, hf, published_params=GPT_OSS_PUBLISHED_PARAMS
)

__all__ = ["GPT_OSS", "GPT_OSS_FLAVORS", "GptOss", "GptOssArgs"]
