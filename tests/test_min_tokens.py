"""`min_tokens`: EOS and stop token ids stay out until a request has that many outputs,
at every position a step samples or verifies, so speculation changes nothing."""

import pytest
import torch
from pydantic import ValidationError
from random_heads import write_all
from tiny_models import make_tiny_chat_model
from transformers import AutoTokenizer

from cluster import LLM, SamplingParams
from cluster.sample.metadata import MinTokens, SamplingMetadata
from cluster.sample.processing import apply_min_tokens
from cluster.sample.spec_metadata import SpecDecodeMetadata

ENGINE = dict(dtype="float32", max_model_len=128, num_kv_blocks=64, block_size=4)
STOP_ID = 1000


@pytest.fixture(scope="module")
def target(tmp_path_factory, smollm2_path):
    root = tmp_path_factory.mktemp("min_tokens")
    make_tiny_chat_model(str(root / "target"), smollm2_path, num_hidden_layers=4, seed=7)
    path = str(root / "target")
    eos = AutoTokenizer.from_pretrained(path).eos_token_id
    return path, eos, write_all(str(root / "drafts"), path)


def _params(eos, **fields):
    """Greedy, with EOS (else STOP_ID) pushed to the top so it would end it at once."""
    bias = {STOP_ID: 90} if fields.get("ignore_eos") else {eos: 100, STOP_ID: 90}
    return SamplingParams(temperature=0, max_tokens=12, logit_bias=bias, **fields)


def _generate(path, params, spec=None):
    spec = {**spec, "num_speculative_tokens": 3} if spec else None
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": list(range(40, 60))}]
    with LLM(path, speculative_config=spec, **ENGINE) as llm:
        return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def test_eos_and_stop_ids_wait_for_min_tokens(target):
    path, eos, _ = target
    assert [len(o.token_ids) for o in _generate(path, _params(eos))] == [1, 1]
    outs = _generate(path, _params(eos, min_tokens=5))
    for out in outs:
        assert len(out.token_ids) == 6 and out.token_ids[-1] == eos
        assert eos not in out.token_ids[:-1] and out.finish_reason == "stop"
    # With EOS ignored, the stop id ends it once allowed (and is its stop reason).
    outs = _generate(path, _params(eos, min_tokens=3, ignore_eos=True, stop_token_ids=[STOP_ID]))
    assert [o.token_ids[-1] for o in outs] == [STOP_ID] * 2
    assert [len(o.token_ids) for o in outs] == [4, 4]
    assert [o.stop_reason for o in outs] == [STOP_ID] * 2


@pytest.mark.parametrize("method", ["eagle3", "ngram"])
def test_min_tokens_is_lossless_under_speculation(target, method):
    path, eos, specs = target
    params = _params(eos, min_tokens=7, stop_token_ids=[STOP_ID])
    plain = _generate(path, params)
    speculating = _generate(path, params, specs[method])
    assert [o.token_ids for o in speculating] == [o.token_ids for o in plain]
    assert all(len(o.token_ids) == 8 for o in plain)


def test_a_verifying_row_counts_the_drafts_before_it():
    """Rows verifying drafts 0, 1, 2 then the bonus row: with 2 outputs still to come,
    only rows 0 and 1 lose their stop token."""
    spec = SpecDecodeMetadata.from_drafts([[11, 12, 13]])
    stop_mask = torch.zeros(1, 8, dtype=torch.bool)
    stop_mask[0, 3] = True
    min_tokens = MinTokens(stop_mask, torch.tensor([2]))
    logits = torch.zeros(4, 8)  # the rows of a chain: the root's, then each draft's
    apply_min_tokens(logits, min_tokens, spec.tree_rows())
    assert torch.isinf(logits[:, 3]).tolist() == [True, True, False, False]
    assert torch.isinf(logits).sum() == 2


def test_metadata_keeps_stops_out_only_while_outputs_are_few():
    params = [SamplingParams(min_tokens=3, stop_token_ids=[4]), SamplingParams()]
    meta = SamplingMetadata.from_params(
        params, 8, output_token_ids=[[1], [1]], eos_token_ids=[2, 2]
    )
    assert meta.min_tokens is not None
    assert meta.min_tokens.remaining.tolist() == [2, 0]
    assert meta.min_tokens.stop_mask[0].nonzero().flatten().tolist() == [2, 4]
    done = SamplingMetadata.from_params(
        params, 8, output_token_ids=[[1, 1, 1], [1]], eos_token_ids=[2, 2]
    )
    assert done.min_tokens is None


def test_min_tokens_is_validated():
    with pytest.raises(ValidationError, match="min_tokens"):
        SamplingParams(min_tokens=-1)
    with pytest.raises(ValidationError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=3)
    assert SamplingParams(min_tokens=5, max_tokens=None).min_tokens == 5


def test_openai_requests_carry_min_tokens():
    from cluster.serve.openai_protocol import ChatCompletionRequest, CompletionRequest

    completion = CompletionRequest(model="m", prompt="p", max_tokens=8, min_tokens=3)
    assert completion.sampling_params().min_tokens == 3
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    assert chat.sampling_params().min_tokens == 0
