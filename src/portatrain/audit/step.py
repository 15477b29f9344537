"""Where a file's training step is: the code that runs once per optimizer step.

A *training loop* is a ``for``/``while`` loop whose body (not a nested function) calls
``.backward()``, ``optimizer.step()``/``scaler.step()`` or a step function; a *step function* is a
function that does so outside any loop of its own, or a Trainer hook that runs once per step
(:data:`STEP_HOOKS`). The host-sync rules fire only there: an ``.item()`` in an evaluation
function or a data collator costs nothing per step and is not reported. Inside the step, a block
under a logging gate (``if step % log_every == 0:``, ``if should_log:``) is exempt: reading values
on logging steps only is how a loop keeps the device busy between them (see "Avoid unnecessary
CPU-GPU synchronization" in https://pytorch.org/tutorials/recipes/recipes/tuning_guide.html).
A gate whose interval defaults to 1 (``log_interval = 1``, ``add_argument("--log-interval",
default=1)``, a config field ``log_every: int = 1``) opens on every step, so it exempts nothing.

An *evaluation loop* is a loop outside the training step that calls a model, in a function named
for evaluation (``evaluate``, ``validate``, ``estimate_loss``, ...) or under ``torch.no_grad()``/
``torch.inference_mode()``: copying each batch's outputs to the host there stalls the device once
per batch.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable

from portatrain.audit.names import Names
from portatrain.audit.tree import Function, Loop, SourceTree, on_self, terminal_name

Resolver = Callable[[ast.Name], "ast.expr | None"]
"""What a name holds when the code runs with its defaults (``TensorInference.resolve_default``)."""

STEP_DRIVERS = frozenset({"train_step", "training_step", "forward_backward", "forward_backward_step"})
"""Functions that run one training step by contract: a loop that calls one is a training loop."""
STEP_HOOKS = STEP_DRIVERS | {"compute_loss"}
"""Functions that run on every training step by contract (portatrain's Trainer hooks and the usual
names elsewhere), scanned as step code even when they do not call ``.backward()`` themselves.
``compute_loss`` is one, but calling it does not make a loop a training loop (evaluation calls it)."""

_LOG_WORDS = frozenset({"log", "logging", "print", "verbose", "report", "display", "debug"})
_EVAL_FUNCTION = re.compile(r"eval|valid|test|predict|infer|estimate|score")
_MODEL_CALL = re.compile(r"(^|_)(model|net|network|module|lm|encoder|decoder)($|_)|^forward$")
_NO_GRAD = frozenset({"torch.no_grad", "torch.inference_mode"})


class TrainingStep:
    """The training loops and step functions of one file, found once when it is built."""

    def __init__(self, tree: SourceTree, names: Names, resolve: Resolver | None = None) -> None:
        self.tree = tree
        self.names = names
        self._resolve: Resolver = resolve or (lambda name: None)
        self._settings: dict[str, list[ast.expr]] | None = None
        self._every_step: dict[int, str | None] = {}
        self.training_loops: set[int] = set()
        """``id`` of every loop whose body runs a training step."""
        self.step_functions: set[int] = set()
        """``id`` of every function that is (or runs) one training step."""
        self._find()

    def _find(self) -> None:
        module = self.tree.module
        functions = [n for n in ast.walk(module) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
        step_names = set(STEP_DRIVERS)
        calls = [n for n in ast.walk(module) if isinstance(n, ast.Call)]
        for _ in range(2):  # a step function may call another one
            for call in calls:
                if self._is_step_marker(call, step_names):
                    owner = self._loop_or_function(call)
                    if isinstance(owner, Loop):
                        self.training_loops.add(id(owner))
                    elif owner is not None:
                        self.step_functions.add(id(owner))
            # Only module functions and methods propagate by name: a nested `def train(batch)`
            # must not turn every `model.train()` caller into a step.
            step_names |= {
                f.name
                for f in functions
                if id(f) in self.step_functions and isinstance(self.tree.parent(f), ast.Module | ast.ClassDef)
            }
        self.step_functions |= {id(f) for f in functions if f.name in STEP_HOOKS}

    def _is_step_marker(self, call: ast.Call, step_names: set[str]) -> bool:
        func = call.func
        if self.names.qualname(func) == "torch.autograd.backward":
            return True
        if isinstance(func, ast.Attribute):
            if func.attr == "backward":
                return True
            if func.attr == "step":
                receiver = terminal_name(func.value).lower()
                return "optim" in receiver or receiver == "opt" or "scaler" in receiver
            # `self.train_step(...)` calls the step; `self.model.train()` does not.
            own = isinstance(func.value, ast.Name) and func.value.id == "self"
            return own and func.attr in step_names
        return isinstance(func, ast.Name) and func.id in step_names

    def _loop_or_function(self, node: ast.AST) -> ast.AST | None:
        """Nearest enclosing loop whose body holds ``node``, or the enclosing function."""
        child, current = node, self.tree.parent(node)
        while current is not None:
            if isinstance(current, Loop) and any(child is s for s in current.body):
                return current
            if isinstance(current, Function):
                return current
            child, current = current, self.tree.parent(current)
        return None

    def is_training_loop(self, node: ast.AST) -> bool:
        return id(node) in self.training_loops

    def contains(self, node: ast.AST) -> bool:
        """Whether ``node`` runs on every training step (outside a logging gate that opens less
        often than every step)."""
        child, current = node, self.tree.parent(node)
        while current is not None:
            if (
                isinstance(current, ast.If)
                and any(child is s for s in current.body)
                and is_log_gate(current.test)
                and self.every_step_interval(current.test) is None
            ):
                return False
            if (
                isinstance(current, Loop)
                and id(current) in self.training_loops
                and any(child is s for s in current.body)
            ):
                return True
            if isinstance(current, Function):
                return id(current) in self.step_functions
            if isinstance(current, ast.ClassDef):
                return False
            child, current = current, self.tree.parent(current)
        return False

    def every_step_gate(self, node: ast.AST) -> str | None:
        """The interval (as written) of the logging gate around ``node`` that defaults to 1, or None."""
        child, current = node, self.tree.parent(node)
        while current is not None and not isinstance(current, Function | ast.ClassDef):
            if isinstance(current, ast.If) and any(child is s for s in current.body):
                interval = self.every_step_interval(current.test)
                if interval is not None:
                    return interval
            child, current = current, self.tree.parent(current)
        return None

    def every_step_interval(self, test: ast.expr) -> str | None:
        """``step % log_interval == 0`` where ``log_interval`` defaults to 1: its text, else None."""
        if id(test) not in self._every_step:
            self._every_step[id(test)] = next(
                (
                    ast.unparse(sub.right)
                    for sub in ast.walk(test)
                    if isinstance(sub, ast.BinOp) and isinstance(sub.op, ast.Mod) and self._is_one(sub.right)
                ),
                None,
            )
        return self._every_step[id(test)]

    def _is_one(self, node: ast.expr, depth: int = 0) -> bool:
        """Whether ``node`` is 1 when the code runs with its defaults."""
        if depth > 4:
            return False
        if isinstance(node, ast.Constant):
            return node.value == 1 and not isinstance(node.value, bool)
        if isinstance(node, ast.Name):
            value = self._resolve(node)
            if value is not None:
                return self._is_one(value, depth + 1)
            defaults = self.settings().get(node.id, [])
        elif isinstance(node, ast.Attribute):
            defaults = self.settings().get(node.attr, [])
        else:
            return False
        return bool(defaults) and all(self._is_one(d, depth + 1) for d in defaults)

    def settings(self) -> dict[str, list[ast.expr]]:
        """Setting name -> the defaults the file gives it: ``add_argument("--log-interval",
        default=1)``, a class field ``log_interval: int = 1``, a ``"log_interval": 1`` dict entry,
        a parameter default stored on ``self`` (``def __init__(self, log_interval=1)`` with
        ``self.log_interval = log_interval``)."""
        if self._settings is None:
            found: dict[str, list[ast.expr]] = {}
            for node in ast.walk(self.tree.module):
                if isinstance(node, ast.Call) and terminal_name(node.func) == "add_argument":
                    flag = next(
                        (
                            a.value
                            for a in node.args
                            if isinstance(a, ast.Constant) and str(a.value).startswith("--")
                        ),
                        None,
                    )
                    default = next((k.value for k in node.keywords if k.arg == "default"), None)
                    dest = next((k.value for k in node.keywords if k.arg == "dest"), None)
                    if isinstance(dest, ast.Constant):
                        flag = str(dest.value)
                    if flag is not None and default is not None:
                        found.setdefault(str(flag).lstrip("-").replace("-", "_"), []).append(default)
                elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    # `def __init__(self, log_interval=1)`: the default of `self.log_interval`
                    args = node.args
                    positional = [*args.posonlyargs, *args.args]
                    pairs = [
                        *zip(positional[len(positional) - len(args.defaults) :], args.defaults),
                        *zip(args.kwonlyargs, args.kw_defaults),
                    ]
                    defaults = {arg.arg: default for arg, default in pairs if default is not None}
                    for item in ast.walk(node):
                        if (
                            isinstance(item, ast.Assign)
                            and len(item.targets) == 1
                            and isinstance(item.targets[0], ast.Attribute)
                            and on_self(item.targets[0])
                            and isinstance(item.value, ast.Name)
                            and item.value.id in defaults
                        ):
                            found.setdefault(item.targets[0].attr, []).append(defaults[item.value.id])
                elif isinstance(node, ast.ClassDef):
                    for item in node.body:
                        targets = [item.target] if isinstance(item, ast.AnnAssign) else []
                        targets = item.targets if isinstance(item, ast.Assign) else targets
                        value = getattr(item, "value", None)
                        if len(targets) == 1 and isinstance(targets[0], ast.Name) and value is not None:
                            found.setdefault(targets[0].id, []).append(value)
                elif isinstance(node, ast.Dict):
                    for key, value in zip(node.keys, node.values):
                        if isinstance(key, ast.Constant) and isinstance(key.value, str):
                            found.setdefault(key.value, []).append(value)
            self._settings = found
        return self._settings

    def in_evaluation_loop(self, node: ast.AST) -> bool:
        """Whether ``node`` runs once per batch of an evaluation loop (see the module docstring)."""
        loop: ast.AST | None = None
        guarded = False
        child, current = node, self.tree.parent(node)
        while current is not None:
            if isinstance(current, Loop):
                if id(current) in self.training_loops:
                    return False
                if loop is None and any(child is s for s in current.body):
                    loop = current
            elif isinstance(current, ast.ListComp | ast.SetComp | ast.GeneratorExp):
                if loop is None and child is current.elt:
                    loop = current
            elif isinstance(current, ast.With | ast.AsyncWith):
                guarded = guarded or any(self._no_grad(item.context_expr) for item in current.items)
            elif isinstance(current, Function):
                if id(current) in self.step_functions:
                    return False
                if isinstance(current, ast.FunctionDef | ast.AsyncFunctionDef):
                    guarded = (
                        guarded
                        or bool(_EVAL_FUNCTION.search(current.name.lower()))
                        or any(self._no_grad(d) for d in current.decorator_list)
                    )
                break
            child, current = current, self.tree.parent(current)
        return loop is not None and guarded and self._calls_model(loop)

    def _no_grad(self, node: ast.expr) -> bool:
        target = node.func if isinstance(node, ast.Call) else node
        return self.names.qualname(target) in _NO_GRAD

    def _calls_model(self, loop: ast.AST) -> bool:
        return any(
            isinstance(sub, ast.Call) and bool(_MODEL_CALL.search(terminal_name(sub.func).lower()))
            for sub in ast.walk(loop)
        )


def is_log_gate(test: ast.expr) -> bool:
    """``step % log_every == 0``, ``should_log``, ``args.verbose``: a block that runs on logging steps."""
    for sub in ast.walk(test):
        if isinstance(sub, ast.BinOp) and isinstance(sub.op, ast.Mod):
            return True
        name = terminal_name(sub).lower()
        if name and _LOG_WORDS & set(name.split("_")):
            return True
    return False
