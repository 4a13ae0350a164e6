"""Does training's held-out acceptance predict the engine's? One EAGLE-3 head, the same
held-out chats, three measurements:

1. teacher-forced (what `train-draft` reports): the head's TTT chain over the stored
   answers, with the target's features, counting labels outside the draft vocabulary as
   misses; acceptance length = 1 + mean leading right drafts of k;
2. the engine, greedy, each chat to its stored answer's length (EOS ends it as it did);
3. the engine the way `spec_decode.py` runs it: `--new-tokens` with `ignore_eos`.

Rows 1 and 2 should agree: a gap means training and inference feed the head differently.
Row 2 also checks that speculation reproduces the stored greedy answers.

    python benchmarks/acceptance_check.py --head cluster/heads/smollm2-eagle3 [--num-chats 32]
"""

from __future__ import annotations

import argparse
import warnings

import torch

from cluster import LLM, SamplingParams
from cluster.config import ModelConfig
from cluster.models.default_model import ensure_default_model
from cluster.models.eagle3 import eagle3_aux_layers
from cluster.models.loader import load_model
from cluster.parallel import ParallelState
from cluster.train.answer_store import AnswerStore
from cluster.train.dataset import aux_states
from cluster.train.loop import StepCounts, TrainConfig, collate
from cluster.train.trainer import draft_classes, eagle3_step, import_eagle3

warnings.filterwarnings("ignore")


def teacher_forced(path: str, head: str, samples: list, k: int) -> StepCounts:
    model_config = ModelConfig(path=path, dtype="float32")
    model = load_model(model_config, ParallelState.single(), show_progress=False)
    hf_config = model_config.hf_config
    aux = eagle3_aux_layers(int(hf_config.num_hidden_layers))
    with torch.inference_mode():
        features = [f for s in samples for f in aux_states(model, [s], aux)]
    embed = model.model.embed_tokens.weight.detach().float()
    trainable, d2t = import_eagle3(head, hf_config, embed)
    sequences = [
        {"token_ids": s.token_ids, "answer_start": s.answer_start, "features": f}
        for s, f in zip(samples, features, strict=True)
    ]
    labels = draft_classes(d2t, int(hf_config.vocab_size))
    step = eagle3_step(trainable, TrainConfig(ttt_steps=k))
    counts = StepCounts([0] * k, [0] * k, [0] * k)
    with torch.no_grad():
        for i in range(len(sequences)):
            counts = counts + step(collate(sequences, [i], labels, k))[1]
    return counts


def engine(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple:
    before = llm.get_metrics()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    after = llm.get_metrics()
    drafts = after["num_drafts"] - before["num_drafts"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]

    def accepted_at(metrics: dict, i: int) -> float:  # how often draft i was accepted
        shares = metrics["acceptance_per_position"]
        return shares[i] * metrics["num_drafts"] if i < len(shares) else 0.0

    per_position = [
        accepted_at(after, i) - accepted_at(before, i)
        for i in range(len(after["acceptance_per_position"]))
    ]
    return (
        [list(o.outputs[0].token_ids) for o in outs],
        1 + accepted / max(1, drafts),
        [p / max(1, drafts) for p in per_position],
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--head", required=True)
    parser.add_argument("--answers", default="data/answers/smollm2-135m-instruct/eval")
    parser.add_argument("--num-chats", type=int, default=32)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--compile", default="auto", choices=["auto", "on", "off"])
    args = parser.parse_args()

    path = ensure_default_model()
    samples = AnswerStore(args.answers).read_part(0)[: args.num_chats]
    counts = teacher_forced(path, args.head, samples, args.k)
    prompts = [s.token_ids[: s.answer_start] for s in samples]
    answers = [s.token_ids[s.answer_start :] for s in samples]
    spec = {"method": "eagle3", "model": args.head, "num_speculative_tokens": args.k}
    engine_args = dict(
        dtype="float32", max_model_len=512, max_num_seqs=len(samples), compile=args.compile
    )
    with LLM(path, speculative_config=spec, **engine_args) as llm:
        to_length = [SamplingParams(temperature=0, max_tokens=len(a)) for a in answers]
        tokens, stored_length, stored_positions = engine(llm, prompts, to_length)
        fixed = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
        _, fixed_length, fixed_positions = engine(llm, prompts, [fixed] * len(prompts))
    same = sum(t == a for t, a in zip(tokens, answers, strict=True))

    print(f"head={args.head} chats={len(samples)} k={args.k} compile={args.compile}")
    print(f"engine output equals the stored greedy answer for {same}/{len(samples)} chats\n")
    print("| measurement | acceptance length | per draft position: accepted / drafts |")
    print("|---|---:|---|")
    chain = [c / max(1, counts.totals[0]) for c in counts.chain_hits]
    rows = [
        ("teacher-forced, stored answers", counts.acceptance_length, chain),
        ("engine, to the stored length", stored_length, stored_positions),
        (f"engine, {args.new_tokens} tokens, ignore_eos", fixed_length, fixed_positions),
    ]
    for name, length, positions in rows:
        print(f"| {name} | {length:.2f} | {' / '.join(f'{p:.3f}' for p in positions)} |")
    accuracy = " / ".join(f"{a:.3f}" for a in counts.accuracy)
    print(f"\nteacher-forced top-1 accuracy per TTT step (true earlier tokens): {accuracy}")


if __name__ == "__main__":
    main()
