"""The report's evidence beyond the checklist's verdicts: operator coverage under each op-coverage
profile, the static audit's findings by rule, and the plan a recipe will run with on the device.

* :func:`op_coverage` -- on the sim, one runtime-audit run per shipped op-coverage profile
  (:mod:`portatrain.accelerators.sim.op_profiles`) with that profile in force: the operators that
  fell back to the CPU under each, with their calls and first location;
* :func:`findings_by_rule` -- the static audit's findings counted by rule and severity;
* :func:`device_plan` -- what the recipe resolves to on the device: the mixture-of-experts dispatch
  (``model.moe_dispatch=auto`` follows the device's compiler) and the pipeline schedule.

Pure functions of the evidence and the config: nothing is measured here.
"""

from __future__ import annotations

from typing import Any

from portatrain.config import Config


def op_coverage(profile_runs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Profile name -> the operators that fell back to the CPU in the runtime-audit run made with
    that profile in force (:func:`portatrain.report.evidence.profile_runs`), with their calls and
    first location; ``{}`` off the sim."""
    from portatrain.accelerators.sim import op_profiles

    out = {}
    for name, run in profile_runs.items():
        profile = op_profiles.load(name)
        judged: dict[str, Any] = {
            "backend": profile.backend,
            "completeness": profile.completeness,
            "unlisted": profile.unlisted,
        }
        if "error" in run:
            judged["error"] = run["error"]
        else:
            fallbacks = {
                k.removeprefix("fallback:"): n
                for k, n in run["offences"].items()
                if k.startswith("fallback:")
            }
            judged["operators"] = len(run.get("ops", {}))
            judged["fallbacks"] = fallbacks
            judged["first"] = {op: run["first"].get(f"fallback:{op}", "?") for op in fallbacks}
        out[name] = judged
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
