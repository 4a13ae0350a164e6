"""How many of the package's files a request passes through: from `LLM.generate` to the
target model's forward, and to the rejection kernel, in the order they are first entered
(a profile hook records every Python call; helpers such as the sampling parameters, the
block manager and the detokenizer count), and the files on the call stack when each is
entered (the way down from `LLM.generate`). Also the package's line count.

    CLUSTER_COMPILE=off python benchmarks/request_path.py [--list]

Runs the embedded SmolLM2 with n-gram speculation on a prompt that repeats itself, so
the drafts reach the rejection sampler within a few steps.
"""

from __future__ import annotations

import argparse
import os
import sys

import cluster
from cluster import LLM, SamplingParams

ROOT = os.path.dirname(cluster.__file__)
# (file, function) first entered: the target model's forward; the CPU rejection kernel
# (by name only, as the file that holds it has moved).
FORWARD = ("llama.py", "forward")
KERNEL = (None, "rejection_sample_ref")


def trace_files(llm: LLM, prompt: str) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """({"forward": files entered before the target forward, "kernel": ... before the
    kernel}, the same keys: the package files on the call stack there, outermost first)."""
    order: list[str] = []
    marks: dict[str, list[str]] = {}
    stacks: dict[str, list[str]] = {}

    def on_stack(frame) -> list[str]:
        files: list[str] = []
        while frame is not None:
            path = frame.f_code.co_filename
            name = os.path.relpath(path, os.path.dirname(ROOT))
            if path.startswith(ROOT) and name not in files:
                files.append(name)
            frame = frame.f_back
        return files[::-1]

    def hook(frame, event, arg):
        if event != "call":
            return
        path = frame.f_code.co_filename
        if not path.startswith(ROOT):
            return
        name = os.path.relpath(path, os.path.dirname(ROOT))
        if name not in order:
            order.append(name)
        here = (os.path.basename(path), frame.f_code.co_name)
        for label, (file, function) in (("forward", FORWARD), ("kernel", KERNEL)):
            if here[1] == function and file in (None, here[0]) and label not in marks:
                marks[label] = list(order)
                stacks[label] = on_stack(frame)

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    sys.setprofile(hook)
    try:
        llm.generate(prompt, params, use_tqdm=False)
    finally:
        sys.setprofile(None)
    return marks, stacks


def package_lines() -> tuple[int, int]:
    """(Python files, lines) of the package."""
    files = lines = 0
    for folder, _, names in os.walk(ROOT):
        for name in names:
            if name.endswith(".py"):
                files += 1
                with open(os.path.join(folder, name)) as f:
                    lines += sum(1 for _ in f)
    return files, lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--list", action="store_true", help="print the files in order")
    args = parser.parse_args()
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    prompt = "one two three four one two three four one two three four one two"
    with LLM(speculative_config=spec, max_model_len=256, num_kv_blocks=64) as llm:
        llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
        marks, stacks = trace_files(llm, prompt)
    files, lines = package_lines()
    print("| from `LLM.generate` to | files entered | files on the call stack |")
    print("|---|---:|---:|")
    for label, what in (("forward", "the target forward"), ("kernel", "the rejection kernel")):
        entered = len(marks.get(label, [])) or "not reached"
        print(f"| {what} | {entered} | {len(stacks.get(label, [])) or 'not reached'} |")
    print(f"\npackage: {files} Python files, {lines} lines")
    if args.list:
        for label, names in stacks.items():
            print(f"\non the call stack at {label}:\n  " + "\n  ".join(names))
        for label, names in marks.items():
            print(f"\nentered before {label}:\n  " + "\n  ".join(names))


if __name__ == "__main__":
    main()
