"""The rule families of the static scan, one module each, in the order their checks run.

To add a rule: add it to the rule table (:mod:`portatrain.audit.rules`) under a category, write
its check in that category's module here with ``@FAMILY.check(<node type>, ...)``, and add a
fixture line to ``tests/test_audit.py`` (or, for rules about CUDA-first training scripts,
``tests/test_audit_recall.py``; the two tables together must cover every rule). A new category gets a new module, listed in
:data:`FAMILIES`.
"""

from __future__ import annotations

from portatrain.audit.checks import (
    attention,
    checkpoints,
    cuda_api,
    device_placement,
    dynamic_shapes,
    host_syncs,
    libraries,
)
from portatrain.audit.registry import RuleFamily

FAMILIES: tuple[RuleFamily, ...] = (
    device_placement.FAMILY,
    cuda_api.FAMILY,
    libraries.FAMILY,
    attention.FAMILY,
    host_syncs.FAMILY,
    dynamic_shapes.FAMILY,
    checkpoints.FAMILY,
)
"""Every rule family; a node's checks run family after family in this order."""
