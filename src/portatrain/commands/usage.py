"""``portatrain COMMAND --help``: a command's purpose, its options with their defaults, one example.

Generated from what the code runs, so it cannot drift: the purpose is the first paragraph of the
command module's docstring, the options are the fields of the config sections the command reads
(``SECTIONS`` in the module; the typed schema ``portatrain.config`` gives each default, and the
field's attribute docstring its meaning), the shorthands are the module's ``SHORTHANDS`` and the
example its ``EXAMPLE``. An argument command (``HYDRA = False``) prints its purpose and example,
then its own ``argparse`` help.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from functools import cache
from types import ModuleType
from typing import Any

from portatrain import config as schema
from portatrain.commands import COMMANDS, load_command, shorthands, uses_hydra

COMMON = ("recipe", "run_dir", "dry_run", "device.type")
"""Keys every config command takes, listed under each."""


def purpose(module: ModuleType) -> str:
    """The first paragraph of the module docstring, without its leading ````usage````: part."""
    first = inspect.cleandoc(module.__doc__ or "").split("\n\n")[0].replace("\n", " ")
    if first.startswith("``") and "``: " in first:
        first = first.split("``: ", 1)[1]
    return first.split(". ")[0].rstrip(".").replace("``", "`") + "."


@cache
def _field_docs(cls: type) -> dict[str, str]:
    """``field name -> attribute docstring`` of a config dataclass (the string after the field)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(inspect.cleandoc(after.value.value).split()).replace("``", "`")
    return docs


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return "???"


def options(prefix: str, cls: type) -> list[tuple[str, str, str]]:
    """``(key, default, meaning)`` for every leaf field of config dataclass ``cls`` under ``prefix``."""
    rows = []
    docs = _field_docs(cls)
    for f in dataclasses.fields(cls):
        if "moved_to" in f.metadata:  # a deprecated spelling (portatrain.launch.moved_keys): not offered
            continue
        key = f"{prefix}.{f.name}" if prefix else f.name
        value = _default(f)
        if dataclasses.is_dataclass(value):
            rows += options(key, type(value))
            continue
        shown = "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
        rows.append((key, shown, docs.get(f.name, "")))
    return rows


def _section(name: str) -> type:
    """The config dataclass of top-level section ``name`` (``export`` -> ``ExportConfig``)."""
    return type(_default(next(f for f in dataclasses.fields(schema.Config) if f.name == name)))


def _common_rows(conf_dir: str) -> list[tuple[str, str, str]]:
    rows = {key: (key, default, doc) for key, default, doc in options("", schema.Config)}
    rows["recipe"] = (
        "recipe",
        _default_recipe(conf_dir),
        "The recipe (recipes/NAME.yaml): what differs from the defaults.",
    )
    return [rows[key] for key in COMMON]


def _default_recipe(conf_dir: str) -> str:
    """The ``recipe`` entry of ``conf/config.yaml``'s defaults list (the schema leaves it MISSING)."""
    import yaml

    with open(f"{conf_dir}/config.yaml") as f:
        defaults = yaml.safe_load(f)["defaults"]
    return next(str(entry["recipe"]) for entry in defaults if isinstance(entry, dict) and "recipe" in entry)


def _table(rows: list[tuple[str, str, str]], width: int = 100) -> list[str]:
    key_width = min(max(len(k) for k, _, _ in rows), 36)
    lines = []
    for key, default, doc in rows:
        head = f"  {key:<{key_width}}  [{default}]"
        lines.append(head)
        if doc:
            lines += textwrap.wrap(doc, width, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return lines


def usage(name: str, conf_dir: str) -> str:
    """The ``--help`` text of command ``name``; ``conf_dir`` holds ``config.yaml`` (the default recipe)."""
    module = load_command(name)
    lines = [f"portatrain {name}: {purpose(module)}", ""]
    if not uses_hydra(module):
        lines += ["example:", f"  {module.EXAMPLE}", ""]
        return "\n".join(lines)
    lines += [f"usage: portatrain {name} [KEY=VALUE ...]", ""]
    keys = shorthands(module)
    if keys:
        lines.append("shorthands: " + ", ".join(f"{short}=... is {full}=..." for short, full in keys.items()))
        lines.append("")
    for section in getattr(module, "SECTIONS", ()):
        lines.append(f"{section}.* options [default]:")
        lines += _table(options(section, _section(section)))
        lines.append("")
    lines.append("common options [default]:")
    lines += _table(_common_rows(conf_dir))
    others = [f.name for f in dataclasses.fields(schema.Config) if dataclasses.is_dataclass(_default(f))]
    lines += [
        "",
        *textwrap.wrap(
            f"Every section ({', '.join(others)}) takes KEY=VALUE overrides; `portatrain {name} --cfg job "
            "[KEY=VALUE ...]` prints the resolved config, `portatrain --help` the recipes, models and devices.",
            100,
        ),
        "",
    ]
    lines += [
        "example:",
        f"  {module.EXAMPLE}",
        "",
    ]
    return "\n".join(lines)


def overview() -> str:
    """One line per command, for ``portatrain --help``."""
    width = max(len(name) for name in COMMANDS)
    lines = ["commands (`portatrain COMMAND --help` for each; the default is train):"]
    lines += [f"  {name:<{width}}  {purpose(load_command(name))}" for name in COMMANDS]
    return "\n".join(lines) + "\n"


__all__ = ["COMMON", "options", "overview", "purpose", "usage"]
