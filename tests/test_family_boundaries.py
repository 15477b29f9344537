"""What a model family may touch outside its folder (docs/models/adding_a_family.md, "What a family
may touch"): its folder imports only the shared parts (``portatrain.models.common``,
``portatrain.models.spec``) and the family it declares it extends; no module outside the folder imports
it but the registry (``portatrain.models``) or names it in code. Read from the sources with ``ast``
(``tests/layering.py``), so a new family is checked the day its folder appears."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.layering import module_imports

SRC = Path(__file__).resolve().parents[1] / "src" / "portatrain"
FAMILIES = sorted(
    p.name for p in (SRC / "models").iterdir() if (p / "__init__.py").is_file() and p.name != "common"
)
SHARED = ("portatrain.models.common", "portatrain.models.spec")
EXTENDS = {"qwen3_moe": "qwen3"}
"""A family built on another one's model and names (Qwen 3 MoE is Qwen 3 with mixture-of-experts blocks)."""
DEFAULT_FAMILY = "llama3"
"""Named in generic code as the default ``model.name`` and the family of checkpoints that predate it."""


def _family(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "models" and parts[2] in FAMILIES else None


def test_families_exist() -> None:
    assert {"llama", "deepseek_v3", "gemma3", "gpt_oss"} <= set(FAMILIES)


def test_a_family_folder_imports_only_the_shared_parts_and_itself() -> None:
    imports = module_imports(SRC, "portatrain")
    wrong = []
    for module, targets in sorted(imports.items()):
        family = _family(module)
        if family is None:
            continue
        allowed = (*SHARED, f"portatrain.models.{family}")
        if family in EXTENDS:
            allowed += (f"portatrain.models.{EXTENDS[family]}",)
        wrong += [f"{module} imports {t}" for t in sorted(targets) if not t.startswith(allowed)]
    assert not wrong, "a family imports only models.common, models.spec and itself:\n" + "\n".join(wrong)


def test_only_the_registry_imports_a_family() -> None:
    imports = module_imports(SRC, "portatrain")
    wrong = [
        f"{module} imports {t}"
        for module, targets in sorted(imports.items())
        if module != "portatrain.models"
        for t in sorted(targets)
        if _family(t) is not None and _family(module) is None
    ]
    assert not wrong, "generic code reaches a family through its spec (get_spec):\n" + "\n".join(wrong)


def test_no_module_outside_a_family_names_it() -> None:
    from portatrain.models import SPECS

    names = set(SPECS) - {DEFAULT_FAMILY}
    wrong = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC)
        if rel.parts[0] == "models" and len(rel.parts) > 2 and rel.parts[1] in FAMILIES:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in names:
                wrong.append(f"{rel}:{node.lineno} names {node.value!r}")
    assert not wrong, "a family's name appears only in its folder and its conf/model files:\n" + "\n".join(
        wrong
    )
