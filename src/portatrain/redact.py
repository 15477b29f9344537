"""Keep secrets out of files and logs: values redacted by the name of their key and by their own shape.

A run's config is written to ``<run_dir>/config.yaml`` and into every checkpoint, launch templates
render it into job files, and ``--cfg job`` prints it -- all readable by whoever reads the run
directory or the log. Secrets do reach the config (``+launch.env.HF_TOKEN=...``, a W&B key),
so everything that writes a config to disk or to a log goes through :func:`redact` /
:func:`redacted_yaml`; the structure and every other value stay as they are. Two rules, either one
enough:

* **The key names a secret** (:func:`is_secret_key`): one of its ``_``/``-``/``.``-separated words (or
  camelCase words) is a secret word -- ``token``, ``secret``, ``password``, ``passwd``, ``pass``,
  ``pwd``, ``pat`` (a personal access token), ``apikey``, ``credential(s)``, ``auth``, ``private``,
  ``passphrase`` -- or the key ends in ``key`` with a qualifier (``API_KEY``, ``access_key``,
  ``SECRET_ACCESS_KEY``; not a bare ``key``, nor ``KEY_VALUE_HEADS``). Whole words only: ``PATH``,
  ``tokenizer``, ``max_shard_size`` and ``passes`` are not secrets, and numbers and booleans
  (``max_tokens: 4096``) are never redacted.
* **The value looks like a credential** (:func:`find_secrets`), whatever its key: the published
  shapes of GitHub tokens (``ghp_``, ``gho_``, ``ghu_``, ``ghs_``, ``ghr_``, ``github_pat_``), Hugging
  Face tokens (``hf_``), AWS access key ids (``AKIA``/``ASIA`` + 16), JSON Web Tokens
  (``eyJ...``.``...``.``...``), OpenAI (``sk-``), Slack (``xox?-``), GitLab (``glpat-``) and Google API
  keys (``AIza``), PEM private keys, the password of a ``scheme://user:password@host`` URL, and a
  ``SECRET_NAME=value`` assignment inside a string (an override or a shell line). Only the
  credential is replaced, so ``export HF_TOKEN=hf_...`` still reads as what it was.

The shapes are the vendors' documented prefixes (GitHub:
https://github.blog/2021-04-05-behind-githubs-new-authentication-token-formats/; AWS:
https://docs.aws.amazon.com/IAM/latest/UserGuide/reference_identifiers.html#identifiers-unique-ids;
JWT: RFC 7519), and the patterns ask for the lengths those tokens have, so hashes, paths and run ids
do not match.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

REDACTED = "***"

_SECRET_WORDS = {
    "token",
    "secret",
    "password",
    "passwd",
    "pass",
    "pwd",
    "pat",
    "apikey",
    "apitoken",
    "accesstoken",
    "authtoken",
    "credential",
    "credentials",
    "auth",
    "private",
    "privatekey",
    "secretkey",
    "passphrase",
}

_TOKEN_SHAPES = re.compile(
    "|".join(
        (
            r"\bgh[pousr]_[A-Za-z0-9]{30,}",  # GitHub classic tokens (36 characters after the prefix)
            r"\bgithub_pat_[A-Za-z0-9_]{22,}",  # GitHub fine-grained personal access tokens
            r"\bhf_[A-Za-z0-9]{30,}",  # Hugging Face (34 after the prefix)
            r"\b(?:AKIA|ASIA)[A-Z0-9]{16}\b",  # AWS access key ids
            r"\beyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}",  # JWTs: base64url '{"' ...
            r"\bsk-(?:proj-|ant-)?[A-Za-z0-9_-]{20,}",  # OpenAI / Anthropic API keys
            r"\bxox[abprs]-[A-Za-z0-9-]{10,}",  # Slack
            r"\bglpat-[A-Za-z0-9_-]{20,}",  # GitLab personal access tokens
            r"\bAIza[0-9A-Za-z_-]{35}",  # Google API keys
            r"-----BEGIN [A-Z ]*PRIVATE KEY-----[\s\S]*?(?:-----END [A-Z ]*PRIVATE KEY-----|$)",
        )
    )
)
_URL_PASSWORD = re.compile(r"(?P<head>\b[a-z][a-z0-9+.-]*://[^\s:/@]+:)(?P<secret>[^\s@/]+)(?=@)")
# A value ends at whitespace or a shell separator, or at the ``,`` before the next ``KEY=`` of a
# comma-joined override list (Hydra's ``hydra.job.override_dirname``, printed by ``--cfg hydra``): a
# value read to the end of the list would hide every assignment after the first behind it.
_ASSIGNMENT = re.compile(
    r"(?P<key>[A-Za-z_][A-Za-z0-9_.-]*)=(?P<value>\"[^\"]*\"|'[^']*'|[^\s;&|]+?)"
    r"(?=$|[\s;&|]|,[+~]*[A-Za-z_][A-Za-z0-9_.-]*=)"
)


def is_secret_key(key: object) -> bool:
    """Whether a config key (``HF_TOKEN``, ``launch.env.GITHUB_PAT``) names a secret."""
    if not isinstance(key, str):
        return False
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", key.rsplit(".", 1)[-1])  # camelCase -> camel_Case
    words = [w for w in re.split(r"[_\-\s]+", spaced.lower()) if w]
    if any(w in _SECRET_WORDS for w in words):
        return True
    return len(words) >= 2 and words[-1] in ("key", "keys")


def find_secrets(text: str) -> list[str]:
    """The credentials in ``text`` (token shapes, URL passwords, secret assignments), in order."""
    found = [m.group(0) for m in _TOKEN_SHAPES.finditer(text)]
    found += [m.group("secret") for m in _URL_PASSWORD.finditer(text)]
    found += [m.group("value") for m in _ASSIGNMENT.finditer(text) if _secret_assignment(m)]
    return found


def _secret_assignment(m: re.Match[str]) -> bool:
    """``NAME=value`` with a secret NAME and a literal value (``"${HF_TOKEN}"`` reads the environment:
    nothing to hide; ``***`` is already hidden)."""
    value = m.group("value").strip("'\"")
    return is_secret_key(m.group("key").lstrip("+~")) and value not in ("", REDACTED) and value[0] != "$"


def is_secret(key: object, value: object) -> bool:
    """Whether ``key: value`` holds a secret by either rule (a text value under a secret key, or a
    value that looks like a credential)."""
    if not _is_text(value):
        return False
    return is_secret_key(key) or bool(find_secrets(str(value)))


def redact_text(text: str) -> str:
    """``text`` with every credential :func:`find_secrets` sees replaced by ``***``."""
    text = _TOKEN_SHAPES.sub(REDACTED, text)
    text = _URL_PASSWORD.sub(lambda m: m.group("head") + REDACTED, text)

    return _ASSIGNMENT.sub(
        lambda m: f"{m.group('key')}={REDACTED}" if _secret_assignment(m) else m.group(0), text
    )


def redact(value: Any, *, resolve: bool = True) -> Any:
    """A copy of ``value`` (nested dicts/lists, or a DictConfig; interpolations resolved unless
    ``resolve=False``) with secret values replaced by ``***``."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(value, (DictConfig, ListConfig)):
            value = OmegaConf.to_container(value, resolve=resolve)
    except ImportError:  # pragma: no cover - omegaconf is a core dependency
        pass
    return _redact(value)


def _redact(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: (REDACTED if is_secret_key(k) and _is_text(v) else _redact(v)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_redact(v) for v in value]
    if isinstance(value, str):
        return redact_text(value)
    return value


def _is_text(value: Any) -> bool:
    return isinstance(value, str) and value != ""


def redacted_yaml(cfg: Any, *, resolve: bool = True) -> str:
    """``cfg`` as YAML, secrets redacted: what portatrain writes to ``config.yaml`` files."""
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.create(redact(cfg, resolve=resolve)))


__all__ = [
    "REDACTED",
    "find_secrets",
    "is_secret",
    "is_secret_key",
    "redact",
    "redact_text",
    "redacted_yaml",
]
