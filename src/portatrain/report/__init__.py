"""``portatrain report recipe=... device=...``: the six-level portability checklist, filled from evidence.

Each item is ``pass``, ``fail`` or ``not measured``, with the evidence and the command that produced
it. One module per concern, in the order a report is made:

* :mod:`.evidence` -- gathering: the static audit of the code in use, a runtime-audit training run,
  parity against the fp32 CPU reference and a bench, each one of portatrain's own commands run in
  this process (:class:`Evidence`, and the :class:`Commands` that reproduce each piece);
* :mod:`.coverage` -- the evidence beside the checklist: operators that fell back under each op-coverage
  profile (on the sim, one runtime-audit run per profile), static findings by rule, and the plan on
  the device (mixture-of-experts dispatch, pipeline schedule);
* :mod:`.verdicts` -- judging: the checklist (:data:`LEVELS`, one judge per item) applied to the
  evidence, pure (:func:`checklist`, :func:`level_verdicts`);
* :mod:`.render` -- rendering: the Markdown and JSON files (:func:`render_markdown`, :func:`write_report`);
* :mod:`.command` -- the command itself: validate ``report.*``, gather, judge, build the document
  (schema :data:`SCHEMA`), write and print it (:func:`build_report`, :func:`report_command`).

On the simulated device (``device=sim``, or the sim impersonating ``tpu``/``neuron``) every item says
so: its host-sync, fallback and shape counts are real measurements of the code, while its timings are
the host CPU's, so performance and cost are not measured there.
"""

from __future__ import annotations

from portatrain.report.command import SCHEMA, build_report, report_command, report_problems
from portatrain.report.evidence import (
    Commands,
    Evidence,
    bench_run,
    code_in_use,
    commands_for,
    parity_run,
    runtime_run,
    static_audit,
)
from portatrain.report.render import render_markdown, write_report
from portatrain.report.verdicts import (
    CHECKS,
    FAIL,
    LEVELS,
    NOT_MEASURED,
    PASS,
    STATUSES,
    Item,
    Verdict,
    checklist,
    level_verdicts,
)

__all__ = [
    "CHECKS",
    "FAIL",
    "LEVELS",
    "NOT_MEASURED",
    "PASS",
    "SCHEMA",
    "STATUSES",
    "Commands",
    "Evidence",
    "Item",
    "Verdict",
    "bench_run",
    "build_report",
    "checklist",
    "code_in_use",
    "commands_for",
    "level_verdicts",
    "parity_run",
    "render_markdown",
    "report_command",
    "report_problems",
    "runtime_run",
    "static_audit",
    "write_report",
]
