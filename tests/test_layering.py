"""The package's layering, as `docs/architecture.md` draws it: every import of ours (those
inside functions too) goes to a package that the importer's row of the table allows; Ray
and Triton stay where the table says; the offline API runs without importing Ray; no module imports itself in a circle."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

import cluster

ROOT = os.path.dirname(cluster.__file__)
DOC = os.path.join(os.path.dirname(ROOT), "docs", "architecture.md")
RAY_UNITS = {"actors", "serve", "cli", "demo"}
TRITON_UNITS = {"kernels"}


def _unit(name: str) -> str:
    """`cluster/serve/` or `outputs.py` or `cluster.serve.x` -> its unit."""
    name = name.strip("`").removeprefix("cluster/").removeprefix("cluster.").rstrip("/")
    if name in ("cluster", "__init__.py"):
        return "__init__"
    return name.removesuffix(".py").split("/")[0].split(".")[0]


def layering_table() -> dict[str, set[str]]:
    """unit -> what it may import (units, or `unit.module` for one module; `*` for all)."""
    with open(DOC) as f:
        text = f.read()
    section = text[text.index("## Packages") : text.index("## Rules")]
    table: dict[str, set[str]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`cluster"):
            continue
        units = {_unit(u) for u in re.findall(r"`[^`]+`", cells[0])}
        allowed = {a.strip("`").removeprefix("cluster.") for a in re.findall(r"`[^`]+`", cells[2])}
        for u in units:
            table[u] = allowed | units
    return table


def imports() -> list[tuple[str, str, str]]:
    """(importing module, its unit, imported module) for every import in the package."""
    found = []
    for folder, _, files in os.walk(ROOT):
        for file in files:
            if not file.endswith(".py"):
                continue
            path = os.path.join(folder, file)
            module = "cluster." + os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
            unit = _unit(module) if module.count(".") > 1 or file != "__init__.py" else "__init__"
            with open(path) as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    found += [(module, unit, a.name) for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    assert node.level == 0, f"{module}: use absolute imports"
                    found.append((module, unit, node.module or ""))
    return found


def test_the_table_covers_every_package():
    table = layering_table()
    units = {u for _, u, _ in imports()}
    assert units <= set(table), f"packages missing from docs/architecture.md: {units - set(table)}"


def test_imports_follow_the_table():
    table = layering_table()
    wrong = []
    for module, unit, target in imports():
        if not target.startswith("cluster.") or "*" in table[unit]:
            continue
        name = target.removeprefix("cluster.")
        if _unit(name) == unit:
            continue
        allowed = table[unit]
        if _unit(name) not in allowed and not any(
            name.startswith(a + ".") or name == a for a in allowed
        ):
            wrong.append(f"{module} imports {target}")
    assert not wrong, "imports the table in docs/architecture.md does not allow:\n" + "\n".join(
        wrong
    )


def test_ray_and_triton_stay_in_their_packages():
    wrong = []
    for module, unit, target in imports():
        top = target.split(".")[0]
        if (top == "ray" and unit not in RAY_UNITS) or (
            top == "triton" and unit not in TRITON_UNITS
        ):
            wrong.append(f"{module} imports {target}")
    assert not wrong, "\n".join(wrong)


def test_the_offline_api_imports_no_ray(tmp_path):
    manifest = os.path.join(ROOT, "manifests", "default.yaml")
    code = (
        "import sys\n"
        "import cluster, cluster.llm, cluster.engine.async_llm, cluster.worker.executors\n"
        "from cluster.serve.manifest import read_manifest_args\n"
        f"read_manifest_args({manifest!r}).engine_args()\n"
        "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def _import_cycles() -> list[list[str]]:
    """Circles of our modules importing one another (those inside functions too)."""
    graph: dict[str, set[str]] = {}
    for module, _, target in imports():
        if target.startswith("cluster.") and target != module:
            graph.setdefault(module, set()).add(target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in list(graph):
        if node not in index:
            visit(node)
    return cycles


def test_no_module_imports_itself_in_a_circle():
    assert _import_cycles() == []


def test_every_module_is_under_350_lines():
    long = []
    for folder, _, files in os.walk(ROOT):
        for file in files:
            if file.endswith(".py"):
                path = os.path.join(folder, file)
                with open(path) as f:
                    lines = sum(1 for _ in f)
                if lines >= 350:
                    long.append(f"{os.path.relpath(path, ROOT)}: {lines}")
    assert not long, "split these modules (one job each):\n" + "\n".join(long)


def _modules() -> dict[str, ast.Module]:
    """Package-relative path -> parsed module, for every module of the package."""
    trees = {}
    for folder, _, files in os.walk(ROOT):
        for file in files:
            if file.endswith(".py"):
                path = os.path.join(folder, file)
                with open(path) as f:
                    trees[os.path.relpath(path, ROOT)] = ast.parse(f.read())
    return trees


def test_one_way_in_for_requests():
    """A request enters through three classes only (the in-process engines' shared front
    end, the engine core, the scheduler), and only the front end fans `n` > 1 out into
    sequences (`SamplingParams.choices()`)."""
    adders, fanning = set(), set()
    for path, tree in _modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                defined = {f.name for f in node.body if isinstance(f, ast.FunctionDef)}
                if "add_request" in defined:
                    adders.add(f"{path}:{node.name}")
            call = isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            if call and node.func.attr == "choices" and path != "sampling_params.py":
                fanning.add(path)
    assert adders == {
        "engine/llm_engine.py:InProcessEngine",
        "engine/core.py:EngineCore",
        "engine/scheduler.py:Scheduler",
    }
    assert fanning == {"engine/frontend.py"}
