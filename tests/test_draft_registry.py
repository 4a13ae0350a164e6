"""The draft-method registry: a method written and registered by a test runs end to end
(configuration, detection from its checkpoint, its proposer in the engine) with greedy
output equal to speculation off; the table's own rules (names, aliases, detection order,
trainers)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from tiny_models import make_tiny_chat_model

from cluster import LLM, SamplingParams
from cluster.config.draft_registry import (
    DraftMethod,
    canonical_method_name,
    draft_method,
    draft_methods,
    register_draft_method,
    registered_draft_method,
)
from cluster.config.speculative import SpeculativeConfig
from cluster.spec_decode.batch import DraftProposal, ProposalBatch
from cluster.train.pipeline import trainable_methods

PROMPTS = [[5, 6, 7], list(range(100, 121)), [9, 8, 9, 8, 9, 8, 9]]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
ENGINE = dict(dtype="float32", max_model_len=96, num_kv_blocks=64, block_size=4)


class ScriptProposer:
    """Drafts the continuation of whichever known sequence the request's history starts,
    with every third draft made wrong on purpose (so some drafts are rejected)."""

    needs_token_history = True

    def __init__(self, k: int, sequences: list[list[int]], vocab: int) -> None:
        self.k, self.sequences, self.vocab = k, sequences, vocab
        self.calls = 0

    def warm_up(self) -> float:
        return 0.0

    def propose(self, batch: ProposalBatch) -> DraftProposal:
        self.calls += 1
        drafts = []
        for history, sampled in zip(batch.token_history, batch.sampled, strict=True):
            known = next((s for s in self.sequences if s[: len(history)] == history), [])
            ahead = known[len(history) : len(history) + self.k] if sampled else []
            drafts.append(
                [
                    (t + 1) % self.vocab if (len(history) + i) % 3 == 0 else t
                    for i, t in enumerate(ahead)
                ]
            )
        return DraftProposal(drafts, [None] * len(drafts))


class ScriptMethod(DraftMethod):
    """A toy method: no weights, no KV; its checkpoint (for detection) is a folder whose
    config names the `ScriptDraft` architecture."""

    name = "toy_script"
    aliases = ("toy",)
    draft_source = "none"
    kv_cache = "none"
    kinds = ("toy_script",)

    def __init__(self, sequences: list[list[int]], vocab: int) -> None:
        self.sequences, self.vocab = sequences, vocab
        self.proposers: list[ScriptProposer] = []

    def detect(self, tensor_names, architectures):
        return "toy_script" if "ScriptDraft" in architectures else None

    def make_proposer(self, spec, draft, kv_cache, block_size, compile_options):
        assert draft is None and kv_cache is None
        proposer = ScriptProposer(spec.num_speculative_tokens, self.sequences, self.vocab)
        self.proposers.append(proposer)
        return proposer


@pytest.fixture(scope="module")
def target(tmp_path_factory, smollm2_path):
    path = str(tmp_path_factory.mktemp("registry") / "target")
    hf = make_tiny_chat_model(path, smollm2_path, num_hidden_layers=2, seed=11)
    with LLM(path, **ENGINE) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return path, int(hf.config.vocab_size), [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("k", [1, 3])
def test_a_method_registered_by_a_test_runs_end_to_end_losslessly(target, k):
    path, vocab, baseline = target
    sequences = [p + b for p, b in zip(PROMPTS, baseline, strict=True)]
    method = ScriptMethod(sequences, vocab)
    with registered_draft_method(method):
        spec = {"method": "toy", "num_speculative_tokens": k}  # by its alias
        with LLM(path, speculative_config=spec, **ENGINE) as llm:
            outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
            metrics = llm.get_metrics()
            assert llm.engine.core.config.speculative.resolved_method == "toy_script"
    assert [list(o.outputs[0].token_ids) for o in outs] == baseline
    assert method.proposers and method.proposers[0].calls > 0
    drafted, accepted = metrics["num_draft_tokens"], metrics["num_accepted_tokens"]
    assert 0 < accepted < drafted  # right drafts were taken and wrong ones refused
    assert "toy_script" not in [m.name for m in draft_methods()]


def test_a_registered_method_is_detected_from_its_checkpoint(tmp_path):
    folder = tmp_path / "toy-draft"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["ScriptDraft"]}))
    save_file({"toy.weight": torch.zeros(2)}, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="toy"):
        SpeculativeConfig(method="toy", num_speculative_tokens=2)  # not registered yet
    with registered_draft_method(ScriptMethod([], 10)):
        spec = SpeculativeConfig(model=str(folder), num_speculative_tokens=2)
        assert spec.resolved_method == "toy_script"
        assert spec.draft_kind_for("/unused") == "toy_script"
    # the same folder without the toy is a draft model (the fallback), not a toy
    spec = SpeculativeConfig(model=str(folder), num_speculative_tokens=2)
    assert spec.resolved_method == "draft_model"


def test_names_aliases_and_order():
    names = [m.name for m in draft_methods()]
    assert names[:5] == ["eagle3", "mtp", "eagle", "draft_model", "ngram"]
    assert canonical_method_name("deepseek_mtp") == "mtp"
    assert canonical_method_name("[ngram]") == "ngram"
    with pytest.raises(ValueError, match=r"speculative.method='medusa' is not a draft method"):
        draft_method("medusa")
    with pytest.raises(ValueError, match="registered already"):
        register_draft_method(_Clash([], 10))
    assert set(trainable_methods()) == {"eagle3", "eagle", "mtp"}
    assert draft_method("ngram").kv_cache == "none"
    assert draft_method("draft_model").kv_cache == "own"


class _Clash(ScriptMethod):
    aliases = ("deepseek_mtp",)  # another method's alias
