"""The `cluster` command line."""

from __future__ import annotations

import argparse


def _convert(args: argparse.Namespace) -> None:
    from cluster.models.default_model import convert_gguf, ensure_default_model

    if args.gguf:
        if not args.out:
            raise SystemExit("--out is required with --gguf")
        print(convert_gguf(args.gguf, args.out))
    else:
        print(ensure_default_model(args.out))


def _demo(args: argparse.Namespace) -> None:
    from cluster.demo import run_demo

    run_demo(max_new_tokens=args.max_tokens, prompts=args.prompt or None)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="cluster", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    convert = sub.add_parser(
        "convert", help="turn a GGUF file (default: the embedded SmolLM2) into an HF folder"
    )
    convert.add_argument(
        "--gguf", help="a Llama-architecture GGUF file (default: the embedded model)"
    )
    convert.add_argument("--out", help="output folder (default: the cache directory)")
    convert.set_defaults(func=_convert)

    demo = sub.add_parser("demo", help="answer a few chat prompts with the embedded default model")
    demo.add_argument("--max-tokens", type=int, default=48)
    demo.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    demo.set_defaults(func=_demo)

    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
