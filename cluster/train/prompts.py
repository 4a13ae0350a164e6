"""An offline, reproducible prompt set for training and evaluating draft heads.

No hub is reachable, so prompts are built from text every CPython install carries: the
language reference topics shipped in `pydoc_data` and the docstrings of the standard
library's modules (read with `ast`, nothing imported), plus everyday chat questions made
from templates and a topic list kept here. A prompt's split (train or eval) is decided by
a hash of its text, so evaluation prompts never appear in training.
"""

from __future__ import annotations

import ast
import hashlib
import os
import random
import re
import sysconfig

TOPICS = (
    "the ocean",
    "volcanoes",
    "bread",
    "the moon",
    "bicycles",
    "rainforests",
    "jazz",
    "chess",
    "honey bees",
    "glaciers",
    "the printing press",
    "coffee",
    "tea",
    "gardening",
    "photosynthesis",
    "the solar system",
    "electric cars",
    "recycling",
    "dinosaurs",
    "the Roman Empire",
    "pyramids",
    "the human heart",
    "sleep",
    "exercise",
    "healthy eating",
    "friendship",
    "time management",
    "learning a language",
    "music theory",
    "painting",
    "photography",
    "the internet",
    "computers",
    "robots",
    "rain",
    "snow",
    "deserts",
    "mountains",
    "rivers",
    "birds",
    "cats",
    "dogs",
    "whales",
    "butterflies",
    "trees",
    "flowers",
    "the weather",
    "clouds",
    "earthquakes",
    "the stock market",
    "saving money",
    "cooking pasta",
    "baking a cake",
    "camping",
    "hiking",
    "swimming",
    "football",
    "the Olympics",
    "libraries",
    "museums",
    "trains",
    "airplanes",
    "bridges",
    "lighthouses",
    "castles",
    "pirates",
    "space travel",
    "telescopes",
    "microscopes",
    "vaccines",
    "bacteria",
    "the water cycle",
    "wind energy",
    "solar power",
    "batteries",
    "magnets",
    "gravity",
    "light",
    "sound",
    "colours",
    "numbers",
    "prime numbers",
    "geometry",
    "fractions",
    "maps",
    "compasses",
    "clocks",
    "calendars",
    "holidays",
    "birthdays",
    "writing a letter",
    "job interviews",
    "public speaking",
    "meditation",
    "yoga",
)

CHAT_TEMPLATES = (
    "What is {t}?",
    "Tell me three interesting facts about {t}.",
    "Explain {t} to a ten-year-old.",
    "Write a short poem about {t}.",
    "Give me some tips about {t}.",
    "Why is {t} important?",
    "Write a short story that involves {t}.",
    "What are the pros and cons of {t}?",
    "Describe {t} in a few sentences.",
    "How would you teach someone about {t}?",
)

TEXT_TEMPLATES = (
    "Summarize this in one sentence: {x}",
    "Explain this to a beginner: {x}",
    "Rewrite this more simply: {x}",
    "What is the main idea of the following text? {x}",
    "Write a question that this text answers: {x}",
)

MODULE_TEMPLATES = (
    "What is the Python module {m} used for?",
    "Give an example of using the {m} module in Python.",
)


def _paragraphs() -> list[str]:
    import pydoc_data.topics

    found = []
    for text in pydoc_data.topics.topics.values():
        for para in re.split(r"\n\s*\n", text):
            para = " ".join(para.split())
            if 200 < len(para) < 600 and not para.startswith(("***", ">>>", "...")):
                found.append(para)
    return found


def _module_docs() -> list[tuple[str, str]]:
    stdlib = sysconfig.get_paths()["stdlib"]
    docs = []
    for name in sorted(os.listdir(stdlib)):
        if not name.endswith(".py") or name.startswith("_"):
            continue
        try:
            with open(os.path.join(stdlib, name), encoding="utf-8") as f:
                doc = ast.get_docstring(ast.parse(f.read()))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        if doc:
            docs.append((name[:-3], " ".join(doc.split("\n\n")[0].split())))
    return docs


def is_eval(prompt: str, eval_fraction: float) -> bool:
    digest = hashlib.sha256(prompt.encode()).digest()
    return int.from_bytes(digest[:4], "big") / 2**32 < eval_fraction


def build_prompts(seed: int = 0, eval_fraction: float = 0.1) -> tuple[list[str], list[str]]:
    """(train prompts, eval prompts), shuffled deterministically."""
    prompts = [t.format(t=topic) for topic in TOPICS for t in CHAT_TEMPLATES]
    paras = _paragraphs()
    prompts += [TEXT_TEMPLATES[i % len(TEXT_TEMPLATES)].format(x=p) for i, p in enumerate(paras)]
    for i, (module, doc) in enumerate(_module_docs()):
        prompts.append(MODULE_TEMPLATES[i % len(MODULE_TEMPLATES)].format(m=module))
        if 80 < len(doc) < 600:
            prompts.append(TEXT_TEMPLATES[i % len(TEXT_TEMPLATES)].format(x=doc))
    prompts = sorted(set(prompts))
    random.Random(seed).shuffle(prompts)
    train = [p for p in prompts if not is_eval(p, eval_fraction)]
    evals = [p for p in prompts if is_eval(p, eval_fraction)]
    return train, evals
