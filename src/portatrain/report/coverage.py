"""The report's evidence beyond the checklist's verdicts: operator coverage under each op-coverage
profile, the static audit's findings by rule, and the plan a recipe will run with on the device.

* :func:`op_coverage` -- the runtime audit's op census on the sim (every operator that reached the
  device) judged against every shipped profile (:mod:`portatrain.accelerators.sim.op_profiles`):
  the operators that would leave the device under each, with their calls and first location;
* :func:`findings_by_rule` -- the static audit's findings counted by rule and severity;
* :func:`device_plan` -- what the recipe resolves to on the device: the mixture-of-experts dispatch
  (``model.moe_dispatch=auto`` follows the device's compiler) and the pipeline schedule.

Pure functions of the evidence and the config: nothing is measured here.
"""

from __future__ import annotations

from typing import Any

from portatrain.config import Config


def op_coverage(runtime: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Profile name -> the census's operators outside it (``{}`` without a census: not the sim, or
    the run failed)."""
    ops = runtime.get("ops")
    if not ops:
        return {}
    from portatrain.accelerators.sim import op_profiles

    first = runtime.get("ops_first", {})
    out = {}
    for name, profile in op_profiles.load_all().items():
        fallbacks = profile.fallbacks(ops)
        out[name] = {
            "backend": profile.backend,
            "completeness": profile.completeness,
            "unlisted": profile.unlisted,
            "operators": len(ops),
            "fallbacks": fallbacks,
            "first": {op: first.get(op, "?") for op in fallbacks},
        }
    return out


def judged_profiles(runtime: dict[str, Any], coverage: dict[str, dict[str, Any]]) -> list[str]:
    """The profiles the fallback item judges: the one in force, else the impersonated device's, else all."""
    for name in (runtime.get("profile"), runtime.get("device_type")):
        if name in coverage:
            return [name]
    return sorted(coverage)


def findings_by_rule(static: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Rule -> its level, finding count by severity and first finding (``path:line``)."""
    out: dict[str, dict[str, Any]] = {}
    for finding in static.get("findings", []):
        rule = out.setdefault(
            finding["rule"],
            {
                "level": finding["level"],
                "count": 0,
                "severity": {},
                "first": f"{finding['path']}:{finding['line']}",
            },
        )
        rule["count"] += 1
        rule["severity"][finding["severity"]] = rule["severity"].get(finding["severity"], 0) + 1
    return dict(sorted(out.items()))


PP_SCHEDULE_KEY = "pp_schedule"
"""``parallel.pp_schedule``: the pipeline schedule, read where this portatrain has the key."""


def device_plan(cfg: Config) -> dict[str, Any]:
    """The mixture-of-experts dispatch and the pipeline schedule the recipe uses on ``cfg.device.type``."""
    from portatrain.models import model_args, moe_dispatch
    from portatrain.plan import static_shapes

    plan: dict[str, Any] = {"device": str(cfg.device.type)}
    args = model_args(cfg.model)
    if getattr(args, "n_experts", None):
        plan["moe_dispatch"] = moe_dispatch(cfg.model, static_shapes=static_shapes(cfg.device.type))
        plan["moe_dispatch_configured"] = str(cfg.model.moe_dispatch)
    else:
        plan["moe_dispatch"] = None  # a dense model: no experts to dispatch to
    # The pipeline schedule: another stage's key; read it only where it exists.
    plan["pp_schedule"] = getattr(cfg.parallel, PP_SCHEDULE_KEY, None)
    return plan
