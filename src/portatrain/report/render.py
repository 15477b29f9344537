"""The report as files: Markdown (one table per checklist level) and JSON, written to the run
directory and to ``report.out``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from portatrain.report.verdicts import FAIL, LEVELS, NOT_MEASURED, PASS, STATUSES


def render_markdown(document: dict[str, Any]) -> str:
    """The report as Markdown: a header, one table per level, the evidence files."""
    simulated = document["simulated"]
    tag = " [simulated device]" if simulated else ""
    device = document["device"]
    lines = [
        f"# Portability report: {document['recipe']} on {device}{tag}",
        "",
        f"Generated {document['generated']} by `{document['command']}`.",
    ]
    if simulated:
        lines += [
            "",
            f"**Simulated device** ({document['device_name']}): host syncs, fallbacks, mixed-device ops and shapes "
            "are measured on the code as it runs; timings are the host CPU's, so performance and cost are not "
            "measured here. Every line below says so.",
        ]
    counts = {s: sum(i["status"] == s for i in document["items"]) for s in STATUSES}
    lines += ["", f"**{counts[PASS]} pass, {counts[FAIL]} fail, {counts[NOT_MEASURED]} not measured.**", ""]
    verdicts = document["levels"]
    lines += ["| level | verdict |", "| --- | --- |"]
    for level, title in LEVELS.items():
        lines.append(f"| {level}. {title} | {verdicts[str(level)]}{tag} |")
    for level, title in LEVELS.items():
        rows = [i for i in document["items"] if i["level"] == level]
        lines += [
            "",
            f"## {level}. {title}",
            "",
            "| | check | status | evidence | command |",
            "| --- | --- | --- | --- | --- |",
        ]
        for item in rows:
            status = item["status"].upper() if item["status"] != NOT_MEASURED else "not measured"
            lines.append(
                f"| {item['id']} | {item['check']} | {status}{tag} | {_cell(item['evidence'])} | `{_cell(item['command'])}` |"
            )
    lines += _coverage_sections(document, tag)
    lines += ["", "## Evidence", ""]
    for name, where in document["evidence_files"].items():
        lines.append(f"- {name}: `{where}`{tag}")
    lines.append(
        f"- static audit: {len(document['static']['files'])} file(s): {', '.join(document['static']['paths'])}{tag}"
    )
    return "\n".join(lines) + "\n"


def _coverage_sections(document: dict[str, Any], tag: str) -> list[str]:
    """Operator coverage by profile, the static audit's findings by rule, the plan on the device."""
    lines = ["", "## Operator coverage by profile", ""]
    coverage = document.get("op_coverage") or {}
    if not coverage:
        lines.append("Measured on the simulated device only (device=sim): one runtime-audit run per profile.")
    else:
        lines += [
            "| profile | operators | fall back | operators that fall back (calls, first at) |",
            "| --- | --- | --- | --- |",
        ]
        for name, judged in coverage.items():
            if "error" in judged:
                lines.append(
                    f"| {name} ({_cell(judged['backend'])}) | ? | ?{tag} | the run failed: {_cell(judged['error'])} |"
                )
                continue
            shown = "; ".join(
                f"`{op}` x{n} at {judged['first'][op]}" for op, n in judged["fallbacks"].items()
            )
            lines.append(
                f"| {name} ({_cell(judged['backend'])}) | {judged['operators']} | {len(judged['fallbacks'])}{tag} "
                f"| {_cell(shown) or 'none'} |"
            )
    lines += ["", "## Static audit findings by rule", ""]
    rules = document.get("findings_by_rule") or {}
    if not rules:
        lines.append("No findings.")
    else:
        lines += ["| rule | level | findings | by severity | first at |", "| --- | --- | --- | --- | --- |"]
        for rule, found in rules.items():
            severity = ", ".join(f"{n} {s}" for s, n in sorted(found["severity"].items()))
            lines.append(f"| {rule} | {found['level']} | {found['count']} | {severity} | {found['first']} |")
    plan = document.get("device_plan") or {}
    if plan:
        dispatch = plan.get("moe_dispatch")
        moe = (
            f"`{dispatch}` (model.moe_dispatch={plan['moe_dispatch_configured']})"
            if dispatch
            else "dense model: no experts"
        )
        schedule = plan.get("pp_schedule")
        lines += [
            "",
            f"## Plan on {plan['device']}",
            "",
            f"- mixture-of-experts dispatch: {moe}",
            f"- pipeline schedule (parallel.pp_schedule): {f'`{schedule}`' if schedule else 'not configured'}",
        ]
    return lines


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def write_report(document: dict[str, Any], run_dir: Path, out: str | None) -> list[Path]:
    """``report.md`` + ``report.json`` in ``run_dir`` and at ``out`` (``FILE.md``, ``FILE.json`` or a folder)."""
    markdown, text = render_markdown(document), json.dumps(document, indent=2) + "\n"
    targets = [(run_dir / "report.md", run_dir / "report.json")]
    if out:
        path = Path(out)
        if path.suffix in (".md", ".json"):
            targets.append((path.with_suffix(".md"), path.with_suffix(".json")))
        else:
            targets.append((path / "report.md", path / "report.json"))
    written = []
    for md_path, json_path in targets:
        md_path.parent.mkdir(parents=True, exist_ok=True)
        md_path.write_text(markdown)
        json_path.write_text(text)
        written += [md_path, json_path]
    return written
