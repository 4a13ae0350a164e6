"""The embedded default model (SmolLM2-135M-Instruct, converted from GGUF) matches transformers.

TP=1 in-process and TP=3 across three gloo processes (9 heads, 3 KV heads); TP=2 is
refused at configuration time.
"""

import pytest
import torch
from forward_helpers import prefill
from tp_workers import model_logits, spawn_ranks
from transformers import AutoModelForCausalLM, AutoTokenizer

from cluster.config import EngineConfig, ModelConfig, ParallelConfig
from cluster.models.loader import load_model
from cluster.parallel import ParallelState

TOL = 1e-4
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about tensor parallelism and the sea.",
    "List three prime numbers.",
]


@pytest.fixture(scope="module")
def reference(smollm2_path):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    seqs = [
        torch.tensor(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        )
        for p in PROMPTS
    ]
    hf = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    with torch.no_grad():
        refs = [hf(s[None]).logits[0] for s in seqs]
    return seqs, refs


def _check(logits: torch.Tensor, seqs, refs) -> None:
    for ours, ref in zip(logits.split([len(s) for s in seqs]), refs, strict=True):
        assert (ours - ref).abs().max().item() < TOL
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_converted_config_and_chat_template(smollm2_path):
    cfg = ModelConfig(path=smollm2_path)
    hf = cfg.hf_config
    assert (hf.num_attention_heads, hf.num_key_value_heads, hf.num_hidden_layers) == (9, 3, 30)
    assert hf.tie_word_embeddings and not hasattr(hf, "quantization_config")
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>assistant\n")


def test_tp1_matches_transformers(smollm2_path, reference):
    seqs, refs = reference
    model = load_model(ModelConfig(path=smollm2_path, dtype="float32"), ParallelState.single())
    with torch.no_grad():
        logits = model.compute_logits(prefill(model, torch.cat(seqs), [len(s) for s in seqs]))
    _check(logits, seqs, refs)


def test_tp3_matches_transformers(smollm2_path, reference):
    seqs, refs = reference
    EngineConfig(
        model=ModelConfig(path=smollm2_path), parallel=ParallelConfig(tensor_parallel_size=3)
    )
    per_rank = spawn_ranks(model_logits, 3, args=(3, [smollm2_path], [s.tolist() for s in seqs]))
    for rank_logits in per_rank:
        _check(rank_logits[0], seqs, refs)


def test_tp2_is_refused_with_the_reason(smollm2_path):
    with pytest.raises(
        ValueError,
        match=r"tensor_parallel_size=2 must divide the model's num_attention_heads=9 \(allowed: \[1, 3, 9\]\)",
    ):
        EngineConfig(
            model=ModelConfig(path=smollm2_path), parallel=ParallelConfig(tensor_parallel_size=2)
        )
