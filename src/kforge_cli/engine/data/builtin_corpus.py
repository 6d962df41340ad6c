"""The built-in demo corpus: short English-like stories generated from a small grammar.

`kforge train` with no ``data.path`` trains on this, so the default job needs no
download and no files. The text is generated deterministically (a seeded
``random.Random``), is about 1.5 MB, and has structure a byte-level model picks up
in a few hundred steps: a closed vocabulary, fixed sentence shapes, characters named
in a story's first sentence and reused later, counting sequences, and a fixed ending.
Generating it takes a fraction of a second, so it is built in memory on every run
(no cache directory, nothing for concurrent ranks to race on).
"""

from __future__ import annotations

import random
from functools import lru_cache

import numpy as np

from kforge_cli.engine.data.tokenizer import ByteTokenizer

VERSION = 1
NUM_DOCUMENTS = 4500
VAL_EVERY = 100  # every 100th story is validation: 1%

NAMES = ["Anna", "Ben", "Clara", "David", "Emma", "Felix", "Grace", "Hugo", "Iris", "Jonas", "Lena", "Max"]
ANIMALS = ["fox", "cat", "dog", "owl", "horse", "rabbit", "goat", "duck", "bear", "mouse"]
ADJECTIVES = ["red", "small", "old", "quiet", "brave", "happy", "tired", "clever", "gentle", "young"]
PLACES = ["mill", "river", "forest", "garden", "market", "bridge", "village", "hill", "barn", "lake"]
WEATHER = ["cold", "warm", "windy", "rainy", "sunny", "grey"]
TIMES = ["morning", "afternoon", "evening", "night"]
MOVES = ["walked", "ran", "went", "hurried", "wandered"]
ACTIONS = ["slept", "sang", "waited", "looked around", "sat down", "laughed"]
ADVERBS = ["slowly", "quickly", "happily", "quietly", "again"]
OBJECTS = ["apples", "stones", "birds", "boats", "trees", "stars", "coins"]
NUMBERS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


def _story(rng: random.Random, index: int) -> str:
    """One document: a title, 4-9 sentences about two characters, and 'The end.'"""
    hero, friend = rng.sample(NAMES, 2)
    animal, adj, place = rng.choice(ANIMALS), rng.choice(ADJECTIVES), rng.choice(PLACES)
    lines = [f"Story {index}: {hero} and the {adj} {animal}", ""]
    sentences = [
        f"It was a {rng.choice(WEATHER)} {rng.choice(TIMES)}, and {hero} {rng.choice(MOVES)} to the {place}.",
        f"There {hero} saw a {adj} {animal}.",
    ]
    for _ in range(rng.randint(2, 7)):
        kind = rng.randrange(5)
        if kind == 0:
            sentences.append(f"The {animal} {rng.choice(ACTIONS)} {rng.choice(ADVERBS)}.")
        elif kind == 1:
            other = rng.choice(PLACES)
            sentences.append(f'"Hello, {hero}," said {friend}. "Shall we go to the {other}?"')
        elif kind == 2:
            n = rng.randint(3, 10)
            what = rng.choice(OBJECTS)
            sentences.append(f"{hero} counted the {what}: {', '.join(NUMBERS[:n])}.")
        elif kind == 3:
            a, b = rng.randint(1, 9), rng.randint(1, 9)
            sentences.append(f"{friend} said that {a} plus {b} makes {a + b}.")
        else:
            sentences.append(f"{hero} and {friend} {rng.choice(MOVES)} {rng.choice(ADVERBS)} to the {place}.")
    sentences.append("The end.")
    return "\n".join(lines) + " ".join(sentences) + "\n"


def generate_documents(num_documents: int = NUM_DOCUMENTS, seed: int = VERSION) -> list[str]:
    rng = random.Random(seed)
    return [_story(rng, i) for i in range(num_documents)]


@lru_cache(maxsize=1)
def builtin_tokens() -> dict[str, np.ndarray]:
    """{'train': ids, 'val': ids}: byte ids, each document followed by EOS (uint16)."""
    tok = ByteTokenizer()
    docs = generate_documents()
    out: dict[str, np.ndarray] = {}
    for split, want_val in (("train", False), ("val", True)):
        chosen = (d for i, d in enumerate(docs) if (i % VAL_EVERY == VAL_EVERY - 1) == want_val)
        data = b"".join(d.encode("utf-8") + b"\x00" for d in chosen)
        ids = np.frombuffer(data, dtype=np.uint8).astype(np.uint16)
        ids[ids == 0] = tok.eos_id  # the generated text has no NUL bytes: NUL marks where EOS goes
        ids.flags.writeable = False
        out[split] = ids
    return out
