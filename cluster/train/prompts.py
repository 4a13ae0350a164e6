"""An offline, reproducible set of chat prompts for training and evaluating draft heads.

No hub is reachable, so prompts are built from text every CPython install carries and
from word lists kept here (prompt_words.py):
- everyday questions, lists, stories and comparisons from topic templates;
- rewriting, summarising and Q&A over the language-reference topics in `pydoc_data`;
- questions about the standard library: module docstrings, function and class docstrings
  (read with `ast`, nothing imported), short functions to explain, document, test or
  rewrite, and small coding tasks;
- multi-turn chats: a follow-up turn after the target's own first answer
  (`follow_up_chats`, built once the first answers exist).

A prompt is a chat: a tuple of `{"role", "content"}` messages ending with a user turn. Its
split is decided by the SHA-256 of its first user message, so evaluation prompts (and the
follow-ups of evaluation prompts) never reach training.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import random
import re
import sysconfig
from collections.abc import Iterator

from cluster.train import prompt_words as words

Chat = tuple[dict[str, str], ...]

# Standard-library folders whose code is tests, demos or GUI glue rather than library text.
_SKIPPED_DIRS = {"test", "tests", "idlelib", "site-packages", "lib2to3", "turtledemo", "tkinter"}


def user(text: str) -> Chat:
    return ({"role": "user", "content": text},)


def _paragraphs() -> list[str]:
    import pydoc_data.topics

    found = []
    for text in pydoc_data.topics.topics.values():
        for para in re.split(r"\n\s*\n", text):
            para = " ".join(para.split())
            if 200 < len(para) < 600 and not para.startswith(("***", ">>>", "...")):
                found.append(para)
    return found


def _stdlib_files() -> Iterator[tuple[str, str]]:
    """(dotted module name, path) of the standard library's public modules, sorted."""
    stdlib = sysconfig.get_paths()["stdlib"]
    for root, dirs, files in os.walk(stdlib):
        dirs[:] = sorted(d for d in dirs if d not in _SKIPPED_DIRS and d[0] not in "_.")
        for name in sorted(files):
            if name.endswith(".py") and not name.startswith("_"):
                rel = os.path.relpath(os.path.join(root, name[:-3]), stdlib)
                yield rel.replace(os.sep, "."), os.path.join(root, name)


def _first_paragraph(doc: str) -> str:
    return " ".join(doc.split("\n\n")[0].split())


def _stdlib_texts() -> tuple[list[tuple[str, str]], list[tuple[str, str, str]], list[str]]:
    """(module, docstring) pairs, (module, name, docstring) of public functions and
    classes, and the source of short public functions (4-25 lines)."""
    modules, members, functions = [], [], []
    for module, path in _stdlib_files():
        try:
            with open(path, encoding="utf-8") as f:
                source = f.read()
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = source.splitlines()
        if doc := ast.get_docstring(tree):
            modules.append((module, _first_paragraph(doc)))
        for node in ast.walk(tree):
            if (
                not isinstance(node, ast.FunctionDef | ast.ClassDef)
                or node.name[0] == "_"
                or (node.name.startswith("test"))
            ):
                continue
            doc = ast.get_docstring(node)
            if doc and 60 < len(_first_paragraph(doc)) < 500:
                members.append((module, node.name, _first_paragraph(doc)))
            size = (node.end_lineno or node.lineno) - node.lineno + 1
            if isinstance(node, ast.FunctionDef) and 4 <= size <= 25:
                code = "\n".join(lines[node.lineno - 1 : node.end_lineno])
                functions.append(_dedent(code))
    return modules, members, functions


def _dedent(code: str) -> str:
    import textwrap

    return textwrap.dedent(code).strip()


def _cycle(templates: tuple[str, ...], items: list, **fmt) -> list[str]:
    return [templates[i % len(templates)].format(**fmt, **item) for i, item in enumerate(items)]


def single_turn_texts(seed: int = 0) -> list[str]:
    """Every first-turn prompt text, deduplicated and sorted."""
    rng = random.Random(seed)
    texts = [t.format(t=topic) for topic in words.TOPICS for t in words.CHAT_TEMPLATES]
    pairs = [(a, b) for a in words.TOPICS for b in words.TOPICS if a < b]
    texts += _cycle(words.PAIR_TEMPLATES, [{"a": a, "b": b} for a, b in rng.sample(pairs, 1500)])
    texts += [t.format(task=task) for task in words.CODING_TASKS for t in words.CODING_TEMPLATES]
    paras = _paragraphs()
    texts += _cycle(words.TEXT_TEMPLATES, [{"x": p} for p in paras])
    modules, members, functions = _stdlib_texts()
    for i, (module, doc) in enumerate(modules):
        texts.append(words.MODULE_TEMPLATES[i % len(words.MODULE_TEMPLATES)].format(m=module))
        if 80 < len(doc) < 600:
            texts.append(words.TEXT_TEMPLATES[i % len(words.TEXT_TEMPLATES)].format(x=doc))
    items = [{"module": m, "name": n, "doc": d} for m, n, d in members]
    texts += _cycle(words.DOC_TEMPLATES, items)
    texts += _cycle(words.CODE_TEMPLATES, [{"code": c} for c in functions if len(c) < 1200])
    return sorted(set(texts))


def is_eval(chat: Chat | str, eval_fraction: float) -> bool:
    """Whether a prompt is held out: the hash of its first user message decides."""
    text = chat if isinstance(chat, str) else chat[0]["content"]
    digest = hashlib.sha256(text.encode()).digest()
    return int.from_bytes(digest[:4], "big") / 2**32 < eval_fraction


def build_prompts(seed: int = 0, eval_fraction: float = 0.1) -> tuple[list[Chat], list[Chat]]:
    """(train chats, eval chats) of one user turn each, shuffled deterministically."""
    chats = [user(t) for t in single_turn_texts(seed)]
    random.Random(seed).shuffle(chats)
    train = [c for c in chats if not is_eval(c, eval_fraction)]
    evals = [c for c in chats if is_eval(c, eval_fraction)]
    return train, evals


def read_chats(path: str, eval_fraction: float = 0.1) -> tuple[list[Chat], list[Chat]]:
    """(train chats, eval chats) from a JSON-lines file, one chat a line: {"messages":
    [{"role": ..., "content": ...}, ...]} or the list of messages itself (OpenAI's chat
    format; a final assistant turn is dropped, since the target writes its own answer).
    Held out by the same hash rule as the built-in prompts."""
    chats: list[Chat] = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            messages = record.get("messages") if isinstance(record, dict) else record
            ok = isinstance(messages, list) and all(
                isinstance(m, dict) and isinstance(m.get("content"), str) and m.get("role")
                for m in messages
            )
            if not ok or not messages:
                raise ValueError(
                    f"{path}:{number}: expected {{'messages': [{{role, content}}...]}}"
                )
            turns = [{"role": m["role"], "content": m["content"]} for m in messages]
            if turns[-1]["role"] == "assistant":
                turns = turns[:-1]
            if turns:
                chats.append(tuple(turns))
    if not chats:
        raise ValueError(f"{path}: no chats")
    first_user = [
        next((m["content"] for m in c if m["role"] == "user"), c[0]["content"]) for c in chats
    ]
    train = [c for c, t in zip(chats, first_user, strict=True) if not is_eval(t, eval_fraction)]
    evals = [c for c, t in zip(chats, first_user, strict=True) if is_eval(t, eval_fraction)]
    return train, evals


def follow_up_chats(answered: list[tuple[Chat, str]], fraction: float, seed: int = 0) -> list[Chat]:
    """Two-turn chats: the first turn, the target's own answer to it and a follow-up
    request, for about `fraction` of the answered chats (chosen by a seeded draw)."""
    rng = random.Random(seed)
    chats = []
    for chat, answer in answered:
        if rng.random() < fraction and answer.strip():
            follow = words.FOLLOW_UPS[rng.randrange(len(words.FOLLOW_UPS))]
            assistant = {"role": "assistant", "content": answer.strip()}
            chats.append((*chat, assistant, {"role": "user", "content": follow}))
    return chats
