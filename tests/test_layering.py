"""Layers point down: the import graph of ``portatrain`` has no cycle and no upward edge.

The table below is the architecture: each row may import the rows above it, never a row below or a
neighbour in its own row. A new first-level module or package must be placed in it. The checker
(``tests/layering.py``) reads sources with ``ast``; imports inside functions and under
``TYPE_CHECKING`` count, because they are dependencies all the same.
"""

from __future__ import annotations

from pathlib import Path

from tests.layering import layering_violations

SRC = Path(__file__).resolve().parents[1] / "src" / "portatrain"

LAYERS: list[tuple[str, ...]] = [
    ("errors", "config", "dtypes", "redact"),  # leaves: import nothing of portatrain
    ("accelerators",),  # device adapters
    # process groups; torchft's replica groups; parallel dims, mesh, FSDP/TP; kernel overrides
    ("distributed", "fault_tolerance", "parallel", "kernels"),
    ("models", "data"),  # model families (parallelize.py uses parallel/); the data pipeline
    ("finetune",),  # LoRA adapters and PEFT files; DPO's loss and preference pairs
    ("converters",),  # model converters applied on meta before parallelize (quantize.linear)
    # stages the trainer uses; the audit (static scan, runtime audit)
    ("compile", "losses", "optim", "profiling", "metrics", "checkpoint", "rundir", "audit"),
    # the training core as parts: runtime, model stage, optimizer step, train state, and what watches
    # the loop (non-finite steps, the logging window, the logging step, compile warm-up)
    ("train",),
    ("evaluation",),  # lm-eval tasks on the model (its model is built by the train parts)
    ("trainer", "plan", "export", "generate"),  # the loop; the dry run; HF export; text generation
    ("dpo_trainer",),  # the trainer for finetune.method=dpo
    ("bench", "launch", "parity"),  # commands' engines built on the trainer / the layout; parity
    ("report",),  # the portability report: audit + runtime audit + parity + bench
    ("validate",),  # asks every stage for its problems
    ("commands",),  # one module per command
    ("cli",),  # dispatch
    ("__main__", "__init__"),
]


def test_portatrain_layers_point_down_without_cycles() -> None:
    problems = layering_violations(SRC, "portatrain", LAYERS)
    assert not problems, "\n".join(problems)


def test_config_is_a_leaf_and_models_know_no_stage() -> None:
    from tests.layering import module_imports

    imports = module_imports(SRC, "portatrain")
    config = [m for m in imports if m == "portatrain.config" or m.startswith("portatrain.config.")]
    assert len(config) > 1  # the schema is a package of sections; they import only each other
    assert all(
        t == "portatrain.config" or t.startswith("portatrain.config.") for m in config for t in imports[m]
    )
    assert imports["portatrain.errors"] == set()
    # Models know nothing of compile, data, checkpoints or the trainer (the parallelizer is handed a
    # compile_block callable), whatever the table's row order.
    stages = ("compile", "data", "checkpoint", "trainer")
    for module, targets in imports.items():
        if module.startswith("portatrain.models"):
            assert not [t for t in targets if t.split(".")[1] in stages], module


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


SYNTHETIC_LAYERS = [("config",), ("models",), ("trainer",)]


def test_checker_passes_a_clean_package(tmp_path: Path) -> None:
    pkg = _write(
        tmp_path,
        {
            "__init__.py": "",
            "config.py": "X = 1\n",
            "models/__init__.py": "from pkg.config import X\nfrom . import llama\n",
            "models/llama.py": "from ..config import X\n",
            "trainer.py": "from pkg.models import llama\n",
        },
    )
    assert layering_violations(pkg, "pkg", [*SYNTHETIC_LAYERS, ("__init__",)]) == []


def test_checker_catches_an_upward_import_and_a_cycle(tmp_path: Path) -> None:
    pkg = _write(
        tmp_path,
        {
            "__init__.py": "",
            # the planted violation: the leaf reaches up, lazily, inside a function
            "config.py": "def f():\n    from pkg.models import llama\n",
            "models/__init__.py": "from pkg.config import f\n",
            "models/llama.py": "from .. import trainer\n",  # relative import two levels up
            "trainer.py": "import pkg.models.llama\n",
        },
    )
    problems = layering_violations(pkg, "pkg", [*SYNTHETIC_LAYERS, ("__init__",)])
    text = "\n".join(problems)
    assert "pkg.config imports pkg.models: config (layer 0) may not import models (layer 1, higher)" in text
    assert "pkg.models.llama imports pkg.trainer: models (layer 1) may not import trainer" in text
    assert "import cycle between components: config -> models -> config" in text


def test_checker_catches_a_sibling_import_and_an_unlisted_component(tmp_path: Path) -> None:
    pkg = _write(
        tmp_path,
        {"__init__.py": "", "a.py": "from pkg import b\n", "b.py": "", "c.py": "import pkg.a\n"},
    )
    problems = layering_violations(pkg, "pkg", [("a", "b"), ("__init__",)])
    assert any("a and b share layer 0" in p for p in problems)
    assert any("component 'c' is not in the layer table" in p for p in problems)


def test_checker_catches_a_cycle_inside_a_package(tmp_path: Path) -> None:
    """Two modules of one component importing each other (one lazily), and a submodule taking a
    name from its package's ``__init__`` that imports it back: both are cycles between modules."""
    files = {
        "__init__.py": "",
        "config.py": "X = 1\n",
        "models/__init__.py": "from pkg.models.runtime import install\n",
        "models/runtime.py": "from pkg.models import inductor\ndef install():\n    pass\n",
        "models/inductor.py": "def compile_fx():\n    from .runtime import install\n",
        "trainer.py": "from pkg.models import install\n",
    }
    layers = [*SYNTHETIC_LAYERS, ("__init__",)]
    problems = layering_violations(_write(tmp_path / "a", files), "pkg", layers)
    assert problems == [
        "import cycle between modules: pkg.models.runtime -> pkg.models.inductor -> pkg.models.runtime"
    ]
    files["models/inductor.py"] = "def compile_fx():\n    pass\n"
    files["models/runtime.py"] = "from pkg.models import VERSION\ndef install():\n    pass\n"
    files["models/__init__.py"] = "VERSION = 1\nfrom pkg.models.runtime import install\n"
    problems = layering_violations(_write(tmp_path / "b", files), "pkg", layers)
    assert problems == ["import cycle between modules: pkg.models -> pkg.models.runtime -> pkg.models"]


def test_importing_a_sibling_through_the_package_is_no_cycle(tmp_path: Path) -> None:
    """``from pkg.models import runtime`` runs ``pkg/models/__init__.py`` first, as every import of a
    submodule does, but depends on ``runtime`` only: no cycle with an ``__init__`` that imports it."""
    files = {
        "__init__.py": "",
        "config.py": "",
        "models/__init__.py": "from pkg.models.adapter import Adapter\n",
        "models/adapter.py": "class Adapter:\n    def load(self):\n        from pkg.models import runtime\n",
        "models/runtime.py": "from . import counters\n",
        "models/counters.py": "",
        "trainer.py": "",
    }
    assert layering_violations(_write(tmp_path, files), "pkg", [*SYNTHETIC_LAYERS, ("__init__",)]) == []


def test_design_doc_names_every_module_and_package() -> None:
    """docs/design.md's layout names every first-level module (``name.py``) and package (``name/``) of
    ``src/portatrain``: the map stays true to the code."""
    design = (SRC.parents[1] / "docs" / "design.md").read_text()
    layout = design[design.index("src/portatrain/   one row per layer") : design.index("kernels/       how to")]
    names = [
        f"{p.name}/" if p.is_dir() else p.name
        for p in sorted(SRC.iterdir())
        if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and not p.name.startswith("__"))
    ]
    missing = [name for name in names if name not in layout]
    assert not missing, f"docs/design.md's layout does not name {missing}"
