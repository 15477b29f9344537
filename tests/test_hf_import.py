"""``model.init_from=HF_DIR``: a recipe starts from Hugging Face safetensors weights saved by
``transformers`` (sharded, bf16, tied into untied), and refuses a directory that does not fit.

``portatrain export`` -> ``init_from`` (bit-identical) is checked for every family in
``tests/test_conformance.py``.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from portatrain.checkpoint import CheckpointError
from portatrain.checkpoint.hf import embedding_rows
from portatrain.models.llama.hf import hf_config
from portatrain.models.llama.model import LLAMA3_FLAVORS
from portatrain.trainer import Trainer
from tests.conftest import TINY, compose_config

transformers = pytest.importorskip("transformers")

ATOL = 1e-4


def tokens() -> torch.Tensor:
    return torch.randint(0, 258, (2, 40), generator=torch.Generator().manual_seed(0))


def logits(trainer: Trainer) -> torch.Tensor:
    with torch.no_grad():
        return trainer.model.eval()(tokens())


def init_from(path: Path, run_dir: Path, extra: list[str] | None = None) -> Trainer:
    return Trainer(compose_config(TINY + (extra or []) + [f"model.init_from={path}"], run_dir=run_dir))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied-into-untied"])
def test_transformers_save_pretrained_then_init_from(tmp_path: Path, tied: bool) -> None:
    """A model made and saved by transformers (sharded, bf16 on disk when tied) initializes ours."""
    args = LLAMA3_FLAVORS["debug"]
    config = transformers.LlamaConfig(
        **{**hf_config(args, torch_dtype="float32"), "tie_word_embeddings": tied}
    )
    torch.manual_seed(3)
    hf = transformers.LlamaForCausalLM(config).eval()
    dtype = torch.bfloat16 if tied else torch.float32
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = 1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.05 * torch.randn_like(p)
            p.copy_(noise.to(dtype))  # values the file can hold exactly
    # Saved from a copy: casting the reference model itself would round its fp32 RoPE buffer too.
    copy.deepcopy(hf).to(dtype).save_pretrained(tmp_path / "hf", max_shard_size="200KB")
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) > 1

    ours = init_from(tmp_path / "hf", tmp_path / "run")
    with torch.no_grad():
        expected = hf(input_ids=tokens()).logits
    assert (logits(ours) - expected).abs().max().item() <= ATOL
    if tied:  # our debug model has its own head, initialized from the tied embedding
        assert torch.equal(ours.model.lm_head.weight, ours.model.embed_tokens.weight)


def test_init_from_errors_name_the_file_and_the_mismatch(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="config.json is missing"):
        init_from(tmp_path / "nothing", tmp_path / "a")

    args = LLAMA3_FLAVORS["debug"]
    config = transformers.LlamaConfig(
        **{**hf_config(args, torch_dtype="float32"), "hidden_size": 64, "head_dim": 16}
    )
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "small")
    with pytest.raises(CheckpointError) as info:
        init_from(tmp_path / "small", tmp_path / "b")
    assert "config.json" in str(info.value) and "hidden_size: config.json has 64, the model 128" in str(
        info.value
    )

    (tmp_path / "small" / "config.json").write_text(json.dumps(hf_config(args, torch_dtype="float32")))
    with pytest.raises(CheckpointError, match=r"embed_tokens.weight: file \[258, 64\], model \[258, 128\]"):
        init_from(tmp_path / "small", tmp_path / "c")


def test_init_from_takes_the_checkpoints_padded_vocabulary(tmp_path: Path, monkeypatch) -> None:
    """A Hugging Face embedding padded past the tokenizer (Qwen3: 151,669 tokens, 151,936 rows) is
    built with the checkpoint's rows; a tokenizer larger than the rows, or a ``model.vocab_size``
    other than them, is one error raised before the model is built."""
    args = LLAMA3_FLAVORS["debug"]
    config = transformers.LlamaConfig(**{**hf_config(args, torch_dtype="float32"), "vocab_size": 320})
    torch.manual_seed(5)
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(tmp_path / "padded")
    ours = init_from(tmp_path / "padded", tmp_path / "a")  # the byte tokenizer: 258 tokens
    assert ours.model.embed_tokens.weight.shape[0] == 320
    with torch.no_grad():
        assert (logits(ours) - hf(input_ids=tokens()).logits).abs().max().item() <= ATOL

    def never(*args, **kwargs):
        raise AssertionError("the model was built before the vocabulary was checked")

    monkeypatch.setattr("portatrain.trainer.build_model", never)
    with pytest.raises(CheckpointError, match="model.vocab_size=384 but .* has 320 embedding rows") as info:
        init_from(tmp_path / "padded", tmp_path / "b", ["model.vocab_size=384"])
    assert "set model.vocab_size=320 or leave it unset" in str(info.value)
    small = json.loads((tmp_path / "padded" / "config.json").read_text()) | {"vocab_size": 200}
    (tmp_path / "padded" / "config.json").write_text(json.dumps(small))
    with pytest.raises(CheckpointError, match="has 258 tokens but model.init_from=.* has 200 embedding rows"):
        init_from(tmp_path / "padded", tmp_path / "c")
    # A directory gone by the time a run resumes (which does not read it) leaves the tokenizer's size.
    gone = compose_config(TINY + [f"model.init_from={tmp_path / 'gone'}"]).model
    assert embedding_rows(gone, 258, "byte") == 258
