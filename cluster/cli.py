"""The `cluster` command line."""

from __future__ import annotations

import argparse
import json
import os


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

    run_demo(max_new_tokens=args.max_tokens, prompts=args.prompt or None, verbose=args.verbose)


def _is_manifest(target: str) -> bool:
    return target.endswith((".yaml", ".yml", ".json")) and os.path.isfile(target)


def _serve(args: argparse.Namespace) -> None:
    from cluster.serve.manifest import ManifestError, deployment_plan, validate_manifest
    from cluster.serve.model_command import manifest_for_model, manifest_yaml, model_flags_given

    try:
        if _is_manifest(args.target):
            given = model_flags_given(args)
            if given:
                raise ManifestError(
                    f"{', '.join(given)} apply to `cluster serve MODEL`; a manifest holds "
                    "these settings (edit it, or print one with MODEL --print-manifest)"
                )
            manifest, model_checked = validate_manifest(args.target)
        else:  # a model folder or Hugging Face id, with vLLM's flags
            if args.print_manifest:
                print(manifest_yaml(args.target, args), end="")
                return
            manifest = manifest_for_model(args.target, args)
            model_checked = manifest.args.model_is_present()
    except ManifestError as e:
        raise SystemExit(f"error: {e}") from None
    if args.dry_run:
        plan = {**deployment_plan(manifest), "model_checked": model_checked}
        print(json.dumps(plan, indent=2, default=str))
        return
    from cluster.serve.launch import serve_forever

    try:
        serve_forever(manifest, args.address, args.host, args.port)
    except ManifestError as e:
        raise SystemExit(f"error: {e}") from None


def _download(args: argparse.Namespace) -> None:
    from cluster.config.hub import resolve_model_path

    try:
        print(resolve_model_path(args.model, args.revision, download=True))
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None


def _generate(args: argparse.Namespace) -> None:
    from cluster.generate_cli import run_generate

    run_generate(args)


def _chat(args: argparse.Namespace) -> None:
    from cluster.generate_cli import run_chat

    run_chat(args)


def _add_source_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--manifest", help="run the engine this manifest describes, here")
    parser.add_argument("--url", help="or ask a running server (`cluster serve`) instead")
    parser.add_argument("--api-key", help="the server's API key, if it has one")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)


def main(argv: list[str] | None = None) -> None:
    import sys

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["train-draft"]:  # its own parser: many training options
        from cluster.train.pipeline import main as train_main

        train_main(argv[1:])
        return
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
    demo.add_argument("--max-tokens", type=int, default=64)
    demo.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    demo.add_argument(
        "--verbose", action="store_true", help="show Ray's and Serve's logs and the actors' output"
    )
    demo.set_defaults(func=_demo)

    sub.add_parser(
        "train-draft",
        help="train an EAGLE-3, EAGLE-1 or MTP head for a target (--help for options)",
    )

    serve = sub.add_parser(
        "serve",
        help="deploy a manifest, or a model with vLLM's flags, on Ray Serve until Ctrl-C",
    )
    serve.add_argument(
        "target",
        help="a Serve config file (e.g. cluster/manifests/default.yaml), or a model: a local folder "
        "or a Hugging Face id, served like `vllm serve MODEL` (port 8000 unless --port)",
    )
    serve.add_argument(
        "--address",
        help="join this Ray cluster ('auto': the one running here) instead of starting a "
        "new local Ray; on exit only this application is removed from it",
    )
    serve.add_argument("--host", help="HTTP host (default: the manifest's, else 127.0.0.1)")
    serve.add_argument(
        "--port", type=int, help="HTTP port (default: the manifest's, else free; a model: 8000)"
    )
    serve.add_argument(
        "--dry-run", action="store_true", help="validate and print the deployment plan only"
    )
    from cluster.serve.model_command import add_model_flags

    add_model_flags(serve.add_argument_group("serving a model (vLLM's flags)"))
    serve.set_defaults(func=_serve)

    download = sub.add_parser(
        "download", help="fetch a Hugging Face model into the Hub cache (for air-gapped hosts)"
    )
    download.add_argument("model", help="a Hugging Face id, e.g. Qwen/Qwen3-0.6B")
    download.add_argument("--revision", help="branch, tag or commit")
    download.set_defaults(func=_download)

    plan = sub.add_parser(
        "plan", help="will a model and layout fit? (reads config.json only, loads no weight)"
    )
    from cluster.plan_cli import add_plan_arguments, run_plan

    add_plan_arguments(plan)
    plan.set_defaults(func=run_plan)

    generate = sub.add_parser("generate", help="complete prompts (offline or from a server)")
    generate.add_argument("prompts", nargs="+", help="one or more prompts")
    _add_source_args(generate)
    generate.set_defaults(func=_generate)

    chat = sub.add_parser("chat", help="chat on stdin, one turn per line (/exit to stop)")
    _add_source_args(chat)
    chat.set_defaults(func=_chat)

    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
