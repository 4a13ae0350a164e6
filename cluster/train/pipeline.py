"""`cluster train-draft`: prompts -> the target's answers -> cached features -> a trained head.

Every stage caches its result under `--work-dir`, so a rerun resumes where it stopped:
answers and features part by part (shared by every head trained from that work dir),
training from its last checkpoint with `--resume` (one per `--out`, under `runs/`).
Each stage's wall time, summed over the runs that made the head, goes to `recipe.json`.
`--method` picks the head: EAGLE-3 (default; features: three aux residual streams),
EAGLE-1 or DeepSeek-style MTP (features: the target's final hidden states).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from collections.abc import Iterator

import torch

from cluster.config.draft_registry import draft_method, draft_methods
from cluster.train.dataset import answer_with_follow_ups, cache_features, feature_dirs
from cluster.train.feature_store import load_shards
from cluster.train.inputs import TrainInputs
from cluster.train.prompts import build_prompts, read_chats
from cluster.train.trainer import TrainConfig


def train_draft(
    target: str,
    out_dir: str,
    work_dir: str,
    max_tokens: int,
    num_prompts: int | None,
    config: TrainConfig,
    method: str = "eagle3",
    answers_dir: str | None = None,
    num_eval_prompts: int = 256,
    follow_up_fraction: float = 0.2,
    record_features: bool = True,
    data_only: bool = False,
    resume: bool = False,
    dataset: str | None = None,
) -> dict:
    from safetensors import safe_open

    from cluster.config import ModelConfig

    model_config = ModelConfig(path=target, dtype="float32")
    hf = model_config.hf_config
    draft = draft_method(method)
    if not draft.trainable:
        raise ValueError(f"method {method!r} has no trainer (trainable: {trainable_methods()})")
    # the target layers the draft reads (EAGLE-3: three), or () for the final hidden state
    aux = draft.target_layers(hf)
    if dataset is not None:  # the user's chats (JSON lines), split by the same hash rule
        train_chats, eval_chats = read_chats(dataset)
    else:
        train_chats, eval_chats = build_prompts(seed=config.seed)
    if num_prompts is not None:
        train_chats = train_chats[:num_prompts]
    eval_chats = eval_chats[:num_eval_prompts]
    answers_dir = answers_dir or os.path.join(work_dir, "answers")
    os.makedirs(work_dir, exist_ok=True)
    # this head's checkpoints and stage times (other heads may share the work dir's data)
    run_dir = os.path.join(
        work_dir, "runs", os.path.abspath(out_dir).strip(os.sep).replace(os.sep, "_")
    )
    os.makedirs(run_dir, exist_ok=True)
    timings = _StageTimes(os.path.join(run_dir, "stage_seconds.json"))
    dirs, counts = {}, {}
    for split, chats in (("train", train_chats), ("eval", eval_chats)):
        with timings.stage("answers"):
            stores = answer_with_follow_ups(
                target, chats, max_tokens, answers_dir, split, follow_up_fraction, config.seed,
                record_in=work_dir if record_features else None,
            )  # fmt: skip
        dirs[split] = []
        for store in stores:
            feature_dir = feature_dirs(work_dir, store)[0 if aux else 1]
            with timings.stage("features"):
                cache_features(target, os.path.join(answers_dir, store), aux, feature_dir)
            dirs[split].append(feature_dir)
        samples = [s for d in dirs[split] for s in load_shards(d)]
        counts[split] = (
            len(samples),
            sum(len(s["token_ids"]) - s["answer_start"] for s in samples),
        )
    if data_only:
        return {"stage_seconds": timings.seconds, "prompts_and_answer_tokens": counts}
    with safe_open(os.path.join(target, "model.safetensors"), framework="pt") as f:
        embed = f.get_tensor("model.embed_tokens.weight").float()
        head = f.get_tensor("lm_head.weight").float() if "lm_head.weight" in f.keys() else embed  # noqa: SIM118
        final_norm = f.get_tensor("model.norm.weight").float()
    with timings.stage("train"):
        inputs = TrainInputs(
            hf, embed, head, final_norm, dirs["train"], dirs["eval"], out_dir, config,
            run_dir, resume,
        )  # fmt: skip
        result = draft.train(inputs)
    recipe = {
        "method": draft.name,
        "target": os.path.basename(os.path.normpath(target)),
        "train_prompts": counts["train"][0],
        "train_answer_tokens": counts["train"][1],
        "eval_prompts": counts["eval"][0],
        "eval_answer_tokens": counts["eval"][1],
        "max_tokens": max_tokens,
        "config": config.__dict__,
        "precision": "bfloat16 autocast" if config.autocast_bf16 else "float32",
        "stage_seconds": timings.seconds,
        **result,
    }
    with open(os.path.join(out_dir, "recipe.json"), "w") as f:
        json.dump(recipe, f, indent=2)
    return recipe


def trainable_methods() -> list[str]:
    return [m.name for m in draft_methods() if m.trainable]


class _StageTimes:
    """Wall seconds per stage, summed over every run that shares a work dir (kept in
    `path`), so a run stopped and resumed still reports what the whole head cost."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.seconds: dict[str, int] = {}
        if os.path.isfile(path):
            with open(path) as f:
                self.seconds = json.load(f)

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        started = time.time()
        try:
            yield
        finally:
            spent = round(time.time() - started)
            self.seconds[name] = self.seconds.get(name, 0) + spent
            with open(self.path, "w") as f:
                json.dump(self.seconds, f)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="cluster train-draft", description=__doc__)
    parser.add_argument(
        "--method",
        default="eagle3",
        choices=trainable_methods(),
        help="a draft method with a trainer: eagle3 (default), eagle (EAGLE-1), mtp "
        "(DeepSeek-style MTP, one module)",
    )
    parser.add_argument("--target", default=None, help="HF folder (default: the embedded SmolLM2)")
    parser.add_argument("--out", required=True, help="where the head is written")
    parser.add_argument("--work-dir", default=None, help="cache for answers and features")
    parser.add_argument(
        "--answers-dir",
        default=None,
        help="the answer stores (default: WORK_DIR/answers; the answers of the default "
        "model are committed under data/answers/smollm2-135m-instruct)",
    )
    parser.add_argument(
        "--dataset",
        default=None,
        help="chats to train on, JSON lines ({'messages': [...]} per line; the target writes "
        "the answers), instead of the built-in prompts; use its own --work-dir",
    )
    parser.add_argument("--max-tokens", type=int, default=128, help="answer length per prompt")
    parser.add_argument(
        "--num-prompts", type=int, default=None, help="use only the first N train prompts"
    )
    parser.add_argument("--num-eval-prompts", type=int, default=256)
    parser.add_argument(
        "--data-only",
        action="store_true",
        help="stop after answering and caching features (resumable: run it again later)",
    )
    parser.add_argument(
        "--follow-up-fraction",
        type=float,
        default=0.2,
        help="share of answered chats that get a second turn (multi-turn data)",
    )
    parser.add_argument("--epochs", type=int, default=TrainConfig.epochs)
    parser.add_argument("--lr", type=float, default=TrainConfig.lr)
    parser.add_argument(
        "--draft-vocab-size",
        type=int,
        default=TrainConfig.draft_vocab_size,
        help="EAGLE-3 only",
    )
    parser.add_argument(
        "--batch-tokens",
        type=int,
        default=TrainConfig.batch_tokens,
        help="padded tokens per batch",
    )
    parser.add_argument("--ttt-steps", type=int, default=TrainConfig.ttt_steps)
    parser.add_argument(
        "--eval-every-tokens",
        type=int,
        default=0,
        help="also measure held-out accuracy every N trained answer tokens (a data curve)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="EAGLE-3: compile the training step's forward (about 1.25x on this CPU)",
    )
    parser.add_argument(
        "--freeze-lm-head",
        action="store_true",
        help="EAGLE-3: keep the LM head rows copied from the target",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue the stopped training run whose checkpoint is in --work-dir",
    )
    parser.add_argument(
        "--precision",
        default=TrainConfig.precision,
        choices=("auto", "bfloat16", "float32"),
        help="auto: bfloat16 autocast (float32 master weights) where the device has "
        "bfloat16 matrix instructions, else float32",
    )
    parser.add_argument(
        "--checkpoint-every", type=int, default=TrainConfig.checkpoint_every, help="steps"
    )
    parser.add_argument(
        "--device", default="auto", help="where the head trains: auto (CUDA if any), cpu, cuda"
    )
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.target is None:
        from cluster.models.default_model import ensure_default_model

        args.target = ensure_default_model()
    work_dir = args.work_dir or os.path.join(args.out, "work")
    config = TrainConfig(
        draft_vocab_size=args.draft_vocab_size,
        ttt_steps=args.ttt_steps,
        epochs=args.epochs,
        lr=args.lr,
        batch_tokens=args.batch_tokens,
        seed=args.seed,
        device=args.device,
        freeze_lm_head=args.freeze_lm_head,
        compile=args.compile,
        eval_every_tokens=args.eval_every_tokens,
        precision=args.precision,
        checkpoint_every=args.checkpoint_every,
    )
    print(
        json.dumps(
            train_draft(
                args.target,
                args.out,
                work_dir,
                args.max_tokens,
                args.num_prompts,
                config,
                args.method,
                args.answers_dir,
                args.num_eval_prompts,
                args.follow_up_fraction,
                data_only=args.data_only,
                resume=args.resume,
                dataset=args.dataset,
            ),
            indent=2,
        )
    )
