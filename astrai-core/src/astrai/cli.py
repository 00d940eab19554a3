"""The ``astrai`` command: stream text from a model on the command line.

``astrai chat "Hello"`` applies the model's chat template; ``astrai generate
"Once upon a time"`` continues raw text. Without ``--model`` both use the
default model (SmolLM2-135M-Instruct).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys

from astrai.errors import AstraiError

_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model name, .gguf file or HF folder (default: smollm2-135m)")
    p.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default=None, help="default: bf16 where native, else fp32")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="astrai", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    chat = sub.add_parser("chat", help="stream a chat completion (the model's chat template)")
    chat.add_argument("message", help="the user message")
    chat.add_argument("--system", default=None, help="system prompt")
    _add_model_args(chat)
    gen = sub.add_parser("generate", help="stream a raw text continuation")
    gen.add_argument("prompt")
    _add_model_args(gen)
    # `astrai serve` exists when astrai-server is installed; core never imports it otherwise.
    with contextlib.suppress(ImportError):
        from astrai_server.cli import add_serve_command

        add_serve_command(sub)
    return parser


def _run(args: argparse.Namespace) -> None:
    import torch

    from astrai.engine import InferenceEngine

    dtype = getattr(torch, args.dtype) if args.dtype else None
    engine = InferenceEngine.from_model(args.model, dtype=dtype, device=args.device)
    sampling = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
        "stop": args.stop,
    }
    try:
        if args.command == "chat":
            messages = [{"role": "system", "content": args.system}] if args.system else []
            messages.append({"role": "user", "content": args.message})
            pieces = engine.chat(messages, stream=True, **sampling)
        else:
            pieces = engine.generate(args.prompt, stream=True, **sampling)
        for piece in pieces:
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
    finally:
        engine.shutdown()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "serve", None):
        return args.serve(args)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        _run(args)
    except AstraiError as exc:
        print(f"astrai: error: {exc}", file=sys.stderr)  # noqa: T201 - the CLI's own output
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
