"""Host synchronisations of one engine step do not grow with the batch, the layers or k.

Every Tensor method that reads a value back to the host (`item`, `tolist`, `__bool__`,
`__int__`, `__float__`, `__index__`, `cpu`, `numpy`, `nonzero`) is counted while the
worker runs a step. On a GPU each is a stall of the whole stream; a count that grows with
the batch size means a per-request read, with the layer count a per-layer one, with k a
per-draft one. A counter that misses them would pass for the wrong reason, so the last
test checks that a per-request read is seen.
"""

from __future__ import annotations

import pytest
import torch
from random_heads import write_eagle, write_eagle3
from tiny_models import make_tiny_chat_model

from cluster import LLM, SamplingParams

SYNC_METHODS = (
    "item",
    "tolist",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
    "cpu",
    "numpy",
    "nonzero",
)
ENGINE = dict(dtype="float32", max_model_len=128, num_kv_blocks=96, block_size=4)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [40, 41, 42, 43, 44], [7, 7, 7]]


@pytest.fixture(scope="module")
def models(tmp_path_factory, smollm2_path):
    root = tmp_path_factory.mktemp("syncs")
    paths = {}
    for layers in (2, 4):
        path = str(root / f"target{layers}")
        make_tiny_chat_model(path, smollm2_path, num_hidden_layers=layers, seed=1)
        paths[layers] = path
    drafts = {
        "eagle": write_eagle(str(root / "eagle"), paths[4], 0),
        "eagle3": write_eagle3(str(root / "eagle3"), paths[4], 64, 0),
    }
    return paths, drafts


def count_syncs_per_step(monkeypatch, llm: LLM, num_requests: int, temperature: float):
    """Sync counts of each decode step of `num_requests` requests (prefill steps dropped)."""
    runner = llm.engine.core.executor.worker.runner
    counter = {"n": 0}
    for name in SYNC_METHODS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            counter["n"] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    counts = []
    execute = runner.execute_model

    def counting_execute(so):
        counter["n"] = 0
        out = execute(so)
        if so.scheduled and all(s.num_computed_tokens > 0 for s in so.scheduled):
            counts.append(counter["n"])
        return out

    monkeypatch.setattr(runner, "execute_model", counting_execute)
    params = SamplingParams(temperature=temperature, max_tokens=8, ignore_eos=True, seed=3)
    prompts = [{"prompt_token_ids": PROMPTS[i % len(PROMPTS)]} for i in range(num_requests)]
    llm.generate(prompts, params, use_tqdm=False)
    monkeypatch.undo()
    assert counts, "no decode step was seen"
    return counts


def _max_syncs(monkeypatch, path, spec, num_requests, temperature=0.0):
    with LLM(path, speculative_config=spec, compile="off", **ENGINE) as llm:
        return max(count_syncs_per_step(monkeypatch, llm, num_requests, temperature))


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_syncs_do_not_grow_with_batch_layers_or_k(monkeypatch, models, temperature):
    paths, drafts = models
    spec = lambda k: {"method": "eagle", "model": drafts["eagle"], "num_speculative_tokens": k}  # noqa: E731
    base = _max_syncs(monkeypatch, paths[4], spec(3), 1, temperature)
    assert base <= 12, base  # a handful per step: sampled ids, drafts, sampling bookkeeping
    assert _max_syncs(monkeypatch, paths[4], spec(3), 4, temperature) == base  # batch
    assert _max_syncs(monkeypatch, paths[4], spec(1), 1, temperature) <= base  # k
    assert _max_syncs(monkeypatch, paths[4], spec(5), 1, temperature) == base
    eagle3 = {"method": "eagle3", "model": drafts["eagle3"], "num_speculative_tokens": 5}
    assert _max_syncs(monkeypatch, paths[4], eagle3, 4, temperature) <= base
    no_spec = _max_syncs(monkeypatch, paths[2], None, 1, temperature)  # layers
    assert _max_syncs(monkeypatch, paths[4], None, 4, temperature) == no_spec


def test_the_counter_sees_a_per_request_read(monkeypatch, models):
    """Sanity check of the counter: a per-request `.item()` in the step adds one per request."""
    paths, _ = models
    with LLM(paths[2], compile="off", **ENGINE) as llm:
        one = max(count_syncs_per_step(monkeypatch, llm, 1, 0.0))
        runner = llm.engine.core.executor.worker.runner
        verify = runner._verify

        def reading_verify(hidden, inputs):
            for row in range(len(inputs.sampled)):
                hidden[row, 0].item()
            return verify(hidden, inputs)

        runner._verify = reading_verify
        four = max(count_syncs_per_step(monkeypatch, llm, 4, 0.0))
    assert four == one + 4
