"""The compiled forward: bucket logic, padding that writes no KV, eager fallback, and
engines whose compiled output equals the eager one (tiny models) and transformers
(SmolLM2, with speculation). Each engine here compiles once; inductor's disk cache makes
later compiles of the same graphs cheaper.
"""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from greedy_reference import assert_greedy_equal, chat_ids, hf_greedy
from random_heads import write_all
from tiny_models import make_tiny_chat_model

from cluster import LLM, SamplingParams
from cluster.config import CompileConfig
from cluster.models.attention import AttentionMetadata, attention_context
from cluster.models.compiled import CompiledForward, CompileOptions, bucket_for, cut_rows, pad_rows
from cluster.parallel.pipeline import StageActivations
from cluster.worker.kv_cache import PagedKVCache

ENGINE = dict(dtype="float32", max_model_len=128, num_kv_blocks=96, block_size=4)
PROMPTS = [[5, 6, 7, 8, 9], list(range(100, 121)), [9, 8, 9, 8, 9, 8, 9], [40, 41, 42]]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def test_buckets_padding_and_cutting():
    sizes = (1, 2, 4, 8)
    assert [bucket_for(n, sizes) for n in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, None]
    x = torch.arange(6.0).view(3, 2)
    padded = pad_rows(x, 4)
    assert padded.shape == (4, 2) and torch.equal(padded[:3], x) and not padded[3].any()
    out = cut_rows((padded, [padded, padded]), 3)
    assert torch.equal(out[0], x) and all(torch.equal(o, x) for o in out[1])
    acts = cut_rows(StageActivations(padded, padded, [padded]), 3)
    assert acts.hidden.shape[0] == acts.residual.shape[0] == acts.aux[0].shape[0] == 3


def test_compile_config_checks_sizes_and_resolves_auto():
    with pytest.raises(ValueError, match=r"compile\.sizes"):
        CompileConfig(sizes=(4, 2))
    with pytest.raises(ValueError, match=r"compile\.sizes"):
        CompileConfig(sizes=(0, 2))
    with pytest.raises(ValueError, match="mode"):
        CompileConfig(mode="sometimes")

    class Shape:
        hidden_size, num_hidden_layers, vocab_size = 576, 30, 49152

    class Tiny:
        hidden_size, num_hidden_layers, vocab_size = 64, 2, 512

    auto = CompileConfig(mode="auto")
    assert auto.enabled(Shape, 1) and not auto.enabled(Shape, 2) and not auto.enabled(Tiny, 1)
    assert CompileConfig(mode="on").enabled(Tiny, 2)
    assert not CompileConfig(mode="off").enabled(Shape, 1)


def test_padding_rows_write_no_kv_and_real_rows_match_eager():
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 3 * 8)
    cache = PagedKVCache([(2, 4)], num_blocks=4, block_size=4, dtype=torch.float32)
    for t in (*cache.k, *cache.v):
        t.normal_()
    before = [t.clone() for t in (*cache.k, *cache.v)]

    def forward(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        from cluster.models.attention import attention

        q, k, v = layer(x).split(8, dim=-1)
        q, k, v = (t.view(-1, 2, 4) for t in (q, k, v))
        return attention(q, k, v, 0, 0.5) + positions[:, None]

    compiled = CompiledForward(
        forward, CompileOptions((4,), autotune=False), torch.device("cpu"), "t"
    )
    x = torch.randn(3, 8)
    slots = torch.tensor([4, 5, 6])
    meta = AttentionMetadata(
        [0, 3], [3], torch.arange(3), cache, slot_mapping=slots, block_tables=torch.tensor([[1]])
    )
    with torch.no_grad(), attention_context(meta):
        got = compiled(x, meta.positions)
    assert compiled.ready == {4}
    written = [t.clone() for t in (*cache.k, *cache.v)]
    for t, b in zip((*cache.k, *cache.v), before, strict=True):
        t.copy_(b)
    with torch.no_grad(), attention_context(meta):
        want = forward(x, meta.positions)
    assert got.shape == (3, 8)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for w, b in zip(written, before, strict=True):  # only the three real slots changed
        changed = (w != b).flatten(0, 1).flatten(1).any(-1).nonzero().flatten().tolist()
        assert changed == [4, 5, 6]


def test_a_bucket_that_cannot_compile_runs_eagerly_with_one_log_line(caplog):
    def forward(x: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()  # fullgraph=True refuses this
        return x * 2

    compiled = CompiledForward(
        forward, CompileOptions((2,), autotune=False), torch.device("cpu"), "t"
    )
    with (
        caplog.at_level(logging.WARNING, logger="cluster.models.compiled"),
        attention_context(AttentionMetadata.for_prefill([2])),
    ):
        first = compiled(torch.ones(2))
        second = compiled(torch.ones(1))
    assert torch.equal(first, torch.full((2,), 2.0)) and torch.equal(second, torch.full((1,), 2.0))
    assert compiled.failed == {2} and not compiled.ready
    lines = [r for r in caplog.records if "runs eagerly" in r.getMessage()]
    assert len(lines) == 1


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_path):
    root = tmp_path_factory.mktemp("compiled")
    path = str(root / "target")
    make_tiny_chat_model(path, smollm2_path, num_hidden_layers=3, seed=5)
    specs = write_all(str(root / "drafts"), path)
    return path, {name: specs[name] for name in ("eagle", "eagle3", "mtp_deepseek", "ngram")}


@pytest.mark.parametrize("spec", [None, "eagle", "eagle3", "mtp_deepseek", "ngram", "eagle_tree"])
def test_compiled_engine_equals_eager_on_a_tiny_model(tiny, spec):
    """(eagle_tree: EAGLE-2 trees; the verification's tree masks and the tree passes'
    ancestor masks reach the opaque attention op in the compiled graphs.)"""
    compiled_equals_eager(tiny, spec, "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("spec", [None, "eagle"])
def test_compiled_engine_with_cuda_graphs_equals_eager(tiny, spec):
    compiled_equals_eager(tiny, spec, "cuda")


def compiled_equals_eager(tiny, spec: str | None, device: str) -> None:
    path, specs = tiny
    spec_config = None
    if spec == "eagle_tree":
        tree = {"topk": 2, "num_nodes": 5}
        spec_config = {**specs["eagle"], "num_speculative_tokens": 3, "tree": tree}
    elif spec is not None:
        spec_config = {**specs[spec], "num_speculative_tokens": 3}
    outputs = {}
    for mode in ("off", "on"):
        with LLM(
            path,
            speculative_config=spec_config,
            compile=mode,
            compile_sizes=(1, 4, 16),  # 2, 3 and 5..8 tokens run padded
            compile_autotune=False,
            device=device,
            **ENGINE,
        ) as llm:
            outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
            outputs[mode] = [o.outputs[0].token_ids for o in outs]
            if mode == "on":
                runner = llm.engine.core.executor.worker.runner
                assert isinstance(runner.target_forward, CompiledForward)
                target = runner.target_forward
                assert target.ready and not target.failed
                assert target.num_guard_misses == 0  # warm-up built the graphs steps use
                if spec not in (None, "ngram"):  # (trees feed 1..8 nodes per pass)
                    drafts = runner.proposer.forwards
                    assert all(d.ready and d.num_guard_misses == 0 for d in drafts)
    assert outputs["on"] == outputs["off"]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["eagle3"])  # every method compiles on the tiny model
def test_compiled_smollm2_with_speculation_equals_transformers(smollm2_path, method):
    """SmolLM2 compiled for 2 and 8 tokens (2 requests: decode and k=3 verification), with
    the shipped EAGLE-3 head or n-gram drafts, greedy: token for token transformers' output
    (near-tie rule)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    chats = ["What is the capital of France?", "Repeat after me: red, green, blue, red, green."]
    prompts = [chat_ids(tok, c) for c in chats]
    hf = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    if method == "eagle3":
        spec = {"method": "eagle3", "model": "builtin:smollm2-eagle3", "num_speculative_tokens": 3}
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with LLM(
        smollm2_path,
        dtype="float32",
        max_model_len=512,
        speculative_config=spec,
        compile="on",
        compile_sizes=(2, 8),
        compile_autotune=False,  # oneDNN's packed products only (autotuning takes minutes)
        batch_invariant=False,  # per-bucket graphs (a batch-invariant engine compiles one)
    ) as llm:
        runner = llm.engine.core.executor.worker.runner
        assert runner.target_forward.ready == {2, 8}
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert llm.get_metrics()["num_drafts"] > 0
    for prompt, out in zip(prompts, outs, strict=True):
        ours = out.outputs[0].token_ids
        assert_greedy_equal(hf, prompt, ours, hf_greedy(hf, prompt, len(ours)))


def test_a_background_forward_runs_eagerly_until_its_warm_up_ends():
    def forward(ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return ids * 2 + positions

    options = CompileOptions((4,), autotune=False, background=True)
    compiled = CompiledForward(forward, options, torch.device("cpu"), "t")
    meta = AttentionMetadata.for_prefill([3])
    with torch.inference_mode():  # as the engine's steps (and the warm-up) run
        ids, positions = torch.tensor([5, 6, 7]), torch.arange(3)
    with torch.inference_mode(), attention_context(meta):
        before = compiled(ids, positions)
    assert not compiled.ready  # it ran eagerly: calling the graph would have built it
    thread = threading.Thread(target=compiled.warm_up)
    thread.start()
    thread.join()
    assert compiled.ready == {4} and not compiled.eager_until_warm

    def no_eager(*args):
        raise AssertionError("the eager forward ran after the warm-up")

    compiled.fn = no_eager
    with torch.inference_mode(), attention_context(meta):
        after = compiled(ids, positions)
    assert compiled.num_guard_misses == 0  # the graph ran, as built
    assert torch.equal(after, before) and torch.equal(after, torch.tensor([10, 13, 16]))


def test_an_engine_compiling_in_the_background_answers_as_the_eager_one(tiny, monkeypatch):
    """bfloat16, batch-invariant (one dynamic graph), EAGLE-3 drafts: the answers given while
    the graphs compile (eager) and after (compiled) are the eager engine's, token for token.
    The compile thread waits until the first answers are in, so they are surely eager."""
    path, specs = tiny
    spec = {**specs["eagle3"], "num_speculative_tokens": 3}
    engine = {**ENGINE, "dtype": "bfloat16", "batch_invariant": True}
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    with LLM(path, speculative_config=spec, compile="off", **engine) as llm:
        eager = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]

    go = threading.Event()
    warm_up = CompiledForward.warm_up

    def held_warm_up(self, *args, **kwargs):
        assert go.wait(timeout=600)
        return warm_up(self, *args, **kwargs)

    monkeypatch.setattr(CompiledForward, "warm_up", held_warm_up)
    with LLM(
        path, speculative_config=spec, compile="on", compile_in_background=True, **engine
    ) as llm:
        runner = llm.engine.core.executor.worker.runner
        forwards = [runner.target_forward, *runner.proposer.forwards]
        assert all(f.eager_until_warm for f in forwards)
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        while_compiling = [o.outputs[0].token_ids for o in outs]
        assert all(f.eager_until_warm and not f.ready for f in forwards)
        go.set()
        (thread,) = [t for t in threading.enumerate() if t.name == "cluster-compile"]
        thread.join(timeout=600)
        assert all(f.ready and not f.eager_until_warm for f in forwards)
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        compiled = [o.outputs[0].token_ids for o in outs]
        assert runner.target_forward.num_guard_misses == 0
    assert while_compiling == eager and compiled == eager
