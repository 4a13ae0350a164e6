"""Speedup of speculative decoding against k (1..6) and batch size (1, 4, 16), per draft
method, with the adaptive controller alongside; writes a markdown table and PNG plots.

Every configuration runs greedy on held-out chat prompts (never seen in training) in the
same process as its baseline (speculation off, same engine). Methods: the shipped
trained EAGLE-3 head, n-gram, and EAGLE-1 / MTP heads (random unless `--eagle-head` /
`--mtp-head` give trained ones: random heads measure the cost of an always-rejected
draft). The table also checks the measured mean acceptance length against
(1 - a^(k+1)) / (1 - a) from the measured per-token acceptance a.

    pip install matplotlib
    python benchmarks/spec_sweep.py [--out benchmarks/results] [--ks 1 2 3 4 5 6]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from random_heads import write_all

from cluster import LLM, SamplingParams
from cluster.config.speculative import builtin_head_path
from cluster.models.default_model import ensure_default_model
from cluster.train.prompts import build_prompts

warnings.filterwarnings("ignore")


def run(llm: LLM, prompts: list[list[int]], new_tokens: int) -> tuple[float, dict]:
    """(tokens/s, metric deltas) of one greedy batch."""
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    before = llm.get_metrics()
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tps = len(prompts) * new_tokens / (time.perf_counter() - start)
    after = llm.get_metrics()
    keys = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    return tps, {k: after.get(k, 0) - before.get(k, 0) for k in keys}


def heldout_chats(llm: LLM, n: int) -> list[list[int]]:
    """Token ids of the first `n` held-out chats in the chat template."""
    tokenizer = llm.get_tokenizer()
    return [
        tokenizer.apply_chat_template(
            list(chat), add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for chat in build_prompts()[1][:n]
    ]


def row(method: str, k: int | str, batch: int, tps: float, base: float, d: dict) -> dict:
    rate = d["num_accepted_tokens"] / d["num_draft_tokens"] if d["num_draft_tokens"] else 0.0
    mal = 1 + d["num_accepted_tokens"] / d["num_drafts"] if d["num_drafts"] else 1.0
    predicted = None  # k varies step to step under the adaptive controller
    if isinstance(k, int):
        predicted = (1 - rate ** (k + 1)) / (1 - rate) if rate < 1 else k + 1
    return dict(
        method=method, k=k, batch=batch, tok_s=tps, off_tok_s=base, speedup=tps / base,
        acceptance=rate, mean_acceptance_length=mal, predicted_length=predicted,
    )  # fmt: skip


def plot(rows: list[dict], batches: list[int], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 4), sharey=True)
    for ax, batch in zip(axes, batches, strict=True):
        for method in dict.fromkeys(r["method"] for r in rows):
            pts = [r for r in rows if r["method"] == method and r["batch"] == batch]
            fixed = [r for r in pts if isinstance(r["k"], int)]
            (line,) = ax.plot([r["k"] for r in fixed], [r["speedup"] for r in fixed], "o-")
            line.set_label(method)
            for r in pts:
                if not isinstance(r["k"], int):  # adaptive: a horizontal dashed line
                    ax.axhline(r["speedup"], color=line.get_color(), ls="--", lw=1)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set(title=f"batch {batch}", xlabel="k (drafts per step)")
    axes[0].set_ylabel("speedup over speculation off")
    axes[-1].legend(fontsize=8, title="dashed: adaptive")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "speedup_vs_k.png"), dpi=110)

    fig, ax = plt.subplots(figsize=(5, 4))
    for method in dict.fromkeys(r["method"] for r in rows):
        pts = [r for r in rows if r["method"] == method and r["batch"] == batches[0]]
        pts = [r for r in pts if isinstance(r["k"], int)]
        ax.plot([r["k"] for r in pts], [r["mean_acceptance_length"] for r in pts], "o-",
                label=f"{method} measured")  # fmt: skip
        ax.plot([r["k"] for r in pts], [r["predicted_length"] for r in pts], "x:",
                label=f"{method} (1-a^(k+1))/(1-a)")  # fmt: skip
    ax.set(xlabel="k", ylabel="mean acceptance length", title=f"batch {batches[0]}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "acceptance_length_vs_k.png"), dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--eagle-head", default=None)
    parser.add_argument("--mtp-head", default=None)
    parser.add_argument("--methods", nargs="+", default=None)
    parser.add_argument(
        "--adaptive-warmup",
        type=int,
        default=3,
        help="batches an adaptive engine serves before it is measured",
    )
    parser.add_argument(
        "--adaptive-only",
        action="store_true",
        help="rerun only the adaptive rows, keeping the fixed-k rows of --out/spec_sweep.json",
    )
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)

    path = ensure_default_model()
    random_heads = write_all(tempfile.mkdtemp(prefix="random-heads-"), path, seed=0)
    specs = {
        "eagle3 (trained)": {"method": "eagle3", "model": builtin_head_path("smollm2-eagle3")},
        "ngram": random_heads["ngram"],
        "eagle" + (" (trained)" if args.eagle_head else " (random)"): (
            {"method": "eagle", "model": args.eagle_head} if args.eagle_head
            else random_heads["eagle"]
        ),
        "mtp" + (" (trained)" if args.mtp_head else " (random)"): (
            {"method": "mtp", "model": args.mtp_head} if args.mtp_head
            else random_heads["mtp_deepseek"]
        ),
    }  # fmt: skip
    methods = [m for m in specs if args.methods is None or m.split()[0] in args.methods]
    engine = dict(dtype="float32", max_model_len=512, max_num_seqs=max(args.batches))
    with LLM(path, **engine) as llm:
        chats = heldout_chats(llm, max(args.batches))
        batches = {b: chats[:b] for b in args.batches}
        run(llm, batches[args.batches[0]], 4)  # warm-up
        baseline = {b: run(llm, p, args.new_tokens)[0] for b, p in batches.items()}
    rows = []
    if args.adaptive_only:
        with open(os.path.join(args.out, "spec_sweep.json")) as f:
            rows = [r for r in json.load(f) if r["k"] != "adaptive"]
    for method in methods:
        for k in ["adaptive"] if args.adaptive_only else [*args.ks, "adaptive"]:
            spec = {**specs[method], "num_speculative_tokens": max(args.ks) if k == "adaptive"
                    else k, "adaptive": k == "adaptive"}  # fmt: skip
            with LLM(path, speculative_config=spec, **engine) as llm:
                for b, prompts in batches.items():
                    if k == "adaptive":  # its steady state, as in a server that has run
                        for _ in range(args.adaptive_warmup):  # a while (exploration paid)
                            run(llm, prompts, args.new_tokens)
                    tps, deltas = run(llm, prompts, args.new_tokens)
                    rows.append(row(method, k, b, tps, baseline[b], deltas))
                    print(json.dumps(rows[-1]), flush=True)

    order = {m: i for i, m in enumerate(specs)}
    rows.sort(key=lambda r: (order.get(r["method"], 99), str(r["k"]), r["batch"]))
    lines = [
        f"# Speculative decoding sweep (SmolLM2-135M-Instruct, float32, greedy, "
        f"{args.new_tokens} new tokens, held-out prompts)\n",
        "| method | k | batch | spec tok/s | off tok/s | speedup | acceptance a "
        "| mean acceptance length | (1-a^(k+1))/(1-a) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines.insert(
        1,
        f"Adaptive rows: measured after {args.adaptive_warmup} warm-up batches of the same "
        "size (the controller's steady state; the first batches pay for its exploration)"
        + (
            ", in a later run (`--adaptive-only`) with its own baseline"
            if args.adaptive_only
            else ""
        )
        + ".\n",
    )
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['k']} | {r['batch']} | {r['tok_s']:.1f} | {r['off_tok_s']:.1f} "
            f"| {r['speedup']:.2f} | {r['acceptance']:.2f} | {r['mean_acceptance_length']:.2f} "
            + (f"| {r['predicted_length']:.2f} |" if r["predicted_length"] else "| n/a |")
        )
    with open(os.path.join(args.out, "spec_sweep.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(args.out, "spec_sweep.json"), "w") as f:
        json.dump(rows, f, indent=1)
    plot(rows, args.batches, args.out)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
