"""The corpus bundled with portatrain: documents the project generates itself, no download.

Five kinds of document with learnable structure, so a tiny model's loss visibly falls:
arithmetic facts (checkable), templated sentences from a small grammar, counting runs,
key/value records, and short stories that reuse a cast of names. Document lengths follow a
long-tailed distribution (tens to a few thousand bytes), which is what exercises bucketing.
Generation is deterministic in ``seed``.
"""

from __future__ import annotations

import random

_ADJ = ["red", "small", "quiet", "bright", "old", "green", "quick", "tired", "brave", "heavy"]
_ANIMALS = ["fox", "cat", "owl", "horse", "dog", "otter", "crow", "bear", "hare", "wolf"]
_VERBS = ["sees", "follows", "finds", "watches", "carries", "chases", "greets", "hides"]
_OBJECTS = ["stone", "apple", "lamp", "boat", "letter", "basket", "key", "drum"]
_PLACES = ["river", "barn", "hill", "market", "forest", "bridge", "garden", "well"]
_NAMES = ["Ada", "Ben", "Cleo", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Juno"]
_CITIES = ["Lisbon", "Oslo", "Quito", "Hanoi", "Tunis", "Perth", "Lima", "Riga"]


def _arithmetic(rng: random.Random, n: int) -> str:
    lines = []
    for _ in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        if rng.random() < 0.5:
            lines.append(f"{a} + {b} = {a + b}.")
        else:
            a, b = max(a, b), min(a, b)
            lines.append(f"{a} - {b} = {a - b}.")
    return "\n".join(lines)


def _sentences(rng: random.Random, n: int) -> str:
    c = rng.choice
    return " ".join(
        f"The {c(_ADJ)} {c(_ANIMALS)} {c(_VERBS)} the {c(_ADJ)} {c(_OBJECTS)} near the {c(_PLACES)}."
        for _ in range(n)
    )


def _counting(rng: random.Random, n: int) -> str:
    start, step = rng.randint(0, 500), rng.choice([1, 2, 3, 5, 10])
    return "count by " + str(step) + ": " + ", ".join(str(start + i * step) for i in range(n * 4)) + "."


def _records(rng: random.Random, n: int) -> str:
    return "\n".join(
        f"name: {rng.choice(_NAMES)}; age: {rng.randint(18, 90)}; city: {rng.choice(_CITIES)}"
        for _ in range(n)
    )


def _story(rng: random.Random, n: int) -> str:
    hero, friend = rng.sample(_NAMES, 2)
    animal, place = rng.choice(_ANIMALS), rng.choice(_PLACES)
    lines = [f"Once, {hero} walked to the {place} with a {animal}."]
    for _ in range(n):
        obj = rng.choice(_OBJECTS)
        lines.append(
            rng.choice(
                [
                    f"{hero} gave the {obj} to {friend}.",
                    f"{friend} asked {hero} about the {obj}.",
                    f"The {animal} found a {obj} by the {place}.",
                    f"{hero} and {friend} sat by the {place}.",
                ]
            )
        )
    lines.append(f"In the end, {hero} and {friend} went home.")
    return " ".join(lines)


_KINDS = (_arithmetic, _sentences, _counting, _records, _story)


def generate_corpus(num_documents: int = 4000, seed: int = 0) -> list[str]:
    """Return ``num_documents`` documents; the unit count per document is long-tailed (1 to ~100)."""
    rng = random.Random(seed)
    docs = []
    for _ in range(num_documents):
        units = min(100, max(1, int(rng.paretovariate(1.3))))
        docs.append(rng.choice(_KINDS)(rng, units))
    return docs
