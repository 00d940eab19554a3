"""The ``astrai`` command: stream text from a model, list plugins, and what plugins add (``serve``).

``astrai chat "Hello"`` applies the model's chat template; ``astrai generate
"Once upon a time"`` continues raw text; without ``--model`` both use the default
model (SmolLM2-135M-Instruct). ``astrai plugins`` lists every installed plugin of
every entry-point group. Hook plugins add subcommands (``astrai_register_commands``:
astrai-server adds ``astrai serve``; core never imports it) and options to the
commands that run an engine (``astrai_add_options``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import logging
import sys
from typing import Any

from astrai.errors import AstraiError
from astrai.hooks import PluginManager
from astrai.plugins import load_plugins

_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def parse_key_value(text: str) -> tuple[str, Any]:
    """``"min_p=0.05"`` -> ``("min_p", 0.05)``: the value as an int, a float, or else the string."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    for kind in (int, float):
        with contextlib.suppress(ValueError):
            return key.strip(), kind(raw)
    return key.strip(), raw


class PluginOptions:
    """The argument group that hook plugins fill through ``astrai_add_options``.

    Offers argparse's ``add_argument``. Flags default to "absent" so that a config
    file can sit under them (``astrai serve``); the plugin's own ``default`` is kept
    in :attr:`defaults`, by ``dest``.
    """

    def __init__(self, parser: argparse.ArgumentParser, pm: PluginManager) -> None:
        self._group = parser.add_argument_group("plugin options", "added by installed hook plugins")
        self.defaults: dict[str, Any] = {}
        pm.notify("astrai_add_options", parser=self)

    def add_argument(self, *flags: str, **kwargs: Any) -> argparse.Action:
        """As ``argparse.ArgumentParser.add_argument``."""
        default = kwargs.pop("default", None)
        kwargs["help"] = f"{kwargs.get('help') or ''} (default: {default})".lstrip()
        action = self._group.add_argument(*flags, default=argparse.SUPPRESS, **kwargs)
        self.defaults[action.dest] = default
        return action

    def values(self, args: argparse.Namespace) -> dict[str, Any]:
        """Every option's value: the flag when given, else the plugin's default."""
        return {dest: getattr(args, dest, default) for dest, default in self.defaults.items()}


def _add_model_args(p: argparse.ArgumentParser, pm: PluginManager) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="model name, .gguf file, HF folder or Hub id (org/name, org/name-GGUF:QUANT) "
        "(default: smollm2-135m)",
    )
    p.add_argument("--revision", default=None, help="branch, tag or commit of a Hub id (default: main)")
    p.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    p.add_argument(
        "--dtype", choices=sorted(_DTYPES), default=None, help="default: bf16 where native, else fp32"
    )
    p.add_argument(
        "--weights",
        choices=["auto", "gguf", "dense"],
        default="auto",
        help=(
            "a GGUF file's quantized weights: kept (gguf), dequantized (dense), "
            "or auto (gguf where a kernel runs in --dtype)"
        ),
    )
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument(
        "--sampling",
        action="append",
        type=parse_key_value,
        default=[],
        metavar="KEY=VALUE",
        help="parameter of a sampling plugin for every request, e.g. min_p=0.05 (repeatable)",
    )
    p.set_defaults(run=_run, plugin_options=PluginOptions(p, pm))


def build_parser(pm: PluginManager | None = None) -> argparse.ArgumentParser:
    """The ``astrai`` parser; ``pm`` (default: discovered) supplies the hook plugins' commands and options.

    Every subcommand sets ``run``, the function of the parsed args that ``main`` returns.
    """
    pm = PluginManager.discover() if pm is None else pm
    parser = argparse.ArgumentParser(prog="astrai", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    parser.set_defaults(plugins=pm)
    sub = parser.add_subparsers(dest="command", required=True)
    chat = sub.add_parser("chat", help="stream a chat completion (the model's chat template)")
    chat.add_argument("message", help="the user message")
    chat.add_argument("--system", default=None, help="system prompt")
    chat.add_argument(
        "--chat-template",
        default=None,
        help="chat template over the model's: a Jinja file, or an inline Jinja string (default: the model's)",
    )
    _add_model_args(chat, pm)
    gen = sub.add_parser("generate", help="stream a raw text continuation")
    gen.add_argument("prompt")
    _add_model_args(gen, pm)
    plugins = sub.add_parser("plugins", help="list installed plugins: group, name, distribution, status")
    plugins.add_argument("--json", action="store_true", help="one JSON array instead of a table")
    plugins.set_defaults(run=_print_plugins)
    pm.notify("astrai_register_commands", subparsers=sub, plugins=pm)  # a failing plugin is logged, not fatal
    return parser


def plugin_rows() -> list[dict[str, Any]]:
    """One row per installed entry point of every astrai group, loaded to tell whether it works.

    Keys: group, name, target, distribution, version, loaded (bool), error (the
    failure, or None), can_run (attention backends: ``is_available()``; else None), reason.
    """
    rows = []
    from astrai.groups import ATTENTION_BACKENDS, VALIDATORS  # the subsystems: only when listing

    for group, check in VALIDATORS.items():
        loaded = load_plugins(group, check)
        for ep in sorted(importlib.metadata.entry_points(group=group), key=lambda e: e.name):
            failure = loaded.failures.get(ep.name)
            row = {
                "group": group,
                "name": ep.name,
                "target": ep.value,
                "distribution": ep.dist.metadata["Name"] if ep.dist else "unknown",
                "version": ep.dist.version if ep.dist else "unknown",
                "loaded": failure is None,
                "error": None if failure is None else f"{type(failure.error).__name__}: {failure.error}",
                "can_run": None,
                "reason": "",
            }
            if group == ATTENTION_BACKENDS and failure is None:
                try:
                    row["can_run"], row["reason"] = loaded.classes[ep.name].is_available()
                except Exception as err:  # the contract says it must not raise; report, don't crash
                    row["can_run"], row["reason"] = (
                        False,
                        f"is_available() raised {type(err).__name__}: {err}",
                    )
            rows.append(row)
    return rows


def _print_plugins(args: argparse.Namespace) -> int:
    rows = plugin_rows()
    if args.json:
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
        return 0
    table = [("GROUP", "NAME", "DISTRIBUTION", "VERSION", "LOADED", "CAN RUN")]
    for r in rows:
        can_run = "-" if r["can_run"] is None else "yes" if r["can_run"] else f"no: {r['reason']}"
        table.append(
            (r["group"], r["name"], r["distribution"], r["version"], "yes" if r["loaded"] else "no", can_run)
        )
    widths = [max(len(row[i]) for row in table) for i in range(5)]
    for i, row in enumerate(table):
        sys.stdout.write("  ".join(row[c].ljust(widths[c]) for c in range(5)) + "  " + row[5] + "\n")
        if i and rows[i - 1]["error"]:
            sys.stdout.write(f"    error: {rows[i - 1]['error']}\n")
    return 0


def _run(args: argparse.Namespace) -> int:
    import torch

    from astrai.engine import EngineConfig, InferenceEngine
    from astrai.model.resolve import local_model

    dtype = getattr(torch, args.dtype) if args.dtype else None
    template = getattr(args, "chat_template", None)
    if template is not None:  # a missing file or a syntax error: exit 2 before the model loads
        from astrai.model.chat_template import load_chat_template

        load_chat_template(template)
    config = EngineConfig(
        sampling=dict(args.sampling),
        plugin_options=args.plugin_options.values(args),
        chat_template=template,
    )
    model = local_model(args.model, args.revision)  # a Hub id: its files, from the cache or downloaded
    engine = InferenceEngine.from_model(
        model, dtype=dtype, device=args.device, config=config, plugins=args.plugins, weights=args.weights
    )
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
    return 0


def main(argv: list[str] | None = None, pm: PluginManager | None = None) -> int:
    """Run the ``astrai`` command; returns its exit status. ``pm``: as for :func:`build_parser`."""
    # configured before the parser loads the hook plugins, so that their load failures read as warnings
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    parser = build_parser(pm)
    args = parser.parse_args(argv)
    if args.verbose:
        logging.getLogger().setLevel(logging.INFO)
    run = getattr(args, "run", None)
    if run is None:  # its plugin raised after add_parser (logged while building the parser)
        parser.error(f"command {args.command!r} is incomplete: the plugin adding it failed (see the log)")
    try:
        return run(args)
    except AstraiError as exc:
        print(f"astrai: error: {exc}", file=sys.stderr)  # noqa: T201 - the CLI's own output
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
