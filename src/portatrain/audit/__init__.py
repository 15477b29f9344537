"""``portatrain audit``: a static scan of PyTorch code for what breaks or slows down off NVIDIA.

* :mod:`~portatrain.audit.rules` -- the rule table (ids, severities, checklist levels, fixes);
* :mod:`~portatrain.audit.scan` -- the :mod:`ast` scan of one file and of a set of paths;
* :mod:`~portatrain.audit.config` -- the per-project config (``[tool.portatrain.audit]``);
* :mod:`~portatrain.audit.formats` -- text, JSON (stable, versioned) and SARIF 2.1.0 output;
* :mod:`~portatrain.audit.cli` -- ``main(argv) -> exit code``;
* :mod:`~portatrain.audit.sources` -- the files of a run's own ``Trainer`` subclass (for the report).

Library use: ``audit_paths(["train.py"]).findings``.
"""

from portatrain.audit.config import AuditConfig, AuditConfigError, find_config, load_config
from portatrain.audit.rules import RULES, SEVERITIES, Rule
from portatrain.audit.scan import AuditError, AuditResult, Finding, audit_paths, scan_file, scan_source

__all__ = [
    "RULES",
    "SEVERITIES",
    "AuditConfig",
    "AuditConfigError",
    "AuditError",
    "AuditResult",
    "Finding",
    "Rule",
    "audit_paths",
    "find_config",
    "load_config",
    "scan_file",
    "scan_source",
]
