"""Tensor parallelism inside the engine (spawned gloo processes): same greedy output as TP=1."""

import os
import subprocess
import sys

import pytest
from tiny_models import make_tiny_chat_model

import cluster
from cluster import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = ["What is the capital of France?", "Name a colour.", "Write one line about the sea."]


def _generate(path, tp, chat=True, **kwargs):
    with LLM(
        path,
        tensor_parallel_size=tp,
        dtype="float32",
        max_model_len=128,
        num_kv_blocks=64,
        **kwargs,
    ) as llm:
        if chat:
            outs = llm.chat(
                [[{"role": "user", "content": p}] for p in PROMPTS], GREEDY, use_tqdm=False
            )
        else:
            outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]


def test_smollm2_tp3_equals_tp1(smollm2_path):
    """TP=3 speculating with draft trees (the shipped EAGLE-3 head, EAGLE-2 trees of 6
    nodes) gives TP=1's tokens without speculation."""
    tree = {
        "method": "eagle3",
        "model": "builtin:smollm2-eagle3",
        "num_speculative_tokens": 3,
        "tree": {"topk": 2, "num_nodes": 6},
    }
    assert _generate(smollm2_path, 3, speculative_config=tree) == _generate(smollm2_path, 1)


def test_tiny_tp2_equals_tp1_with_replicated_kv_heads(tmp_path, smollm2_path):
    path = str(tmp_path / "m")
    make_tiny_chat_model(path, smollm2_path, num_hidden_layers=2, num_key_value_heads=1)
    assert _generate(path, 2, chat=False, block_size=4) == _generate(
        path, 1, chat=False, block_size=4
    )


def test_worker_failure_is_reported(tmp_path, smollm2_path):
    path = str(tmp_path / "m")
    make_tiny_chat_model(path, smollm2_path, num_hidden_layers=2)
    with LLM(
        path, tensor_parallel_size=2, dtype="float32", max_model_len=64, num_kv_blocks=16
    ) as llm:
        executor = llm.engine.core.executor
        executor.channel.procs[1].kill()
        executor.channel.procs[1].join()
        with pytest.raises(RuntimeError, match=r"worker ranks \[1\] are dead"):
            executor.check_health()
        # a step fails with an error instead of hanging
        with pytest.raises(RuntimeError, match="worker rank 1 is dead"):
            llm.generate("hello", GREEDY, use_tqdm=False)


SCRIPT = """
from cluster import LLM, SamplingParams

# Module level, no __main__ guard, never closed: the README's style of example.
llm = LLM({path!r}, tensor_parallel_size=2, dtype="float32", max_model_len=64, num_kv_blocks=32)
greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
print("tokens", llm.generate("hello", greedy, use_tqdm=False)[0].outputs[0].token_ids)
"""


def test_unguarded_script_with_tp2_runs_and_exits_quietly(tmp_path, smollm2_path):
    path = str(tmp_path / "m")
    make_tiny_chat_model(path, smollm2_path, num_hidden_layers=2)
    script = tmp_path / "script.py"
    script.write_text(SCRIPT.format(path=path))
    root = os.path.dirname(os.path.dirname(cluster.__file__))  # importable as installed
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("tokens [") == 1  # the ranks did not run the script again
    noise = [w for w in ("Traceback", "Error", "Warning: ") if w in done.stderr]
    assert not noise, done.stderr[-3000:]
