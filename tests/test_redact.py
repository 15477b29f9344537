"""Secrets are redacted by the name of their key and by the shape of their value, wherever portatrain
writes or prints a config: ``config.yaml``, the checkpoint's copy, rendered jobs and ``--cfg``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from portatrain.errors import ConfigError
from portatrain.launch import render_job
from portatrain.redact import REDACTED, find_secrets, is_secret, is_secret_key, redact, redact_text
from tests.helpers import ROOT, TINY, compose_config, fit

# Made-up credentials of the published shapes (none is real).
GITHUB = "ghp_" + "aB3dE5gH7jK9mN1pQ3sT5vW7yZ9bD1fH3jL5"
GITHUB_FINE = "github_pat_11ABCDEFG0aBcDeFgHiJkLmN_" + "x" * 59
HUGGING_FACE = "hf_" + "AbCdEfGhIjKlMnOpQrStUvWxYz01234567"
AWS = "AKIA" + "IOSFODNN7EXAMPLE"
JWT = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U"
SHAPED = [GITHUB, GITHUB_FINE, HUGGING_FACE, AWS, JWT, "sk-proj-" + "a1" * 20, "glpat-" + "z9" * 12]


@pytest.mark.parametrize(
    "key",
    ["GITHUB_PAT", "gh_pat", "HF_TOKEN", "WANDB_API_KEY", "DB_PASS", "db-password", "awsSecretAccessKey",
     "OPENAI_APIKEY", "SERVICE_CREDENTIALS", "parallel.launch.env.GITHUB_PAT", "private_key"],
)  # fmt: skip
def test_secret_key_names(key: str) -> None:
    assert is_secret_key(key)


@pytest.mark.parametrize(
    "key",
    ["PATH", "PYTHONPATH", "max_shard_size", "KEY_VALUE_HEADS", "n_kv_heads", "key", "tokenizer",
     "max_tokens", "num_passes", "bypass", "patience", "SSH_KEY_PATH", "NCCL_DEBUG", "monkey", "keep"],
)  # fmt: skip
def test_ordinary_key_names_are_not_secrets(key: str) -> None:
    assert not is_secret_key(key)


@pytest.mark.parametrize("token", SHAPED)
def test_token_shapes_are_found_under_any_key_and_inside_text(token: str) -> None:
    assert find_secrets(token) == [token]
    assert is_secret("LOG_LEVEL", token)
    assert redact({"LOG_LEVEL": token, "note": f"use {token} here"}) == {
        "LOG_LEVEL": REDACTED,
        "note": f"use {REDACTED} here",
    }


def test_credentials_inside_text_keep_the_rest() -> None:
    assert redact_text("export HF_TOKEN=abc123 && echo ok") == f"export HF_TOKEN={REDACTED} && echo ok"
    assert redact_text("+parallel.launch.env.GITHUB_PAT=xyz") == f"+parallel.launch.env.GITHUB_PAT={REDACTED}"
    assert redact_text("postgres://me:s3cret@db:5432/x") == f"postgres://me:{REDACTED}@db:5432/x"
    assert redact_text('export HF_TOKEN="${HF_TOKEN:?missing}"') == 'export HF_TOKEN="${HF_TOKEN:?missing}"'
    # A comma-joined override list (Hydra's override_dirname): each assignment on its own.
    assert redact_text("+e.DB=postgres://u:pw@h/x,+e.HF_TOKEN=abc123secret,+e.API_KEY=k,steps=2") == (
        f"+e.DB=postgres://u:{REDACTED}@h/x,+e.HF_TOKEN={REDACTED},+e.API_KEY={REDACTED},steps=2"
    )
    assert redact_text("HF_TOKEN=a,b") == f"HF_TOKEN={REDACTED}"  # a comma inside a value is the value's
    for ordinary in (
        "0123456789abcdef0123456789abcdef01234567",  # a git sha or checksum
        "runs/debug/20261201-211700",
        "hf:HuggingFaceFW/fineweb-edu?split=train",
        "meta-llama/Llama-3.1-8B",
        "source venv/bin/activate && export PATH=/opt/bin:$PATH",
        "https://example.com/a:b@c",  # no user:password before the @ of an authority
    ):
        assert redact_text(ordinary) == ordinary and not find_secrets(ordinary), ordinary


def test_every_recipe_config_is_unchanged_by_redaction() -> None:
    """No false positive in a real config: every value of every recipe survives."""
    for recipe in sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml")):
        cfg = OmegaConf.to_container(
            compose_config([f"recipe={recipe}"], run_dir=Path("/tmp/r")), resolve=True
        )
        assert redact(cfg) == cfg, recipe


def test_github_pat_is_redacted_in_the_run_and_checkpoint_configs(tmp_path: Path) -> None:
    fit(
        [
            "trainer.steps=1",
            f"+parallel.launch.env.GITHUB_PAT={GITHUB}",
            f"+parallel.launch.env.MY_VAR={HUGGING_FACE}",  # secret by its shape only
            "+parallel.launch.env.NCCL_DEBUG=INFO",
        ],
        tmp_path,
    )
    files = [tmp_path / "config.yaml", *(tmp_path / "checkpoints").glob("step_*/config.yaml")]
    assert len(files) == 2
    for file in files:
        text = file.read_text()
        assert GITHUB not in text and HUGGING_FACE not in text, text
        assert "GITHUB_PAT: '***'" in text and "MY_VAR: '***'" in text and "NCCL_DEBUG: INFO" in text


@pytest.mark.parametrize("scheduler", ["slurm", "pytorchjob"])
def test_rendered_jobs_never_hold_a_pat_or_a_token_shaped_value(scheduler: str) -> None:
    overrides = [
        *TINY,
        f"parallel.launch.scheduler={scheduler}",
        "parallel.launch.image=registry.example/portatrain:1",
        "parallel.launch.volume_claim=runs",
        "device=cuda",
        "parallel.launch.efa=0",
        f"+parallel.launch.env.GITHUB_PAT={GITHUB}",
        f"+parallel.launch.env.MY_VAR={HUGGING_FACE}",
        "+parallel.launch.env.HF_TOKEN=abc123secret",  # a secret by its name only
    ]
    text = render_job(compose_config(overrides), overrides).text
    assert GITHUB not in text and HUGGING_FACE not in text and "abc123secret" not in text
    assert "GITHUB_PAT" in text and "MY_VAR" in text  # named, read from the environment / a Secret


def test_render_refuses_a_credential_outside_launch_env() -> None:
    overrides = [*TINY, f"parallel.launch.setup=['huggingface-cli login --token {HUGGING_FACE}']"]
    with pytest.raises(ConfigError, match=r"would hold 1 credential.*pass a secret as \+launch\.env\.NAME=VALUE"):
        render_job(compose_config(overrides), overrides)


@pytest.mark.parametrize("what", ["job", "hydra", "all"])
def test_cfg_prints_the_config_redacted(
    what: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from portatrain.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["portatrain"])
    # Hydra's override_dirname joins the overrides, sorted, with commas: a plain value first.
    secrets = [f"+parallel.launch.env.GITHUB_PAT={GITHUB}", f"+parallel.launch.env.X={JWT}"]
    secrets += ["+parallel.launch.env.HF_TOKEN=abc123secret", "+parallel.launch.env.DB=postgres://u:pw9@h/x"]
    main(argv=["--cfg", what, *secrets, "trainer.steps=2"])
    out = capsys.readouterr().out
    assert GITHUB not in out and JWT not in out and "abc123secret" not in out and "pw9" not in out
    if what != "hydra":
        assert "GITHUB_PAT: '***'" in out and "X: '***'" in out and "recipe: debug" in out
    if what != "job":
        assert "- +parallel.launch.env.HF_TOKEN=***" in out  # hydra.overrides.task
        assert ",+parallel.launch.env.HF_TOKEN=***,+parallel.launch.env.X=***,trainer.steps=2" in out
    assert not list(tmp_path.iterdir())  # printing the config makes no run directory


def test_a_sweep_records_its_config_redacted(tmp_path: Path) -> None:
    # A fresh process: in-process, Hydra's multirun logging meets handlers other tests' libraries
    # (jax's absl logging) left on streams pytest has since closed.
    from tests.helpers import run_cli

    out = run_cli(
        ["-m", "dry_run=true", "trainer.steps=1,2", f"+parallel.launch.env.GITHUB_PAT={GITHUB}"], cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr[-2000:]
    (record,) = tmp_path.glob("multirun/*/*/multirun.yaml")
    text = record.read_text()
    assert GITHUB not in text and "GITHUB_PAT: '***'" in text
    assert out.stdout.count("activations") >= 2  # both jobs ran (planned the debug model)
