"""bfloat16 linear layers on a CPU: our C kernel (`cluster/kernels/cpu_linear.c`) against
oneDNN's prepacked product, on SmolLM2's layer shapes, interleaved medians.

For each shape and row count: both products' times, the weight bytes read per second
(one pass over the weight; small weights stay in the caches between calls, so above the
memory's bandwidth), and whether the two agree bit for bit (they must wherever the
engine picks the C kernel: `packed_linear.reproduces_onednn`).

    python benchmarks/cpu_linear.py [--rows 1 2 4 16 64 256] [--repeats 40]
"""

from __future__ import annotations

import argparse
import platform
from functools import partial

import torch
from forward import interleaved_ms  # benchmarks/forward.py, beside this script

from cluster.kernels import cpu_linear, packed_linear

# SmolLM2-135M: qkv, o, gate+up, down, LM head
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 16, 64, 256])
    parser.add_argument("--repeats", type=int, default=40)
    args = parser.parse_args()
    if cpu_linear.load() is None or not packed_linear.cpu_can_pack_bf16():
        print("no AVX-512 BF16 or no oneDNN bfloat16 here: nothing to compare")
        return
    print(f"{cpu_model()}, {torch.get_num_threads()} threads\n")
    print(
        "| weight (out x in) | rows | C kernel (ms) | oneDNN (ms) | oneDNN / C | C GB/s | same bits |"
    )
    print("|---|---:|---:|---:|---:|---:|---|")
    gen = torch.Generator().manual_seed(0)
    for out_features, in_features in SHAPES:
        weight = (torch.randn(out_features, in_features, generator=gen) * 0.05).bfloat16()
        ours = cpu_linear.pack(weight)
        onednn = packed_linear.pack_weight(weight, kernel="onednn")
        for rows in args.rows:
            x = torch.randn(rows, in_features, generator=gen).bfloat16()
            # oneDNN runs a single row as a matrix-vector product: the engine pads to 2
            x_dnn = x if rows > 1 else torch.cat([x, x])
            c_fn = partial(cpu_linear.linear, x, ours, None, out_features)
            dnn_fn = partial(packed_linear.packed_product, x_dnn, onednn, None, out_features)
            ms = interleaved_ms({"c": c_fn, "onednn": dnn_fn}, args.repeats)
            same = torch.equal(c_fn(), dnn_fn()[:rows])
            gbs = weight.numel() * 2 / ms["c"] / 1e6
            print(
                f"| {out_features} x {in_features} | {rows} | {ms['c']:.3f} | "
                f"{ms['onednn']:.3f} | {ms['onednn'] / ms['c']:.2f} | {gbs:.1f} | {same} |"
            )


if __name__ == "__main__":
    main()
