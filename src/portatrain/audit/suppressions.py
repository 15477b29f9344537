"""Inline suppressions: ``# portatrain: ignore[rule-id, ...] reason`` or a bare ``# portatrain: ignore``.

They are read with :mod:`tokenize` (so a ``#`` inside a string is not a comment) and apply on the
finding's line or the first line of its statement. The text after the comment is the
justification, kept with the suppressed finding as evidence.
"""

from __future__ import annotations

import io
import re
import tokenize

_SUPPRESSION = re.compile(r"#\s*portatrain:\s*ignore(?:\[(?P<ids>[^\]]*)\])?(?P<reason>.*)")

Suppressions = dict[int, tuple[frozenset[str] | None, str]]
"""Line -> (rule ids, or None for every rule; justification)."""


def read_suppressions(source: str) -> Suppressions:
    """Every ``# portatrain: ignore`` comment of a module's source, by line."""
    found: Suppressions = {}
    try:
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type != tokenize.COMMENT:
                continue
            match = _SUPPRESSION.search(token.string)
            if match is None:
                continue
            ids = match.group("ids")
            rules = None if ids is None else frozenset(i.strip() for i in ids.split(",") if i.strip())
            reason = match.group("reason").strip().lstrip("-—:#").strip()
            found[token.start[0]] = (rules, reason)
    except (tokenize.TokenError, SyntaxError):
        pass  # the file parsed with ast; a tokenizer hiccup only costs the suppressions
    return found


def justification(suppressions: Suppressions, rule_id: str, lines: list[int]) -> str | None:
    """The justification of the first of ``lines`` whose comment silences ``rule_id`` (None: active)."""
    for line in lines:
        entry = suppressions.get(line)
        if entry is not None and (entry[0] is None or rule_id in entry[0]):
            return entry[1]
    return None
