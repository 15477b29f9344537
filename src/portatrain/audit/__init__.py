"""``portatrain audit``: a static scan of PyTorch code for what breaks or slows down off NVIDIA.

* :mod:`~portatrain.audit.rules` -- the rule table (ids, severities, checklist levels, fixes);
* :mod:`~portatrain.audit.scan` -- the driver: files to scan, one :mod:`ast` walk per file, the result;
* :mod:`~portatrain.audit.checks` -- the rules' checks, one module per rule category, each check
  registered for the node types it inspects (:mod:`~portatrain.audit.registry`);
* what the checks read, one concern each: :mod:`~portatrain.audit.tree` (parents, scopes, source
  text), :mod:`~portatrain.audit.names` (import aliases -> dotted paths),
  :mod:`~portatrain.audit.step` (where the training step is), :mod:`~portatrain.audit.tensors`
  (which expressions are tensors), :mod:`~portatrain.audit.suppressions` (inline ignores), all
  held for one file by :class:`~portatrain.audit.context.FileScan`;
* :mod:`~portatrain.audit.finding` -- one finding;
* :mod:`~portatrain.audit.config` -- the per-project config (``[tool.portatrain.audit]``);
* :mod:`~portatrain.audit.formats` -- text, JSON (stable, versioned) and SARIF 2.1.0 output;
* :mod:`~portatrain.audit.cli` -- ``main(argv) -> exit code``;
* :mod:`~portatrain.audit.sources` -- the files of a run's own ``Trainer`` subclass (for the report);
* :mod:`~portatrain.audit.runtime` -- the runtime audit of a training run (``audit.runtime=true``).

Library use: ``audit_paths(["train.py"]).findings``.
"""

from portatrain.audit.config import AuditConfig, AuditConfigError, find_config, load_config
from portatrain.audit.finding import Finding
from portatrain.audit.rules import RULES, SEVERITIES, Rule
from portatrain.audit.scan import AuditError, AuditResult, audit_paths, scan_file, scan_source

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
