"""The static scan: parse each file with :mod:`ast` and report what breaks or slows down off NVIDIA.

One :class:`_FileScan` per file does everything in three steps:

1. **Resolve names.** Every ``import`` in the file (any scope) maps a local name to the dotted
   path it stands for, so ``th.cuda.synchronize``, ``cuda.synchronize`` (``from torch import
   cuda``) and ``GradScaler`` (``from torch.cuda.amp import GradScaler``) all read as
   ``torch.cuda....``. Rules match dotted paths, never source text.
2. **Find the training step.** A *training loop* is a ``for``/``while`` loop whose body (not a
   nested function) calls ``.backward()``, ``optimizer.step()``/``scaler.step()`` or a step function;
   a *step function* is a function that does so outside any loop of its own, or a Trainer hook that
   runs once per step (:data:`STEP_HOOKS`). The host-sync rules fire only there: an ``.item()`` in
   an evaluation function or a data collator costs nothing per step and is not reported. Inside the
   step, a block under a logging gate (``if step % log_every == 0:``, ``if should_log:``) is exempt:
   reading values on logging steps is the portable pattern (STYLE rule 18).
3. **Check every node** (breadth-first, so a broad finding such as a ``"cuda" if ... else "cpu"``
   branch claims its sub-expressions before narrower rules see them), at most one finding per
   rule and line.

Tensor-ness is inferred, not typed: a name is a tensor when the assignment that reaches it is a
``torch.*``/``F.*`` call, a model/criterion/loss call, arithmetic on a tensor, or a parameter
annotated ``torch.Tensor``. That is enough for ``print(loss)`` and ``if loss < best:`` without
flagging ``print(step)``.

Suppressions (``# portatrain: ignore[rule-id, ...] reason`` or a bare ``# portatrain: ignore``)
are read with :mod:`tokenize` and apply on the finding's line or the first line of its statement.
"""

from __future__ import annotations

import ast
import io
import os
import re
import tokenize
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from portatrain.audit.config import AuditConfig
from portatrain.audit.rules import RULES, SEVERITIES
from portatrain.errors import UserError

# -- vocabulary ------------------------------------------------------------------------------------
STEP_DRIVERS = frozenset({"train_step", "training_step", "forward_backward", "forward_backward_step"})
"""Functions that run one training step by contract: a loop that calls one is a training loop."""
STEP_HOOKS = STEP_DRIVERS | {"compute_loss"}
"""Functions that run on every training step by contract (portatrain's Trainer hooks and the usual
names elsewhere), scanned as step code even when they do not call ``.backward()`` themselves.
``compute_loss`` is one, but calling it does not make a loop a training loop (evaluation calls it)."""

CUDA_LIBRARIES: dict[str, str] = {
    "flash_attn": "`F.scaled_dot_product_attention` (each backend picks its fused kernel)",
    "flash_attn_interface": "`F.scaled_dot_product_attention` (each backend picks its fused kernel)",
    "xformers": "`F.scaled_dot_product_attention` (each backend picks its fused kernel)",
    "apex": "`torch.optim.AdamW(fused=...)`, `nn.LayerNorm`/`nn.RMSNorm`, `torch.autocast`",
    "bitsandbytes": "`torch.optim.AdamW`, or torchao's optimizers/quantization where the backend supports them",
    "triton": "a pure-PyTorch op that `torch.compile` fuses, or a named kernel with a PyTorch reference",
    "transformer_engine": "`torch.autocast(device_type, dtype=torch.bfloat16)` and plain `nn.Linear`",
    "liger_kernel": "the plain PyTorch loss/norm ops (`torch.compile` fuses them)",
    "mamba_ssm": "a pure-PyTorch selective scan (or a backend's own kernel behind one op)",
    "causal_conv1d": "`nn.Conv1d` with left padding",
    "cupy": "torch tensor ops on the device",
    "pycuda": "torch tensor ops on the device",
}
"""Top-level module -> portable replacement for CUDA-only kernel libraries."""

_CUDA_API_REPLACEMENTS: dict[str, str] = {
    "synchronize": "`torch.accelerator.synchronize()`",
    "Event": "`torch.Event(enable_timing=True)` (device-generic)",
    "Stream": "`torch.Stream()` (device-generic)",
    "current_stream": "`torch.accelerator.current_stream()`",
    "set_stream": "`torch.accelerator.set_stream(stream)`",
    "device_count": "`torch.accelerator.device_count()`",
    "current_device": "`torch.accelerator.current_device_index()`",
    "empty_cache": "`torch.accelerator.empty_cache()`",
    "memory_allocated": "`torch.accelerator.memory_allocated()`",
    "max_memory_allocated": "`torch.accelerator.max_memory_allocated()`",
    "memory_reserved": "`torch.accelerator.memory_reserved()`",
    "max_memory_reserved": "`torch.accelerator.max_memory_reserved()`",
    "memory_stats": "`torch.accelerator.memory_stats()`",
    "reset_peak_memory_stats": "`torch.accelerator.reset_peak_memory_stats()`",
    "mem_get_info": "`torch.accelerator.get_memory_info()`",
    "get_device_capability": "`torch.accelerator.get_device_capability()`",
    "manual_seed": "`torch.manual_seed(seed)` (seeds every device)",
    "manual_seed_all": "`torch.manual_seed(seed)` (seeds every device)",
    "get_rng_state": "`torch.get_rng_state()` plus the adapter's device RNG state",
    "set_rng_state": "`torch.set_rng_state()` plus the adapter's device RNG state",
    "nvtx": "`torch.profiler.record_function(name)`",
    "CUDAGraph": "`torch.accelerator.Graph`, or let torch.compile capture graphs per backend",
    "graph": "`torch.accelerator.Graph`, or let torch.compile capture graphs per backend",
    "is_bf16_supported": "the adapter's default dtype (portatrain: trainer.dtype=auto)",
    "get_device_name": "the adapter's device_name()",
}

_SDP_FLAGS = frozenset(
    [
        "sdp_kernel",
        "enable_flash_sdp",
        "enable_mem_efficient_sdp",
        "enable_math_sdp",
        "enable_cudnn_sdp",
        "flash_sdp_enabled",
        "mem_efficient_sdp_enabled",
    ]
)
_SDP_KWARGS = frozenset({"enable_flash", "enable_mem_efficient", "enable_math", "enable_cudnn"})
_BACKEND_FLAG_REPLACEMENTS: dict[str, str] = {
    "allow_tf32": '`torch.set_float32_matmul_precision("high")`',
    "allow_fp16_reduced_precision_reduction": "bf16 autocast: `torch.autocast(device_type, dtype=torch.bfloat16)`",
    "allow_bf16_reduced_precision_reduction": "bf16 autocast: `torch.autocast(device_type, dtype=torch.bfloat16)`",
    "deterministic": "`torch.use_deterministic_algorithms(True)`",
    "benchmark": "drop it (cuDNN autotuning; other backends' compilers tune per static shape)",
}

_PICKLE_MODULES = frozenset({"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib"})
_DEVICE_KWARGS = frozenset({"device", "device_type", "map_location", "device_map", "pin_memory_device"})
_DEVICE_CALLS = frozenset(
    {
        "torch.device",
        "torch.autocast",
        "torch.amp.autocast",
        "torch.amp.GradScaler",
        "torch.Generator",
        "torch.set_default_device",
        "torch.get_device_module",
    }
)
_DEVICE_STRING = re.compile(r"^cuda(:\d+)?$")
_CUDA_SOURCE = re.compile(r"^[\w./-]*\w\.cuh?$")  # kernel.cu, csrc/attn.cuh (not the bare suffix)
_HOST_SYNC_METHODS = frozenset({"item", "tolist", "numpy", "cpu"})
_DYNAMIC_SHAPE_METHODS = frozenset({"nonzero", "unique", "unique_consecutive", "masked_select", "argwhere"})
_TORCH_NOT_TENSOR = frozenset(
    [
        "device",
        "dtype",
        "no_grad",
        "enable_grad",
        "inference_mode",
        "set_grad_enabled",
        "is_grad_enabled",
        "is_tensor",
        "is_floating_point",
        "manual_seed",
        "compile",
        "autocast",
        "load",
        "save",
        "get_default_dtype",
        "set_default_dtype",
        "use_deterministic_algorithms",
        "set_float32_matmul_precision",
        "numel",
        "typename",
        "get_rng_state",
        "set_rng_state",
    ]
)
_TORCH_TENSOR_UTILS = frozenset({"torch.nn.utils.clip_grad_norm_", "torch.nn.utils.get_total_norm"})
_NOT_TENSOR_METHODS = frozenset(
    [
        "item",
        "tolist",
        "numpy",
        "size",
        "dim",
        "numel",
        "nelement",
        "element_size",
        "backward",
        "data_ptr",
        "stride",
        "is_contiguous",
        "get_device",
        "untyped_storage",
        "keys",
        "values",
        "items",
        "append",
        "step",
        "zero_grad",
        "state_dict",
        "parameters",
        "named_parameters",
        "train",
        "eval",
        "format",
        "join",
    ]
)
_NOT_TENSOR_ATTRS = frozenset(
    {"shape", "dtype", "device", "ndim", "is_cuda", "requires_grad", "names", "layout"}
)
_MODEL_LIKE = re.compile(r"(^|_)(model|net|network|criterion|module|lm)($|_)|loss")
_LOG_WORDS = frozenset({"log", "logging", "print", "verbose", "report", "display", "debug"})
_PAD_SINKS = frozenset(
    {"full", "zeros", "ones", "empty", "pad", "new_full", "new_zeros", "new_ones", "new_empty"}
)
_SUPPRESSION = re.compile(r"#\s*portatrain:\s*ignore(?:\[(?P<ids>[^\]]*)\])?(?P<reason>.*)")
_SKIP_DIRS = frozenset(
    {"__pycache__", "node_modules", "site-packages", "build", "dist", "venv", ".venv", ".git", ".tox"}
)

_Scope = ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.Module
_Loop = ast.For | ast.AsyncFor | ast.While


class AuditError(UserError, ValueError):
    """A path or argument the audit cannot use; the message names it and the fix."""


@dataclass(frozen=True)
class Finding:
    """One problem at one place. ``line`` and ``column`` are 1-based (column in characters)."""

    path: str
    line: int
    column: int
    end_line: int
    end_column: int
    rule: str
    severity: str
    message: str
    replacement: str
    justification: str | None = None
    """For a suppressed finding: the text after the suppression comment (why it is fine)."""

    @property
    def level(self) -> int:
        return RULES[self.rule].level

    @property
    def category(self) -> str:
        return RULES[self.rule].category

    def to_dict(self) -> dict[str, Any]:
        record = {
            "path": self.path,
            "line": self.line,
            "column": self.column,
            "end_line": self.end_line,
            "end_column": self.end_column,
            "rule": self.rule,
            "severity": self.severity,
            "level": self.level,
            "category": self.category,
            "message": self.message,
            "replacement": self.replacement,
        }
        if self.justification is not None:
            record["justification"] = self.justification
        return record


@dataclass
class AuditResult:
    """Everything one audit run found; formats render it, the CLI turns it into an exit code."""

    findings: list[Finding]
    """Active findings (not suppressed, not disabled), sorted by path, line, column."""
    suppressed: list[Finding]
    """Findings silenced by an inline ``# portatrain: ignore``, kept as evidence."""
    files: list[str]
    """Every file scanned, as displayed."""
    paths: list[str]
    """The paths the audit was asked for."""
    config: AuditConfig = field(default_factory=AuditConfig)

    def count(self, severity: str) -> int:
        return sum(f.severity == severity for f in self.findings)

    def fails(self, fail_on: str) -> bool:
        """Whether any finding is at least as severe as ``fail_on`` (``never``: never fails)."""
        if fail_on == "never":
            return False
        worst = SEVERITIES.index(fail_on)
        return any(SEVERITIES.index(f.severity) <= worst for f in self.findings)


# -- driving the scan ------------------------------------------------------------------------------
def audit_paths(paths: Sequence[str | os.PathLike[str]], config: AuditConfig | None = None) -> AuditResult:
    """Scan every ``.py`` file under ``paths`` (files are scanned as given, whatever their suffix)."""
    config = config or AuditConfig()
    files = list(_expand(paths, config))
    findings: list[Finding] = []
    suppressed: list[Finding] = []
    for path in files:
        display = _display(path)
        for finding in scan_file(path, display=display):
            if finding.rule in config.disable:
                continue
            if finding.rule in config.severity:
                finding = replace(finding, severity=config.severity[finding.rule])
            (suppressed if finding.justification is not None else findings).append(finding)
    order = lambda f: (f.path, f.line, f.column, f.rule)  # noqa: E731
    return AuditResult(
        findings=sorted(findings, key=order),
        suppressed=sorted(suppressed, key=order),
        files=[_display(p) for p in files],
        paths=[str(p) for p in paths],
        config=config,
    )


def scan_file(path: str | os.PathLike[str], *, display: str | None = None) -> list[Finding]:
    """All findings of one file, suppressed ones included (their ``justification`` is not None)."""
    display = display or str(path)
    try:
        with tokenize.open(path) as handle:  # honours a PEP 263 coding cookie
            source = handle.read()
    except (SyntaxError, UnicodeDecodeError) as exc:
        return [_syntax_finding(display, 1, 1, f"cannot decode the file: {exc}")]
    return scan_source(source, display)


def scan_source(source: str, path: str = "<string>") -> list[Finding]:
    """All findings of one module's source, suppressed ones included."""
    try:
        tree = ast.parse(source, filename=path)
    except SyntaxError as exc:
        return [_syntax_finding(path, exc.lineno or 1, exc.offset or 1, f"syntax error: {exc.msg}")]
    return _FileScan(tree, source, path).run()


def _syntax_finding(path: str, line: int, column: int, message: str) -> Finding:
    rule = RULES["syntax-error"]
    return Finding(path, line, column, line, column, rule.id, rule.severity, message, rule.replacement)


def _expand(paths: Sequence[str | os.PathLike[str]], config: AuditConfig) -> Iterator[Path]:
    missing = [str(p) for p in paths if not Path(p).exists()]
    if missing:
        raise AuditError(f"no such file or directory: {', '.join(missing)}; pass existing files or folders")
    seen: set[Path] = set()
    for raw in paths:
        path = Path(raw)
        if path.is_file():
            candidates: Iterable[Path] = [path]  # named explicitly: scanned even if excluded
        else:
            candidates = (
                p
                for p in sorted(path.rglob("*.py"))
                if not any(
                    part in _SKIP_DIRS or part.startswith(".") for part in p.relative_to(path).parts[:-1]
                )
                and not config.excludes(p)
            )
        for candidate in candidates:
            key = candidate.resolve()
            if key not in seen:
                seen.add(key)
                yield candidate


def _display(path: Path) -> str:
    try:
        return path.resolve().relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return path.resolve().as_posix()


# -- one file --------------------------------------------------------------------------------------
class _FileScan:
    def __init__(self, tree: ast.Module, source: str, path: str) -> None:
        self.tree = tree
        self.source = source
        self.path = path
        # Lines as ast numbers them (\n, \r\n or \r only: str.splitlines also splits on \f and others).
        self.line_bytes = [line.encode("utf-8") for line in re.split(r"\r\n|\r|\n", source)]
        self.suppressions = _read_suppressions(source)
        self.parent: dict[int, ast.AST] = {}
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                self.parent[id(child)] = node
        self.aliases = _aliases(tree)
        self.findings: dict[tuple[str, int], Finding] = {}
        self.claimed: set[int] = set()  # nodes inside a finding that already covers them
        self._assignments: dict[int, dict[str, list[tuple[int, ast.expr]]]] = {}
        self._tensor_params: dict[int, dict[str, str]] = {}
        self.training_loops: set[int] = set()
        self.step_functions: set[int] = set()
        self._find_training_step()

    # -- output ---------------------------------------------------------------------------------
    def run(self) -> list[Finding]:
        for node in ast.walk(self.tree):  # breadth-first: ancestors before descendants
            check = getattr(self, f"_check_{type(node).__name__}", None)
            if check is not None:
                check(node)
        return sorted(self.findings.values(), key=lambda f: (f.line, f.column, f.rule))

    def report(
        self,
        rule_id: str,
        node: ast.AST,
        message: str | None = None,
        replacement: str | None = None,
        *,
        column: int | None = None,
    ) -> None:
        rule = RULES[rule_id]
        line = node.lineno
        key = (rule_id, line)
        if key in self.findings:  # one finding per rule and line is enough to act on
            return
        col = self._char_column(line, node.col_offset if column is None else column)
        end_line = node.end_lineno or line
        end_col = self._char_column(end_line, node.end_col_offset or node.col_offset)
        self.findings[key] = Finding(
            path=self.path,
            line=line,
            column=col,
            end_line=end_line,
            end_column=end_col,
            rule=rule_id,
            severity=rule.severity,
            message=message or rule.summary,
            replacement=replacement or rule.replacement,
            justification=self._suppression(rule_id, node),
        )

    def _char_column(self, line: int, byte_offset: int) -> int:
        # ast offsets count UTF-8 bytes; editors and SARIF count characters.
        if 0 < line <= len(self.line_bytes):
            return len(self.line_bytes[line - 1][:byte_offset].decode("utf-8", errors="replace")) + 1
        return byte_offset + 1

    def _suppression(self, rule_id: str, node: ast.AST) -> str | None:
        lines = [node.lineno]
        statement = self._statement(node)
        if statement is not None:
            lines.append(statement.lineno)
        for line in lines:
            entry = self.suppressions.get(line)
            if entry is not None and (entry[0] is None or rule_id in entry[0]):
                return entry[1]
        return None

    def _statement(self, node: ast.AST) -> ast.stmt | None:
        current: ast.AST | None = node
        while current is not None and not isinstance(current, ast.stmt):
            current = self.parent.get(id(current))
        return current

    def claim(self, node: ast.AST) -> None:
        self.claimed.update(id(n) for n in ast.walk(node))

    def text(self, node: ast.AST, limit: int = 60) -> str:
        """The expression as written in the file (whitespace collapsed, long ones shortened)."""
        # Not ast.get_source_segment: it splits the whole source on every call (quadratic).
        first, last = node.lineno, node.end_lineno
        start, end = node.col_offset, node.end_col_offset
        if last is None or end is None or not 0 < first <= last <= len(self.line_bytes):
            return _short(ast.unparse(node), limit)
        lines = self.line_bytes[first - 1 : last]
        if first == last:
            segment = lines[0][start:end]
        else:
            segment = b" ".join([lines[0][start:], *lines[1:-1], lines[-1][:end]])
        return _short(" ".join(segment.decode("utf-8", errors="replace").split()), limit)

    # -- names ----------------------------------------------------------------------------------
    def qualname(self, node: ast.AST) -> str | None:
        """``th.cuda.synchronize`` -> ``torch.cuda.synchronize`` (None unless rooted in an import)."""
        if isinstance(node, ast.Name):
            return self.aliases.get(node.id)
        if isinstance(node, ast.Attribute):
            base = self.qualname(node.value)
            return f"{base}.{node.attr}" if base else None
        return None

    def method(self, call: ast.Call) -> str | None:
        """``x.item()`` -> ``item``; None for module functions such as ``torch.cuda.synchronize()``."""
        if isinstance(call.func, ast.Attribute) and self.qualname(call.func) is None:
            return call.func.attr
        return None

    def builtin(self, call: ast.Call) -> str | None:
        if isinstance(call.func, ast.Name) and call.func.id not in self.aliases:
            return call.func.id
        return None

    def report_method(
        self, rule_id: str, call: ast.Call, message: str, replacement: str | None = None
    ) -> None:
        """Point at the method name (``.item`` in ``loss.item()``), not at the receiver."""
        func = call.func
        assert isinstance(func, ast.Attribute)
        column = None
        if func.end_lineno == func.lineno and func.end_col_offset is not None:
            column = func.end_col_offset - len(func.attr.encode("utf-8"))
        self.report(rule_id, call if column is None else func, message, replacement, column=column)

    # -- where the training step is -------------------------------------------------------------
    def _find_training_step(self) -> None:
        functions = [n for n in ast.walk(self.tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
        step_names = set(STEP_DRIVERS)
        calls = [n for n in ast.walk(self.tree) if isinstance(n, ast.Call)]
        for _ in range(2):  # a step function may call another one
            for call in calls:
                if self._is_step_marker(call, step_names):
                    owner = self._loop_or_function(call)
                    if isinstance(owner, _Loop):
                        self.training_loops.add(id(owner))
                    elif owner is not None:
                        self.step_functions.add(id(owner))
            # Only module functions and methods propagate by name: a nested `def train(batch)`
            # must not turn every `model.train()` caller into a step.
            step_names |= {
                f.name
                for f in functions
                if id(f) in self.step_functions
                and isinstance(self.parent.get(id(f)), ast.Module | ast.ClassDef)
            }
        self.step_functions |= {id(f) for f in functions if f.name in STEP_HOOKS}

    def _is_step_marker(self, call: ast.Call, step_names: set[str]) -> bool:
        func = call.func
        if self.qualname(func) == "torch.autograd.backward":
            return True
        if isinstance(func, ast.Attribute):
            if func.attr == "backward":
                return True
            if func.attr == "step":
                receiver = _terminal_name(func.value).lower()
                return "optim" in receiver or receiver == "opt" or "scaler" in receiver
            # `self.train_step(...)` calls the step; `self.model.train()` does not.
            own = isinstance(func.value, ast.Name) and func.value.id == "self"
            return own and func.attr in step_names
        return isinstance(func, ast.Name) and func.id in step_names

    def _loop_or_function(self, node: ast.AST) -> ast.AST | None:
        """Nearest enclosing loop whose body holds ``node``, or the enclosing function."""
        child, current = node, self.parent.get(id(node))
        while current is not None:
            if isinstance(current, _Loop) and any(child is s for s in current.body):
                return current
            if isinstance(current, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                return current
            child, current = current, self.parent.get(id(current))
        return None

    def in_step(self, node: ast.AST) -> bool:
        """Whether ``node`` runs on every training step (outside a logging gate)."""
        child, current = node, self.parent.get(id(node))
        while current is not None:
            if (
                isinstance(current, ast.If)
                and any(child is s for s in current.body)
                and _is_log_gate(current.test)
            ):
                return False
            if (
                isinstance(current, _Loop)
                and id(current) in self.training_loops
                and any(child is s for s in current.body)
            ):
                return True
            if isinstance(current, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                return id(current) in self.step_functions
            if isinstance(current, ast.ClassDef):
                return False
            child, current = current, self.parent.get(id(current))
        return False

    # -- what is a tensor -----------------------------------------------------------------------
    def _scope(self, node: ast.AST) -> _Scope:
        current = self.parent.get(id(node))
        while current is not None and not isinstance(current, _Scope):
            current = self.parent.get(id(current))
        return current or self.tree

    def assignments(self, scope: _Scope) -> dict[str, list[tuple[int, ast.expr]]]:
        """Name -> [(line, assigned expression)] for the scope's own statements, in line order."""
        if id(scope) not in self._assignments:
            table: dict[str, list[tuple[int, ast.expr]]] = {}
            for node in _walk_scope(scope):
                targets: list[ast.expr] = []
                value: ast.expr | None = None
                if isinstance(node, ast.Assign):
                    targets, value = node.targets, node.value
                elif isinstance(node, ast.AnnAssign | ast.AugAssign | ast.NamedExpr):
                    targets, value = [node.target], node.value
                if value is None:
                    continue
                for target in targets:
                    for name in _target_names(target):
                        table.setdefault(name, []).append((node.lineno, value))
            for entries in table.values():
                entries.sort(key=lambda e: e[0])
            self._assignments[id(scope)] = table
        return self._assignments[id(scope)]

    def resolve(self, name: ast.Name) -> ast.expr | None:
        """The expression last assigned to ``name`` before its line, in its own scope."""
        entries = self.assignments(self._scope(name)).get(name.id, [])
        earlier = [value for line, value in entries if line < name.lineno]
        return earlier[-1] if earlier else None

    def tensor_params(self, scope: _Scope) -> dict[str, str]:
        """Parameters annotated with a tensor type: name -> ``tensor`` or ``container``."""
        if id(scope) not in self._tensor_params:
            kinds: dict[str, str] = {}
            if isinstance(scope, ast.FunctionDef | ast.AsyncFunctionDef):
                args = scope.args
                for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
                    if arg.annotation is not None and "Tensor" in ast.unparse(arg.annotation):
                        container = isinstance(arg.annotation, ast.Subscript)
                        kinds[arg.arg] = "container" if container else "tensor"
            self._tensor_params[id(scope)] = kinds
        return self._tensor_params[id(scope)]

    def is_tensor(self, node: ast.AST, depth: int = 0) -> bool:
        if depth > 8:
            return False
        if isinstance(node, ast.Name):
            kind = self.tensor_params(self._scope(node)).get(node.id)
            if kind is not None:
                return kind == "tensor"
            value = self.resolve(node)
            return value is not None and self.is_tensor(value, depth + 1)
        if isinstance(node, ast.Call):
            return self._call_is_tensor(node, depth)
        if isinstance(node, ast.BinOp):
            return self.is_tensor(node.left, depth + 1) or self.is_tensor(node.right, depth + 1)
        if isinstance(node, ast.UnaryOp):
            return self.is_tensor(node.operand, depth + 1)
        if isinstance(node, ast.Compare):
            return any(self.is_tensor(x, depth + 1) for x in [node.left, *node.comparators])
        if isinstance(node, ast.Subscript):
            if isinstance(node.value, ast.Name) and self.tensor_params(self._scope(node)).get(node.value.id):
                return True  # an element of a dict[str, Tensor] / list[Tensor] parameter, or a slice
            return self.is_tensor(node.value, depth + 1)
        if isinstance(node, ast.Attribute):
            if node.attr in _NOT_TENSOR_ATTRS:
                return False
            return node.attr in ("loss", "logits") or self.is_tensor(node.value, depth + 1)
        if isinstance(node, ast.IfExp):
            return self.is_tensor(node.body, depth + 1) or self.is_tensor(node.orelse, depth + 1)
        return False

    def _call_is_tensor(self, call: ast.Call, depth: int) -> bool:
        qualname = self.qualname(call.func)
        if qualname is not None:
            parts = qualname.split(".")
            if qualname.startswith(("torch.nn.functional.", "torch.linalg.", "torch.special.", "torch.fft.")):
                return True
            if qualname in _TORCH_TENSOR_UTILS:
                return True
            return (
                len(parts) == 2
                and parts[0] == "torch"
                and parts[1][:1].islower()
                and parts[1] not in _TORCH_NOT_TENSOR
            )
        if isinstance(call.func, ast.Attribute):
            if call.func.attr in _NOT_TENSOR_METHODS:
                return False
            if self.is_tensor(call.func.value, depth + 1):
                return True
        return bool(_MODEL_LIKE.search(_terminal_name(call.func).lower()))

    # -- checks, by node type -------------------------------------------------------------------
    def _check_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._check_module(node, alias.name)

    def _check_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level or not node.module:
            return
        if node.module == "torch.utils" and any(a.name == "cpp_extension" for a in node.names):
            self._check_module(node, "torch.utils.cpp_extension")
        if node.module == "numba" and any(a.name == "cuda" for a in node.names):
            self._check_module(node, "numba.cuda")
        self._check_module(node, node.module)

    def _check_module(self, node: ast.stmt, module: str) -> None:
        top = module.split(".")[0]
        if top in CUDA_LIBRARIES:
            self.report(
                "cuda-library",
                node,
                f"`{top}` is a CUDA-only kernel library",
                CUDA_LIBRARIES[top],
            )
        elif module == "numba.cuda" or module.startswith("numba.cuda."):
            self.report(
                "cuda-library", node, "`numba.cuda` kernels run only on NVIDIA GPUs", CUDA_LIBRARIES["cupy"]
            )
        elif module == "torch.utils.cpp_extension" or module.startswith("torch.utils.cpp_extension."):
            self.report(
                "cuda-extension", node, "`torch.utils.cpp_extension` builds a custom C++/CUDA extension"
            )

    def _check_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Load):
            self._check_reference(node)

    def _check_Attribute(self, node: ast.Attribute) -> None:
        parent = self.parent.get(id(node))
        if isinstance(parent, ast.Attribute) and parent.value is node:
            return  # only the whole chain (``torch.cuda.amp.GradScaler``), not its prefixes
        self._check_reference(node)

    def _check_reference(self, node: ast.Name | ast.Attribute) -> None:
        qualname = self.qualname(node)
        if qualname is None or id(node) in self.claimed:
            return
        parts = qualname.split(".")
        if parts[:2] == ["torch", "cuda"]:
            self._check_torch_cuda(node, qualname, parts[2:])
        elif parts[:2] == ["torch", "backends"] and len(parts) > 2 and parts[2] in ("cuda", "cudnn"):
            if parts[-1] in _SDP_FLAGS:
                self.report("sdpa-backend-pin", node, f"`{qualname}` pins SDPA to a CUDA kernel")
            else:
                replacement = _BACKEND_FLAG_REPLACEMENTS.get(parts[-1])
                self.report(
                    "cuda-backend-flag",
                    node,
                    f"`{qualname}` is a CUDA-only switch: off NVIDIA it does nothing",
                    replacement,
                )
        elif qualname == "torch.nn.attention.sdpa_kernel":
            self.report(
                "sdpa-backend-pin", node, "`sdpa_kernel(...)` restricts SDPA to the named (CUDA) backends"
            )
        elif qualname.endswith("Backend.NCCL") and parts[0] == "torch":
            self.report("nccl-backend", node, f"`{qualname}` hard-codes the NCCL backend")
        elif parts[0] in _PICKLE_MODULES and len(parts) == 2:
            if parts[1] == "Unpickler" and self._is_restricted_unpickler_base(node):
                return  # a subclass whose find_class allow-lists globals is the safe way to unpickle
            if parts[1] in ("load", "loads", "Unpickler"):
                self.report("pickle-load", node, f"`{qualname}` unpickles, which runs code from the file")
            elif parts[1] in ("dump", "dumps", "Pickler"):
                self.report("pickle-dump", node, f"`{qualname}` writes a pickle, readable only by unpickling")
        elif qualname == "torch.ops.load_library":
            self.report("cuda-extension", node, "`torch.ops.load_library` loads a compiled custom-op library")

    def _is_restricted_unpickler_base(self, node: ast.AST) -> bool:
        owner = self.parent.get(id(node))
        return (
            isinstance(owner, ast.ClassDef)
            and any(base is node for base in owner.bases)
            and any(isinstance(item, ast.FunctionDef) and item.name == "find_class" for item in owner.body)
        )

    def _check_torch_cuda(self, node: ast.AST, qualname: str, rest: list[str]) -> None:
        head = rest[0] if rest else ""
        if head == "amp":
            self.report("cuda-amp", node, f"`{qualname}` is CUDA-only (and deprecated)")
        elif head == "set_device":
            self.report("cuda-set-device", node, "`torch.cuda.set_device` exists only for CUDA")
        elif head == "is_available":
            self.report(
                "cuda-device-branch",
                node,
                "a branch on `torch.cuda.is_available()`: off NVIDIA the CPU path runs, silently",
            )
        else:
            self.report("cuda-api", node, f"`{qualname}` is CUDA-only", _CUDA_API_REPLACEMENTS.get(head))

    def _check_IfExp(self, node: ast.IfExp) -> None:
        if id(node) in self.claimed:
            return
        mentions_cuda = any(_cuda_string(n) for n in (node.body, node.orelse))
        tests_cuda = any(
            isinstance(n, ast.Attribute | ast.Name) and self.qualname(n) == "torch.cuda.is_available"
            for n in ast.walk(node.test)
        )
        if mentions_cuda or tests_cuda:
            self.report(
                "cuda-device-branch",
                node,
                '`"cuda" if ... else "cpu"`: off NVIDIA this silently picks the CPU',
            )
            self.claim(node)

    def _check_keyword(self, node: ast.keyword) -> None:
        value = node.value
        if node.arg == "pin_memory":
            cuda_tied = any(
                self.qualname(n) in ("torch.cuda.is_available",) or _cuda_string(n)
                for n in ast.walk(value)
                if isinstance(n, ast.Name | ast.Attribute | ast.Constant | ast.JoinedStr)
            )
            if cuda_tied or (isinstance(value, ast.Constant) and value.value is True):
                self.report(
                    "pin-memory-cuda", node, f"`pin_memory={self.text(value)}` pins host memory for CUDA"
                )
                self.claim(value)
        elif node.arg == "pin_memory_device" and _cuda_string(value):
            self.report("pin-memory-cuda", node, "`pin_memory_device` names CUDA")
            self.claim(value)
        elif node.arg in _SDP_KWARGS:
            self.report("sdpa-backend-pin", node, f"`{node.arg}=` selects a CUDA SDPA kernel")
        elif node.arg == "padding" and isinstance(value, ast.Constant) and value.value in (True, "longest"):
            call = self.parent.get(id(node))
            bucketed = isinstance(call, ast.Call) and any(
                k.arg == "pad_to_multiple_of" for k in call.keywords
            )
            if not bucketed:
                self.report(
                    "pad-to-batch-max",
                    node,
                    f"`padding={self.text(value)}` pads each batch to its own longest sequence",
                    '`padding="max_length", max_length=N`, or `pad_to_multiple_of=` a bucket width',
                )
        elif node.arg == "attn_implementation" and str(getattr(value, "value", "")).startswith(
            "flash_attention"
        ):
            self.report(
                "cuda-library",
                node,
                f"`attn_implementation={_show(value)}` needs the CUDA-only flash_attn package",
                '`attn_implementation="sdpa"`',
            )

    def _check_Constant(self, node: ast.Constant) -> None:
        if not isinstance(node.value, str) or id(node) in self.claimed:
            return
        parent = self.parent.get(id(node))
        if isinstance(parent, ast.JoinedStr | ast.BinOp):
            return  # judged as a whole by _check_JoinedStr / _check_BinOp
        text = node.value
        if text.lower() == "nccl" and _is_value_position(node, parent):
            self.report("nccl-backend", node, '`"nccl"` hard-codes the NCCL process-group backend')
        elif _CUDA_SOURCE.match(text) and isinstance(parent, ast.List | ast.Tuple | ast.Call | ast.keyword):
            self.report("cuda-extension", node, f'`"{text}"` is a CUDA source file built into an extension')
        elif _DEVICE_STRING.match(text):
            self._check_device_string(node, parent)

    def _check_JoinedStr(self, node: ast.JoinedStr) -> None:
        if _cuda_string(node) and id(node) not in self.claimed:
            self._check_device_string(node, self.parent.get(id(node)))
        if self.in_step(node):
            for part in node.values:
                if isinstance(part, ast.FormattedValue) and self.is_tensor(part.value):
                    self.report(
                        "host-sync",
                        part,
                        f"formatting the tensor `{self.text(part.value)}` in the training step waits on the device",
                    )

    def _check_device_string(self, node: ast.expr, parent: ast.AST | None) -> None:
        text = self.text(node)
        explicit = not (isinstance(node, ast.Constant) and node.value == "cuda")  # "cuda:0", f"cuda:{r}"
        context = False
        if isinstance(parent, ast.keyword):
            context = parent.arg in _DEVICE_KWARGS
        elif isinstance(parent, ast.Call) and parent.args and parent.args[0] is node:
            context = self.qualname(parent.func) in _DEVICE_CALLS or self.method(parent) == "to"
        elif isinstance(parent, ast.Assign | ast.AnnAssign):
            targets = parent.targets if isinstance(parent, ast.Assign) else [parent.target]
            context = any("device" in _terminal_name(t).lower() for t in targets)
        if context or (explicit and not isinstance(parent, ast.Compare)):
            self.report("cuda-device-string", node, f"`{text}` hard-codes the CUDA device")

    def _check_BinOp(self, node: ast.BinOp) -> None:
        # "cuda:" + str(rank)
        if (
            isinstance(node.op, ast.Add)
            and isinstance(node.left, ast.Constant)
            and node.left.value == "cuda:"
            and id(node) not in self.claimed
        ):
            self.report("cuda-device-string", node, f"`{self.text(node)}` hard-codes the CUDA device")

    def _check_Call(self, node: ast.Call) -> None:
        qualname = self.qualname(node.func)
        method = self.method(node)
        builtin = self.builtin(node)
        if method == "cuda":
            self.report_method("cuda-call", node, f"`{self.text(node)}` moves to an NVIDIA GPU")
        if qualname is not None and qualname.split(".")[-1] == "DistributedDataParallel":
            for keyword in node.keywords:
                if keyword.arg in ("device_ids", "output_device") and not _is_none(keyword.value):
                    self.report("ddp-device-ids", keyword, f"`{keyword.arg}=` names CUDA device indices")
        if qualname == "torch.load":
            self._check_torch_load(node)
        elif qualname == "torch.nn.utils.rnn.pad_sequence" and not self._mentions_buckets(node):
            self.report(
                "pad-sequence-unbucketed", node, "`pad_sequence` pads to this batch's longest sequence"
            )
        if builtin == "max" or method == "max":
            self._check_batch_max(node)
        if self._is_softmax(node, qualname, method):
            self._check_attention(node, qualname, method)
        if self.in_step(node):
            self._check_step_call(node, qualname, method, builtin)

    def _check_torch_load(self, node: ast.Call) -> None:
        flag = next((k.value for k in node.keywords if k.arg == "weights_only"), None)
        if flag is None:
            self.report("torch-load-implicit", node, "`torch.load` without `weights_only=`")
        elif isinstance(flag, ast.Constant) and flag.value is False:
            self.report(
                "torch-load-unsafe", node, "`torch.load(weights_only=False)` unpickles arbitrary code"
            )
        elif not (isinstance(flag, ast.Constant) and flag.value is True):
            self.report(
                "torch-load-implicit",
                node,
                f"`torch.load(weights_only={self.text(flag)})`: not provably True",
            )

    def _check_step_call(
        self, node: ast.Call, qualname: str | None, method: str | None, builtin: str | None
    ) -> None:
        if method in _HOST_SYNC_METHODS:
            self.report_method(
                "host-sync", node, f"`.{method}()` in the training step waits for the device to finish"
            )
        elif (
            method == "to"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and node.args[0].value == "cpu"
        ):
            self.report_method("host-sync", node, '`.to("cpu")` in the training step waits for the device')
        elif builtin == "print" and any(self.is_tensor(arg) for arg in node.args):
            self.report(
                "host-sync", node, "`print(tensor)` in the training step copies the tensor to the host"
            )
        elif builtin in ("float", "int", "bool") and len(node.args) == 1 and self.is_tensor(node.args[0]):
            self.report(
                "host-sync",
                node,
                f"`{builtin}({self.text(node.args[0], 40)})` of a tensor in the training step waits on the device",
            )
        if method in _DYNAMIC_SHAPE_METHODS:
            self.report_method(
                "data-dependent-shape", node, f"`.{method}()` returns a shape that depends on the values"
            )
        elif qualname is not None and qualname.split(".")[0] == "torch":
            name = qualname.split(".")[-1]
            if name in _DYNAMIC_SHAPE_METHODS or (
                name == "where" and len(node.args) == 1 and not node.keywords
            ):
                self.report(
                    "data-dependent-shape",
                    node,
                    f"`{qualname}(...)` returns a shape that depends on the values",
                )

    def _check_Subscript(self, node: ast.Subscript) -> None:
        if isinstance(node.ctx, ast.Load) and self._is_boolean_index(node.slice) and self.in_step(node):
            self.report(
                "data-dependent-shape",
                node,
                f"boolean-mask indexing `{self.text(node)}`: its shape depends on the mask's values",
            )

    def _is_boolean_index(self, index: ast.expr, depth: int = 0) -> bool:
        if depth > 4:
            return False
        if isinstance(index, ast.Compare):
            return True
        if isinstance(index, ast.UnaryOp) and isinstance(index.op, ast.Invert):
            return self._is_boolean_index(index.operand, depth + 1)
        if isinstance(index, ast.BinOp) and isinstance(index.op, ast.BitAnd | ast.BitOr):
            return self._is_boolean_index(index.left, depth + 1) or self._is_boolean_index(
                index.right, depth + 1
            )
        if (
            isinstance(index, ast.Call)
            and isinstance(index.func, ast.Attribute)
            and index.func.attr == "bool"
        ):
            return True
        if isinstance(index, ast.Name | ast.Attribute) and "mask" in _terminal_name(index).lower():
            return True
        if isinstance(index, ast.Name):
            value = self.resolve(index)
            return value is not None and self._is_boolean_index(value, depth + 1)
        return False

    def _check_If(self, node: ast.If) -> None:
        self._check_condition(node, node.test, "if")

    def _check_While(self, node: ast.While) -> None:
        self._check_condition(node, node.test, "while")

    def _check_Assert(self, node: ast.Assert) -> None:
        self._check_condition(node, node.test, "assert")

    def _check_condition(self, node: ast.stmt, test: ast.expr, keyword: str) -> None:
        runs_per_step = self.in_step(node) or id(node) in self.training_loops
        if runs_per_step and _truth_of_tensor(self, test):
            self.report(
                "tensor-control-flow",
                test,
                f"`{keyword} {self.text(test)}` reads a tensor's value on the host every step",
            )

    # -- attention ------------------------------------------------------------------------------
    def _is_softmax(self, node: ast.Call, qualname: str | None, method: str | None) -> bool:
        if qualname in ("torch.softmax", "torch.nn.functional.softmax", "torch.special.softmax"):
            return bool(node.args)
        return method == "softmax"

    def _check_attention(self, node: ast.Call, qualname: str | None, method: str | None) -> None:
        scores = node.func.value if method == "softmax" else node.args[0]  # type: ignore[union-attr]
        if self._contains_qk(scores, 0):
            self.report(
                "manual-attention",
                node,
                f"softmax over a query-key product (`{self.text(scores)}`): attention outside SDPA",
            )

    def _contains_qk(self, node: ast.AST, depth: int) -> bool:
        if depth > 6:
            return False
        for sub in _walk_expr(node):
            if isinstance(sub, ast.BinOp) and isinstance(sub.op, ast.MatMult):
                if self._is_transposed(sub.right, 0):
                    return True
            elif isinstance(sub, ast.Call):
                qualname = self.qualname(sub.func)
                if qualname in ("torch.matmul", "torch.bmm", "torch.baddbmm") and len(sub.args) >= 2:
                    if self._is_transposed(sub.args[-1], 0):
                        return True
                elif self.method(sub) in ("matmul", "bmm") and sub.args:
                    if self._is_transposed(sub.args[0], 0):
                        return True
                elif qualname == "torch.einsum" and sub.args and _einsum_is_qk(sub.args[0]):
                    return True
            elif isinstance(sub, ast.Name):
                value = self.resolve(sub)
                if value is not None and self._contains_qk(value, depth + 1):
                    return True
        return False

    def _is_transposed(self, node: ast.AST, depth: int) -> bool:
        if depth > 4:
            return False
        if isinstance(node, ast.Attribute) and node.attr in ("T", "mT", "mH", "H"):
            return not _on_self(node.value)  # self.weight.T is a projection, not keys
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            attr = node.func.attr
            if attr in ("transpose", "permute", "swapaxes", "swapdims", "t"):
                return not _on_self(node.func.value)
            if attr in ("contiguous", "float", "to", "type_as", "half", "bfloat16"):
                return self._is_transposed(node.func.value, depth + 1)
        if isinstance(node, ast.Name):
            value = self.resolve(node)
            return value is not None and self._is_transposed(value, depth + 1)
        return False

    # -- dynamic shapes -------------------------------------------------------------------------
    def _mentions_buckets(self, node: ast.AST) -> bool:
        """Whether the enclosing function (or class) talks about buckets or multiples (then the
        padding is presumably bounded: a length-grouped sampler, ``pad_to_multiple_of``)."""
        current = self.parent.get(id(node))
        while current is not None and not isinstance(current, ast.FunctionDef | ast.AsyncFunctionDef):
            current = self.parent.get(id(current))
        scopes = [current] if current is not None else [self.tree]
        owner = self.parent.get(id(current)) if current is not None else None
        if isinstance(owner, ast.ClassDef):
            scopes.append(owner)
        for scope in scopes:
            for sub in ast.walk(scope):
                if isinstance(sub, ast.arg | ast.keyword):
                    name = (sub.arg or "").lower()
                else:
                    name = _terminal_name(sub).lower()
                if "bucket" in name or "multiple" in name:
                    return True
        return False

    def _check_batch_max(self, node: ast.Call) -> None:
        """``max_len = max(len(x) for x in batch)`` feeding a pad or a tensor constructor."""
        method = self.method(node)
        source = node.func.value if method == "max" else node  # type: ignore[union-attr]
        if not self._is_length_expr(source if method == "max" else node):
            return
        if not (self._feeds_padding(node) or self._assigned_name_feeds_padding(node)):
            return
        if self._mentions_buckets(node):
            return
        self.report(
            "pad-to-batch-max",
            node,
            f"`{self.text(node)}`: padding to this batch's longest sequence",
        )

    def _is_length_expr(self, node: ast.AST) -> bool:
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name) and (sub.id == "len" or "len" in sub.id.lower()):
                return True
            if isinstance(sub, ast.Attribute) and (sub.attr in ("shape",) or "len" in sub.attr.lower()):
                return True
            if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute) and sub.func.attr == "size":
                return True
        return False

    def _feeds_padding(self, node: ast.AST) -> bool:
        child, current = node, self.parent.get(id(node))
        while current is not None and not isinstance(current, ast.stmt):
            if isinstance(current, ast.BinOp) and isinstance(current.op, ast.Sub) and current.left is child:
                return True  # max_len - len(seq): the amount of padding
            if isinstance(current, ast.Call) and _terminal_name(current.func) in _PAD_SINKS:
                return True
            child, current = current, self.parent.get(id(current))
        return False

    def _assigned_name_feeds_padding(self, node: ast.AST) -> bool:
        statement = self.parent.get(id(node))
        if not (
            isinstance(statement, ast.Assign) and statement.value is node and len(statement.targets) == 1
        ):
            return False
        target = statement.targets[0]
        if not isinstance(target, ast.Name):
            return False
        scope = self._scope(statement)
        return any(
            isinstance(sub, ast.Name)
            and sub.id == target.id
            and isinstance(sub.ctx, ast.Load)
            and sub.lineno >= statement.lineno
            and self._feeds_padding(sub)
            for sub in _walk_scope(scope)
        )


# -- helpers ---------------------------------------------------------------------------------------
def _aliases(tree: ast.Module) -> dict[str, str]:
    """Local name -> dotted path, from every absolute import in the file."""
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    aliases[alias.asname] = alias.name
                else:
                    top = alias.name.split(".")[0]
                    aliases[top] = top
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                if alias.name != "*":
                    aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return aliases


def _read_suppressions(source: str) -> dict[int, tuple[frozenset[str] | None, str]]:
    """Line -> (rule ids or None for all, justification) from ``# portatrain: ignore`` comments."""
    found: dict[int, tuple[frozenset[str] | None, str]] = {}
    try:
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type != tokenize.COMMENT:
                continue
            match = _SUPPRESSION.search(token.string)
            if match is None:
                continue
            ids = match.group("ids")
            rules = None if ids is None else frozenset(i.strip() for i in ids.split(",") if i.strip())
            reason = match.group("reason").strip().lstrip("-—:#").strip()
            found[token.start[0]] = (rules, reason)
    except (tokenize.TokenError, SyntaxError):
        pass  # the file parsed with ast; a tokenizer hiccup only costs the suppressions
    return found


def _walk_scope(scope: ast.AST) -> Iterator[ast.AST]:
    """Nodes of a scope, not descending into nested functions, lambdas or classes."""
    stack = list(ast.iter_child_nodes(scope))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef):
            stack.extend(ast.iter_child_nodes(node))


def _walk_expr(node: ast.AST) -> Iterator[ast.AST]:
    stack = [node]
    while stack:
        current = stack.pop()
        yield current
        if not isinstance(current, ast.Lambda):
            stack.extend(ast.iter_child_nodes(current))


def _target_names(target: ast.expr) -> Iterator[str]:
    if isinstance(target, ast.Name):
        yield target.id
    elif isinstance(target, ast.Tuple | ast.List):
        for element in target.elts:
            yield from _target_names(element)
    elif isinstance(target, ast.Starred):
        yield from _target_names(target.value)


def _terminal_name(node: ast.AST) -> str:
    """``self.optimizer`` -> ``optimizer``; ``loss_fn`` -> ``loss_fn``; anything else -> ``""``."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def _on_self(node: ast.AST) -> bool:
    while isinstance(node, ast.Attribute):
        node = node.value
        if isinstance(node, ast.Name) and node.id == "self":
            return True
    return False


def _is_none(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


def _cuda_string(node: ast.AST) -> bool:
    """``"cuda"``, ``"cuda:0"``, ``f"cuda:{rank}"`` or ``"cuda:" + str(rank)``."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and bool(_DEVICE_STRING.match(node.value))
    if isinstance(node, ast.JoinedStr) and node.values:
        first = node.values[0]
        return isinstance(first, ast.Constant) and str(first.value).startswith("cuda:")
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return isinstance(node.left, ast.Constant) and node.left.value == "cuda:"
    return False


def _is_value_position(node: ast.AST, parent: ast.AST | None) -> bool:
    """A string used as a value (argument, assignment, dict value), not compared or a docstring."""
    if isinstance(parent, ast.keyword | ast.Call | ast.Return | ast.IfExp):
        return True
    if isinstance(parent, ast.Assign | ast.AnnAssign):
        return parent.value is node
    if isinstance(parent, ast.Dict):
        return any(v is node for v in parent.values)
    return False


def _is_log_gate(test: ast.expr) -> bool:
    """``step % log_every == 0``, ``should_log``, ``args.verbose``: a block that runs on logging steps."""
    for sub in ast.walk(test):
        if isinstance(sub, ast.BinOp) and isinstance(sub.op, ast.Mod):
            return True
        name = _terminal_name(sub).lower()
        if name and _LOG_WORDS & set(name.split("_")):
            return True
    return False


def _truth_of_tensor(scan: _FileScan, test: ast.expr) -> bool:
    """Whether evaluating ``test`` for truth reads a tensor's value (``loss < best``, ``x.any()``)."""
    if isinstance(test, ast.BoolOp):
        return any(_truth_of_tensor(scan, v) for v in test.values)
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return _truth_of_tensor(scan, test.operand)
    if isinstance(test, ast.Compare) and all(isinstance(op, ast.Is | ast.IsNot) for op in test.ops):
        return False  # `x is None` never reads the tensor
    return scan.is_tensor(test)


def _einsum_is_qk(spec: ast.AST) -> bool:
    """``"bhqd,bhkd->bhqk"``: two operands contracted over their shared last index, each keeping one
    free index -- a query-key product."""
    if not (isinstance(spec, ast.Constant) and isinstance(spec.value, str) and "->" in spec.value):
        return False
    inputs, output = spec.value.replace(" ", "").replace("...", "").split("->", 1)
    operands = inputs.split(",")
    if len(operands) != 2 or not all(operands):
        return False
    left, right = operands
    contracted = (set(left) & set(right)) - set(output)
    return (
        left[-1] == right[-1]
        and left[-1] in contracted
        and bool((set(left) - set(right)) & set(output))
        and bool((set(right) - set(left)) & set(output))
    )


def _show(node: ast.expr) -> str:
    """Source-like text of an expression, strings in double quotes as people write them."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return '"' + node.value + '"'
    return ast.unparse(node)


def _short(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
