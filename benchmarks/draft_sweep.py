"""Which draft vocabulary and how many training-time-test steps: short EAGLE-3 runs on the
same training parts, compared by held-out acceptance length (chains of k = 1..3 drafts).

Each setting trains from the same seed on the first `--parts` feature parts for
`--epochs`, in the precision `train-draft` uses, and is evaluated on the held-out
features; the table gives the acceptance length at each k and the share of held-out
answer tokens the draft vocabulary holds (an upper bound on step-0 accuracy).

    python benchmarks/draft_sweep.py --features WORK/features_train \
        --eval-features WORK/features_eval --settings 4096:3 8192:3 49152:3 8192:4
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch
from safetensors import safe_open

from cluster.config import ModelConfig
from cluster.models.default_model import ensure_default_model
from cluster.train.loop import TrainConfig, load_shards
from cluster.train.trainer import draft_vocabulary, train_eagle3


def first_parts(feature_dir: str, parts: int, into: str) -> str:
    """A folder of links to the first `parts` parts of `feature_dir`."""
    os.makedirs(into, exist_ok=True)
    names = sorted(n for n in os.listdir(feature_dir) if n.startswith("part_"))
    stems = sorted({n.split(".")[0] for n in names})[:parts]
    for stem in stems:
        for ext in (".npy", ".npz"):
            os.symlink(os.path.join(feature_dir, stem + ext), os.path.join(into, stem + ext))
    return into


def coverage(train_dir: str, eval_dir: str, size: int, vocab: int) -> float:
    """Share of held-out answer tokens inside the draft vocabulary of `size`."""
    d2t, _ = draft_vocabulary(load_shards(train_dir), size, vocab)
    inside = torch.zeros(vocab, dtype=torch.bool)
    inside[torch.arange(len(d2t)) + d2t] = True
    tokens = [t for s in load_shards(eval_dir) for t in s["token_ids"][s["answer_start"] :]]
    return float(inside[torch.tensor(tokens)].float().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--features", required=True, help="the training feature folder")
    parser.add_argument("--eval-features", required=True)
    parser.add_argument("--parts", type=int, default=2, help="training parts used (1024 chats)")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument(
        "--settings", nargs="+", default=["4096:3", "8192:3"], help="VOCAB:TTT_STEPS"
    )
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()

    target = ensure_default_model()
    hf = ModelConfig(path=target).hf_config
    with safe_open(os.path.join(target, "model.safetensors"), framework="pt") as f:
        embed = f.get_tensor("model.embed_tokens.weight").float()
        head = f.get_tensor("lm_head.weight").float() if "lm_head.weight" in f.keys() else embed  # noqa: SIM118
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        train_dir = first_parts(args.features, args.parts, os.path.join(tmp, "train"))
        for setting in args.settings:
            vocab, steps = (int(x) for x in setting.split(":"))
            vocab = min(vocab, int(hf.vocab_size))
            config = TrainConfig(
                draft_vocab_size=vocab, ttt_steps=steps, epochs=args.epochs, lr=args.lr,
                compile=True,
            )  # fmt: skip
            started = time.time()
            result = train_eagle3(
                hf, embed, head, [train_dir], [args.eval_features],
                os.path.join(tmp, f"head_{vocab}_{steps}"), config,
                os.path.join(tmp, f"run_{vocab}_{steps}"),
            )  # fmt: skip
            last = result["history"][-1]
            rows.append(
                {
                    "draft_vocab_size": vocab,
                    "ttt_steps": steps,
                    "coverage": coverage(train_dir, args.eval_features, vocab, int(hf.vocab_size)),
                    "acceptance_by_k": last["held_out_acceptance_by_k"],
                    "accuracy": last["held_out_accuracy"],
                    "answer_tokens_per_s": last["answer_tokens_per_s"],
                    "seconds": round(time.time() - started),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    print(
        f"\n{args.parts} parts, {args.epochs} epoch(s), lr {args.lr}\n"
        "| draft vocab | TTT steps | held-out vocab coverage | acceptance k=1 | k=2 | k=3 "
        "| tokens/s |\n|---:|---:|---:|---:|---:|---:|---:|"
    )
    for r in rows:
        acc = [f"{a:.3f}" for a in r["acceptance_by_k"][:3]]
        print(
            f"| {r['draft_vocab_size']} | {r['ttt_steps']} | {r['coverage']:.3f} | "
            f"{' | '.join(acc)} | {r['answer_tokens_per_s']} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
