"""Op-coverage profiles: which aten operators a real backend runs natively, for the sim to impersonate.

A profile is data (``profiles/<name>.json``, written by ``scripts/build_op_profiles.py`` from the
vendor's own material and saying where it came from and how complete it is). With one active
(``SIM_OP_PROFILE=tpu``, ``neuron`` or a path to such a file), every aten operator that reaches
the sim device and is not in the profile takes the real CPU fallback (``at::native::cpu_fallback``,
the one TorchTPU and torch-xla call: inputs copied to the host, run there, results copied back)
and is counted as ``fallback:<op>`` with its first stack (:mod:`.counters`), so the runtime audit,
``portatrain parity`` and ``portatrain report`` name the operators a model would run off the device.

Matching is by operator name, any overload (``aten::mm`` covers ``aten::mm.out``): the sim reaches
a structured op through its ``.out`` overload where a vendor registers the functional one, so an
exact overload match would invent fallbacks. Only ``aten`` operators are judged; the process-group
ops (``c10d``, ``_c10d_functional``) belong to the communication backend, not to the profile.
A functional composite op the vendor implements as one kernel (``aten::repeat``, whose CPU build
calls ``aten::unfold``) is registered for the sim device while the profile is active
(:meth:`OpProfile.leaf_composites`), so it reaches the device whole, as on the vendor's backend,
instead of as the ops its composite calls.

Independent of any profile, the runtime audit on the sim counts every operator that reaches the
device (the op census, :func:`portatrain.accelerators.sim.counters.set_census`).
:meth:`OpProfile.fallbacks` judges such a census, which is exact for the profile the run was made
under; ``portatrain report`` makes one run per profile, since the composites a vendor runs whole
(above) differ between profiles, and with them the operators that reach the device.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path

PROFILE_ENV = "SIM_OP_PROFILE"
"""The active profile: ``tpu``, ``neuron``, a path to a profile JSON, or unset/``none`` (every op native)."""
PROFILES_DIR = Path(__file__).parent / "profiles"
SCHEMA = "portatrain.op_profile/1"


_RUNTIME_OPS = frozenset(
    ("aten::clone", "aten::lift", "aten::lift_fresh", "aten::_unsafe_view", "aten::alias", "aten::detach")
)
"""Copies and views the sim device implements as runtime (with ``_to_copy`` and the factories, which
take a device): they stay its own, never a profiled kernel."""


@dataclass(frozen=True)
class OpProfile:
    """One backend's native aten operators, with the record of where the list came from."""

    name: str
    backend: str
    """The real backend in words (``TorchTPU 0.2.0 eager``)."""
    native: frozenset[str]
    """Operator names without overload (``aten::mm``) the backend runs on the device."""
    registered: frozenset[str]
    """The vendor's own kernel names with overload (``aten::repeat``, ``aten::add.out``)."""
    sources: tuple[dict[str, str], ...]
    completeness: str
    unlisted: str
    """What the real backend does with an operator outside the list (fall back, or reject)."""

    def is_native(self, op: str) -> bool:
        """Whether ``op`` (``aten::mm.out`` or ``aten::mm``) runs on the device under this profile."""
        if not op.startswith("aten::"):
            return True
        return op.split(".", 1)[0] in self.native

    def fallbacks(self, ops: dict[str, int]) -> dict[str, int]:
        """The operators of an op census (name -> calls) that would leave the device."""
        return {op: n for op, n in sorted(ops.items()) if not self.is_native(op)}

    def leaf_composites(self) -> list[str]:
        """The vendor's kernels (``repeat``, ``add.Scalar``: names the ``aten`` library registers) that
        torch implements as a composite for a device without one: functional (no argument or result
        aliases another), not a copy, view or factory of the runtime, not yet registered for PrivateUse1."""
        import torch

        out = []
        for op in sorted(self.registered):
            name, _, overload = op.partition(".")
            try:
                schema = torch._C._get_schema(name, overload)
            except RuntimeError:  # not an operator of this torch
                continue
            functional = not any(a.alias_info for a in (*schema.arguments, *schema.returns))
            runtime = name in _RUNTIME_OPS or any("Device" in str(a.type) for a in schema.arguments)
            if (
                functional
                and not runtime
                and torch._C._dispatch_has_kernel_for_dispatch_key(op, "CompositeExplicitAutograd")
                and not torch._C._dispatch_has_kernel_for_dispatch_key(op, "PrivateUse1")
            ):
                out.append(op.removeprefix("aten::"))
        return out

    def describe(self) -> str:
        return f"{self.name} ({self.backend}; {len(self.native)} native aten operators)"


def available() -> tuple[str, ...]:
    """The shipped profiles' names."""
    return tuple(sorted(p.stem for p in PROFILES_DIR.glob("*.json")))


def profile_problem(value: str) -> str | None:
    """Why ``SIM_OP_PROFILE=value`` cannot be used (None when it can), with the fix."""
    if value in ("", "none") or value in available():
        return None
    path = Path(value)
    if not path.is_file():
        return (
            f"{PROFILE_ENV}={value!r} is neither a shipped profile ({', '.join(available())}) nor a profile "
            f"file; set one of them, a path to a JSON written by scripts/build_op_profiles.py, or unset it"
        )
    try:
        load(value)
    except (ValueError, KeyError, TypeError) as exc:
        return f"{PROFILE_ENV}={value!r} is not an op profile ({type(exc).__name__}: {exc}); rebuild it with scripts/build_op_profiles.py"
    return None


@cache
def load(name_or_path: str) -> OpProfile:
    """A shipped profile by name (``tpu``) or a profile file by path."""
    path = PROFILES_DIR / f"{name_or_path}.json" if name_or_path in available() else Path(name_or_path)
    data = json.loads(path.read_text())
    if data.get("schema") != SCHEMA:
        raise ValueError(f"schema {data.get('schema')!r}, expected {SCHEMA!r}")
    return OpProfile(
        name=str(data["name"]),
        backend=str(data["backend"]),
        native=frozenset(data["native"]),
        registered=frozenset(data.get("registered", ())),
        sources=tuple(data["sources"]),
        completeness=str(data["completeness"]),
        unlisted=str(data["unlisted"]),
    )


def load_all() -> dict[str, OpProfile]:
    """Every shipped profile, by name."""
    return {name: load(name) for name in available()}
