"""Where a file's training step is: the code that runs once per optimizer step.

A *training loop* is a ``for``/``while`` loop whose body (not a nested function) calls
``.backward()``, ``optimizer.step()``/``scaler.step()`` or a step function; a *step function* is a
function that does so outside any loop of its own, or a Trainer hook that runs once per step
(:data:`STEP_HOOKS`). The host-sync rules fire only there: an ``.item()`` in an evaluation
function or a data collator costs nothing per step and is not reported. Inside the step, a block
under a logging gate (``if step % log_every == 0:``, ``if should_log:``) is exempt: reading values
on logging steps only is how a loop keeps the device busy between them (see "Avoid unnecessary
CPU-GPU synchronization" in https://pytorch.org/tutorials/recipes/recipes/tuning_guide.html).
"""

from __future__ import annotations

import ast

from portatrain.audit.names import Names
from portatrain.audit.tree import Function, Loop, SourceTree, terminal_name

STEP_DRIVERS = frozenset({"train_step", "training_step", "forward_backward", "forward_backward_step"})
"""Functions that run one training step by contract: a loop that calls one is a training loop."""
STEP_HOOKS = STEP_DRIVERS | {"compute_loss"}
"""Functions that run on every training step by contract (portatrain's Trainer hooks and the usual
names elsewhere), scanned as step code even when they do not call ``.backward()`` themselves.
``compute_loss`` is one, but calling it does not make a loop a training loop (evaluation calls it)."""

_LOG_WORDS = frozenset({"log", "logging", "print", "verbose", "report", "display", "debug"})


class TrainingStep:
    """The training loops and step functions of one file, found once when it is built."""

    def __init__(self, tree: SourceTree, names: Names) -> None:
        self.tree = tree
        self.names = names
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
        """Whether ``node`` runs on every training step (outside a logging gate)."""
        child, current = node, self.tree.parent(node)
        while current is not None:
            if (
                isinstance(current, ast.If)
                and any(child is s for s in current.body)
                and is_log_gate(current.test)
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


def is_log_gate(test: ast.expr) -> bool:
    """``step % log_every == 0``, ``should_log``, ``args.verbose``: a block that runs on logging steps."""
    for sub in ast.walk(test):
        if isinstance(sub, ast.BinOp) and isinstance(sub.op, ast.Mod):
            return True
        name = terminal_name(sub).lower()
        if name and _LOG_WORDS & set(name.split("_")):
            return True
    return False
