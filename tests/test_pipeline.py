"""Pipeline parallelism: stage layer ranges, stages chained in one process against
transformers, and the engine at PP=2/3 (with TP=2, and with every speculative method)
giving the greedy output of PP=1."""

import pytest
import torch
from block_checks import assert_no_block_leaks
from forward_helpers import prefill
from random_heads import write_all, write_deepseek_mtp, write_eagle
from tiny_models import VARIANTS, hf_logits, make_tiny_chat_model, make_tiny_llama

from cluster import LLM, SamplingParams
from cluster.config import ModelConfig, SpeculativeConfig, stage_layer_counts
from cluster.models.loader import load_model
from cluster.parallel import ParallelState
from cluster.parallel.pipeline import StageActivations

TOL = 1e-4
SEQ_LENS = [3, 9, 1]


def test_even_split_gives_earlier_stages_the_remainder():
    assert stage_layer_counts(30, 2) == (15, 15)
    assert stage_layer_counts(30, 4) == (8, 8, 7, 7)
    assert stage_layer_counts(3, 3) == (1, 1, 1)
    assert stage_layer_counts(8, 3, (3, 2, 3)) == (3, 2, 3)


@pytest.mark.parametrize(
    ("num_layers", "pp", "partition", "message"),
    [
        (3, 4, None, "pipeline_parallel_size=4 exceeds the model's num_hidden_layers=3"),
        (8, 2, (4, 2, 2), r"has 3 entries; pipeline_parallel_size=2 needs one per stage"),
        (8, 2, (8, 0), "at least one layer and sum to the model's num_hidden_layers=8"),
        (8, 2, (4, 3), "at least one layer and sum to the model's num_hidden_layers=8"),
    ],
)
def test_bad_stage_layouts_are_refused(num_layers, pp, partition, message):
    with pytest.raises(ValueError, match=message):
        stage_layer_counts(num_layers, pp, partition)


def _stage(path: str, pp_rank: int, pp_size: int, partition=None):
    state = ParallelState(0, 1, pp_rank, pp_size, pp_layer_partition=partition)
    return load_model(ModelConfig(path=path, dtype="float32"), state, show_progress=False)


@pytest.mark.parametrize("variant", ["gqa_untied_odd_vocab", "tied_mha"])
@pytest.mark.parametrize(("pp", "partition"), [(3, None), (2, (2, 1)), (2, (1, 2))])
def test_stages_chained_in_one_process_match_transformers(tmp_path, variant, pp, partition):
    path = str(tmp_path / variant)
    hf = make_tiny_llama(path, seed=4, **VARIANTS[variant])
    stages = [_stage(path, rank, pp, partition) for rank in range(pp)]
    first, last = stages[0], stages[-1]
    # Only the stages that need them hold the embedding, the final norm and the LM head.
    assert first.model.embed_tokens is not None and first.lm_head is None
    assert all(s.model.embed_tokens is None for s in stages[1:])
    assert all(s.model.norm is None and s.lm_head is None for s in stages[:-1])
    assert last.model.norm is not None and last.lm_head is not None
    for stage in stages:  # each stage holds exactly its own decoder layers
        owned = {int(n.split(".")[2]) for n, _ in stage.named_parameters() if ".layers." in n}
        assert owned == set(range(stage.model.start_layer, stage.model.end_layer))
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, hf.config.vocab_size, (n,), generator=g) for n in SEQ_LENS]
    aux_layers = (2, 0, 1)
    with torch.no_grad():
        out = None
        for stage in stages:
            out = prefill(stage, torch.cat(seqs), SEQ_LENS, aux_layers, out)
            if stage is not last:
                assert isinstance(out, StageActivations)
                assert len(out.aux) == len({i for i in aux_layers if i < stage.model.end_layer})
        hidden, aux = out
        logits = last.compute_logits(hidden)
    for i, (ours, ref) in enumerate(zip(logits.split(SEQ_LENS), hf_logits(hf, seqs), strict=True)):
        assert (ours - ref).abs().max().item() < TOL
        ref_hidden = hf(seqs[i][None], output_hidden_states=True).hidden_states
        for layer, ours_aux in zip(aux_layers, aux, strict=True):
            torch.testing.assert_close(
                ours_aux.split(SEQ_LENS)[i], ref_hidden[layer][0], atol=TOL, rtol=0
            )


@pytest.mark.parametrize("tied", [False, True])
def test_last_stage_gets_the_embedding_a_draft_shares(tmp_path, tied):
    path = str(tmp_path / "target")
    hf = make_tiny_llama(path, seed=5, num_hidden_layers=4, tie_word_embeddings=tied)
    specs = write_all(str(tmp_path / "drafts"), path)
    last = _stage(path, 1, 2)
    assert last.model.embed_tokens is None
    spec = SpeculativeConfig(**specs["eagle"], num_speculative_tokens=2)
    draft = spec.draft_method.load_draft(
        spec, ModelConfig(path=path, dtype="float32"), last, last.state
    )
    embed = last.model.embed_tokens
    assert draft.embed_tokens is embed
    vocab = hf.config.vocab_size
    torch.testing.assert_close(embed.weight[:vocab], hf.model.embed_tokens.weight, atol=0, rtol=0)
    assert (embed.weight is last.lm_head.weight) == tied


GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
PROMPTS = [[5, 6, 7], list(range(100, 127)), [9, 8, 9, 8, 9, 8, 9, 8, 9], [40, 41, 42, 43]]
ENGINE = dict(
    dtype="float32", max_model_len=128, num_kv_blocks=96, block_size=4, max_num_batched_tokens=20
)


@pytest.fixture(scope="module")
def target(tmp_path_factory, smollm2_path):
    """An 8-layer tiny chat model: EAGLE-3 reads layers 2, 4 and 5."""
    root = tmp_path_factory.mktemp("pipeline")
    path = str(root / "target")
    make_tiny_chat_model(path, smollm2_path, num_hidden_layers=8, seed=6)
    return path, write_all(str(root / "drafts"), path)


def _generate(path, spec=None, **engine):
    speculative = None if spec is None else {**spec, "num_speculative_tokens": 3}
    with LLM(path, speculative_config=speculative, **ENGINE, **engine) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        assert_no_block_leaks(llm.engine.core.block_manager)
        timings = llm.engine.core.executor.stage_timings()
        return [o.outputs[0].token_ids for o in outs], llm.get_metrics(), timings


@pytest.fixture(scope="module")
def baseline(target):
    return _generate(target[0])[0]


LAYOUTS = {
    "pp2": dict(pipeline_parallel_size=2),
    # EAGLE-3's layers 2, 4 and 5 on three different stages
    "pp3_uneven": dict(pipeline_parallel_size=3, pipeline_layer_partition=(3, 2, 3)),
    "tp2_pp2": dict(pipeline_parallel_size=2, tensor_parallel_size=2),
}


@pytest.mark.parametrize("method", [None, "eagle", "eagle3"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_pipeline_greedy_equals_one_stage(target, baseline, layout, method):
    path, specs = target
    spec = None if method is None else specs[method]
    tokens, metrics, timings = _generate(path, spec, **LAYOUTS[layout])
    assert tokens == baseline
    if method is not None:
        assert metrics["num_draft_tokens"] > 0
    # every rank ran every step, in order
    assert len(timings) == LAYOUTS[layout].get("tensor_parallel_size", 1) * len(
        {t["pp_rank"] for t in timings}
    )
    assert len({t["steps"] for t in timings}) == 1


@pytest.mark.parametrize("method", ["mtp_deepseek", "ngram", "draft_model"])
def test_every_draft_runs_on_the_last_stage(target, baseline, method):
    path, specs = target
    tokens, metrics, _ = _generate(path, specs[method], pipeline_parallel_size=2)
    assert tokens == baseline
    assert metrics["num_draft_tokens"] > 0
    if method != "mtp_deepseek":  # these drafts are right sometimes: rollbacks happen
        assert 0 < metrics["num_accepted_tokens"] < metrics["num_draft_tokens"]


SMOLLM2_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about rain.",
    "Explain what a list is in Python.",
    "Give me three tips for sleeping well.",
]
EAGLE3 = {"method": "eagle3", "model": "builtin:smollm2-eagle3", "num_speculative_tokens": 3}


def _smollm2(path, **engine):
    with LLM(path, dtype="bfloat16", max_model_len=256, num_kv_blocks=128, **engine) as llm:
        messages = [[{"role": "user", "content": p}] for p in SMOLLM2_PROMPTS]
        outs = llm.chat(messages, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm.get_metrics()


def test_smollm2_pipeline_with_drafts_equals_one_stage(smollm2_path, tmp_path):
    """30 layers: EAGLE-3 reads 2, 15, 27: stages 0/1/1 at PP=2 and 0/1/2 at PP=3. At PP=2
    the drafts are trees (EAGLE-2's for EAGLE-3 and an MTP head, a static one for
    EAGLE-1)."""
    reference, _ = _smollm2(smollm2_path)
    for pp, tree in ((2, {"topk": 2, "num_nodes": 5}), (3, None)):
        tokens, metrics = _smollm2(
            smollm2_path, pipeline_parallel_size=pp, speculative_config={**EAGLE3, "tree": tree}
        )
        assert tokens == reference
        assert metrics["num_accepted_tokens"] > 0  # the trained head is right sometimes
    # EAGLE-1 (random head) on the last stage, sharing the embedding it loads there
    eagle = {"method": "eagle", "model": write_eagle(str(tmp_path / "eagle"), smollm2_path)}
    static = {"paths": [[0], [1], [0, 0], [1, 0]]}
    tokens, metrics = _smollm2(
        smollm2_path,
        pipeline_parallel_size=2,
        speculative_config={**eagle, "num_speculative_tokens": 2, "tree": static},
    )
    assert tokens == reference and metrics["num_draft_tokens"] > 0
    # a DeepSeek-style MTP head (random, two layers) growing EAGLE-2 trees on the last stage
    mtp = {"method": "mtp", "model": write_deepseek_mtp(str(tmp_path / "mtp"), smollm2_path)}
    tokens, metrics = _smollm2(
        smollm2_path,
        pipeline_parallel_size=2,
        speculative_config={
            **mtp,
            "num_speculative_tokens": 3,
            "tree": {"topk": 3, "num_nodes": 7},
        },
    )
    assert tokens == reference and metrics["num_draft_tokens"] > 0
