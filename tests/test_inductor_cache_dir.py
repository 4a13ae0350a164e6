"""Inductor's compiled graphs go under the cluster cache folder (`$CLUSTER_CACHE_DIR/inductor`)
unless `TORCHINDUCTOR_CACHE_DIR` names another: torch fixes the folder the first time
`torch._inductor` is imported, so `import cluster` must set it first (`cluster/_env.py`).
Each case runs in a fresh interpreter, where nothing has imported torch's compiler yet."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

PROBE = (
    "import cluster\n"
    "from torch._inductor.runtime.cache_dir_utils import cache_dir\n"
    "print(cache_dir())\n"
)


def _inductor_cache_dir(env_updates: dict[str, str]) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env.update(env_updates)
    result = subprocess.run(
        [sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        env=env,
        cwd=Path(__file__).resolve().parents[1],
        timeout=300,
        check=True,
    )
    return result.stdout.strip().splitlines()[-1]


def test_graphs_go_under_the_cluster_cache_folder(tmp_path):
    assert _inductor_cache_dir({"CLUSTER_CACHE_DIR": str(tmp_path)}) == str(tmp_path / "inductor")


def test_an_inductor_folder_the_user_chose_is_kept(tmp_path):
    chosen = tmp_path / "mine"
    env = {"CLUSTER_CACHE_DIR": str(tmp_path), "TORCHINDUCTOR_CACHE_DIR": str(chosen)}
    assert _inductor_cache_dir(env) == str(chosen)
