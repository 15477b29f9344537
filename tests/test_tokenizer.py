"""Tokenizers: the byte default, Hugging Face tokenizer directories built here (no hub), vocab checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from portatrain.data.corpus import generate_corpus
from portatrain.data.errors import DataError
from portatrain.data.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    build_tokenizer,
    copy_tokenizer_files,
    vocab_problem,
)

# Llama 3's pre-tokenizer split (tiktoken's cl100k pattern), then byte-level BPE.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_bpe_tokenizer(
    out: Path, *, vocab_size: int = 400, llama3_style: bool = True, bos: bool = True, texts=None
) -> Path:
    """Train a small byte-level BPE tokenizer on the bundled corpus and save it as a HF directory."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    if llama3_style:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts or generate_corpus(300, seed=5), trainer)
    if bos:  # as Llama 3's tokenizer.json: transformers adds BOS (portatrain adds its own, see tokenizer.py)
        tok.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A",
            special_tokens=[("<|begin_of_text|>", tok.token_to_id("<|begin_of_text|>"))],
        )
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|end_of_text|>",
        "pad_token": "<|pad|>",
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }
    if bos:
        config["bos_token"] = "<|begin_of_text|>"
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory) -> Path:
    return make_bpe_tokenizer(tmp_path_factory.mktemp("tok") / "bpe")


def test_byte_is_the_default_and_round_trips():
    tok = build_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer)
    ids = tok.encode("héllo")
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id and tok.decode(ids) == "héllo"


def test_hf_directory_loads_with_special_tokens_from_its_files(bpe_dir):
    tok = build_tokenizer(str(bpe_dir))
    assert isinstance(tok, HFTokenizer)
    assert tok.vocab_size == 400
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2)
    text = "The quick fox sees 123 apples near the river."
    ids = tok.encode(text)
    assert ids[0] == 0 and ids[-1] == 1 and len(ids) < len(text)  # BPE merges: fewer tokens than bytes
    assert tok.decode(ids) == text
    # The batched fast path gives the same ids as one-at-a-time encoding.
    assert tok.encode_ids([text])[0].tolist() == ids[1:-1]


def test_llama3_pretokenizer_splits_digits_in_threes(bpe_dir):
    tok = build_tokenizer(str(bpe_dir))
    pieces = [tok.decode([i]) for i in tok.encode("1234567", bos=False, eos=False)]
    assert "".join(pieces) == "1234567" and all(len(p) <= 3 for p in pieces)


def test_pad_defaults_to_eos_and_bos_can_be_absent(tmp_path):
    d = make_bpe_tokenizer(tmp_path / "nobos", bos=False)
    config = json.loads((d / "tokenizer_config.json").read_text())
    del config["pad_token"]
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    tok = build_tokenizer(str(d))
    assert tok.bos_id is None and tok.pad_id == tok.eos_id
    assert tok.encode("abc")[-1] == tok.eos_id and tok.encode("abc")[0] != 0


def test_special_tokens_map_is_read_when_the_config_lacks_them(tmp_path):
    d = make_bpe_tokenizer(tmp_path / "map")
    (d / "tokenizer_config.json").unlink()
    (d / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": {"content": "<|begin_of_text|>"}, "eos_token": "<|end_of_text|>"})
    )
    tok = build_tokenizer(str(d))
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 1)


@pytest.mark.parametrize("name", ["gpt2", "/no/such/dir"])
def test_unknown_tokenizer_is_a_clear_error(name):
    with pytest.raises(DataError, match=r"data.tokenizer=.* is unknown.*data.tokenizer=byte"):
        build_tokenizer(name)


def test_missing_eos_or_bad_special_token_is_a_clear_error(tmp_path):
    d = make_bpe_tokenizer(tmp_path / "noeos")
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|begin_of_text|>"}))
    with pytest.raises(DataError, match="defines no eos_token"):
        build_tokenizer(str(d))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    with pytest.raises(DataError, match=r"eos_token='</s>' is not in the tokenizer's vocabulary"):
        build_tokenizer(str(d))
    (d / "tokenizer.json").write_text("{not json")
    with pytest.raises(DataError, match="could not be read as a Hugging Face tokenizer"):
        build_tokenizer(str(d))


def test_vocab_check_allows_smaller_and_names_both_sizes_when_larger():
    assert vocab_problem(128_000, 128_256) is None
    assert vocab_problem(258, 258) is None
    problem = vocab_problem(128_256, 32_000, tokenizer_name="llama3")
    assert "128256" in problem and "32000" in problem and "model.vocab_size" in problem


def test_copied_files_load_with_transformers(bpe_dir, tmp_path):
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "export"
    out.mkdir()
    assert copy_tokenizer_files(str(bpe_dir), out) == ["tokenizer.json", "tokenizer_config.json"]
    hf = transformers.AutoTokenizer.from_pretrained(str(out))
    ours = build_tokenizer(str(bpe_dir))
    text = "Ada gave the lamp to Ben."
    assert hf(text, add_special_tokens=False)["input_ids"] == ours.encode(text, bos=False, eos=False)
    assert hf(text)["input_ids"] == ours.encode(text, eos=False)  # BOS from the post-processor
    assert hf.eos_token_id == ours.eos_id and hf.bos_token_id == ours.bos_id



def test_byte_tokenizer_files_load_with_transformers(tmp_path):
    """An export of a byte-tokenizer run carries tokenizer files (lm-eval's ``--model hf`` loads them
    with ``AutoTokenizer``): the byte tokenizer's ids, BOS first with special tokens as HF's causal
    models add them, a text that spells a special token read as bytes; portatrain reads them back."""
    transformers = pytest.importorskip("transformers")
    assert copy_tokenizer_files("byte", tmp_path) == ["tokenizer.json", "tokenizer_config.json"]
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    byte = ByteTokenizer()
    for text in ["Ada gave the lamp to Ben.", "  h\u00e9llo \U0001f600\n\t", "spelt <|eos|> and <|bos|>", ""]:
        assert hf(text)["input_ids"] == byte.encode(text, eos=False)
        assert hf(text, add_special_tokens=False)["input_ids"] == byte.encode(text, bos=False, eos=False)
        assert hf.decode(byte.encode(text), skip_special_tokens=True) == text
    assert (len(hf), hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (258, 256, 257, 257)
    again = build_tokenizer(str(tmp_path))
    assert again.encode("Ada \u00fc") == byte.encode("Ada \u00fc") and again.vocab_size == 258

def test_chat_records_train_only_the_assistant_turns(bpe_dir):
    pytest.importorskip("transformers")
    from portatrain.data.documents import encode_payloads

    tok = build_tokenizer(str(bpe_dir))
    messages = [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "6."},
    ]
    [(tokens, mask)] = encode_payloads(tok, [messages], "chat")
    assert tokens[0] == tok.bos_id and tokens[-1] == tok.eos_id and len(tokens) == len(mask)
    trained = tok.decode([t for t, m in zip(tokens.tolist(), mask.tolist()) if m])
    untrained = tok.decode([t for t, m in zip(tokens.tolist(), mask.tolist()) if not m])
    assert "4." in trained and "6." in trained
    assert "What is 2+2?" in untrained and "And 3+3?" in untrained and "2+2" not in trained
    with pytest.raises(DataError, match="needs a tokenizer with a chat_template"):
        encode_payloads(build_tokenizer("byte"), [messages], "chat")
