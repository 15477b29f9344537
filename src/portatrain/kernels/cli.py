"""``portatrain kernels list`` and ``portatrain kernels check`` (also ``python -m portatrain.kernels``).

* :func:`list_kernels` -- each operation, its reference, its overrides per backend, and whether
  each override's parity check can run on this machine (and why not).
* :func:`check_kernels` -- runs every parity check that can run here and prints, per case, the
  maximum error against the tolerance; the exit status is 1 if any case fails.
"""

from __future__ import annotations

import argparse
import sys

from portatrain.kernels.parity import CASES, check_for, run_check
from portatrain.kernels.registry import OPERATIONS, OVERRIDES


def _qualname(fn: object) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def list_kernels() -> str:
    """A table of operations, references, overrides per backend and parity-check availability."""
    lines = ["Kernel overrides (enable by name: kernels.enabled=[NAME,...]; see kernels/README.md)", ""]
    for op in OPERATIONS.values():
        lines.append(f"{op.name}: {op.signature}")
        lines.append(f"  reference: {_qualname(op.reference)} (model slot: {op.slot})")
        for ov in OVERRIDES.values():
            if ov.operation != op.name:
                continue
            check = check_for(ov)
            reason = check.unavailable()
            where = "can run here" if reason is None else f"cannot run here: {reason}"
            lines.append(f"  {ov.name:<26} backend={ov.backend:<7} parity: {check.how} -- {where}")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def check_kernels() -> int:
    """Run every parity check that can run here; print max error vs tolerance; 0 if all pass."""
    failed = ran = 0
    for ov in OVERRIDES.values():
        check = check_for(ov)
        reason = check.unavailable()
        if reason is not None:
            print(f"SKIP {ov.name}: {check.how} -- {reason}")
            continue
        try:
            results = run_check(ov)
        except Exception as exc:  # a kernel that cannot even run is a failed check, not a crash
            failed += 1
            print(f"FAIL {ov.name}: {type(exc).__name__}: {exc}")
            continue
        for r in results:
            ran += 1
            failed += not r.ok
            worst = max(r.comparisons, key=lambda c: c.worst)
            print(
                f"{'ok  ' if r.ok else 'FAIL'} {ov.name:<26} {r.case:<30} {str(r.dtype).removeprefix('torch.'):<8} "
                f"max err {r.max_abs_err:.2e} (tol atol={r.tolerance.atol:g} rtol={r.tolerance.rtol:g}; "
                f"worst {worst.worst:.2f} of allowed, {worst.tensor})"
            )
    total_cases = sum(len(c) for c in CASES.values())
    print(f"{ran} case(s) run, {failed} failed ({total_cases} cases per backend defined)")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    """``kernels list`` or ``kernels check``; returns the exit status."""
    parser = argparse.ArgumentParser(prog="portatrain kernels", description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("list", "check"))
    args = parser.parse_args(argv)
    if args.action == "list":
        print(list_kernels(), end="")
        return 0
    return check_kernels()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
