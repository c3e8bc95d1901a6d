"""``deepinfer serve [MODEL]``: the HTTP server's command line (every LLM option as a flag, plus the server's).

Engine flags are generated from EngineConfig's fields, so a new engine setting is a new flag; a flag not given
leaves the recipe's value (the recipe's [engine] table, else EngineConfig's default).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import attrs

log = logging.getLogger(__name__)

# Flags the common model group (cli._model_args) already defines.
_COMMON = {"dtype", "max_model_len", "device"}


def _engine_flag_type(field):
    t = field.type if not isinstance(field.type, str) else field.type
    text = str(t)
    if "bool" in text:
        return "bool"
    if "list" in text:
        return "list"
    if "dict" in text:
        return "json"
    if "float" in text:
        return float
    if "int" in text:
        return int
    return str


def add_engine_flags(p: argparse.ArgumentParser) -> list:
    """One flag per EngineConfig field (--block-size, --max-num-seqs, --enable-prefix-caching/--no-..., ...);
    returns the field names."""
    from ..core.config import EngineConfig

    g = p.add_argument_group("engine (EngineConfig; default: the recipe's, else EngineConfig's)")
    names = []
    for f in attrs.fields(EngineConfig):
        if f.name in _COMMON:
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = _engine_flag_type(f)
        if kind == "bool":
            g.add_argument(flag, dest=f"engine_{f.name}", action=argparse.BooleanOptionalAction, default=None)
        elif kind == "list":
            g.add_argument(flag, dest=f"engine_{f.name}", type=int, nargs="+", default=None, metavar="N")
        elif kind == "json":
            g.add_argument(flag, dest=f"engine_{f.name}", type=json.loads, default=None, metavar="JSON")
        else:
            g.add_argument(flag, dest=f"engine_{f.name}", type=kind, default=None,
                           metavar={int: "N", float: "X"}.get(kind, "VALUE"))
        names.append(f.name)
    g.add_argument("--device", default=None, help="torch device (default: the backend's)")
    g.add_argument("--backend", default=None, help="backend name (default: detected; see `deepinfer plugins`)")
    g.add_argument("--tokenizer", default=None, metavar="DIR", help="tokenizer directory (default: the model's)")
    g.add_argument("--load-format", default="auto", help="auto | safetensors | dummy (default auto)")
    g.add_argument("--hf-overrides", type=json.loads, default=None, metavar="JSON",
                   help="config.json keys to override, as a JSON object")
    return names


def add_serve_parser(sub, model_args) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="serve a model over HTTP (OpenAI and Anthropic APIs)",
                       description="Serve a model over HTTP: /v1/completions, /v1/chat/completions, /v1/responses, "
                                   "/v1/messages (Anthropic), /v1/messages/count_tokens, /v1/models, /tokenize, "
                                   "/detokenize, /health, /version, /metrics. See the README, 'Serving over HTTP'.")
    p.add_argument("model_pos", nargs="?", default=None, metavar="MODEL",
                   help="checkpoint directory or Hugging Face id (default: the bundled demo model)")
    model_args(p)
    add_engine_flags(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    g.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0: any free port)")
    g.add_argument("--api-key", default=None,
                   help="require this key on the API routes (Authorization: Bearer KEY or x-api-key: KEY); "
                        "default: $DEEPINFER_API_KEY, else none")
    g.add_argument("--served-model-name", default=None, help="the model name clients send (default: the model "
                                                             "argument, or 'demo')")
    g.add_argument("--max-body-bytes", type=int, default=4 * 2**20, help="largest request body (default 4 MiB)")
    g.add_argument("--max-tokens-limit", type=int, default=None,
                   help="largest max_tokens a request may ask (default: the context length)")
    g.add_argument("--tool-call-parser", default=None,
                   help="tool-call parser (qwen3, hermes, deepseek_v3, llama3_json, demo, none, or a plugin's; "
                        "default: the model family's)")
    g.add_argument("--reasoning-parser", default=None,
                   help="reasoning parser (qwen3, deepseek_r1, demo, none, or a plugin's; default: the family's)")
    g.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                   help="a jinja2 chat template (a file, or the template text) overriding the checkpoint's")
    g.add_argument("--disable-any-whitespace", action="store_true",
                   help="JSON from response_format is written with fixed separators and no other whitespace (small "
                        "models otherwise tend to pad JSON with newlines); forced tool calls always are")
    g.add_argument("--stream-interval", type=int, default=1, metavar="N",
                   help="send a stream's new tokens every N tokens (its first token and its end at once); larger "
                        "values cost the server less per token at the price of burstier streams (default 1)")
    g.add_argument("--gil-switch-interval", type=float, default=0.0005, metavar="S",
                   help="lower Python's GIL switch interval to S seconds (default 0.0005; 0 leaves it): the engine "
                        "thread then waits at most about S for the GIL a busy event loop holds")
    g.add_argument("--engine-process", choices=("auto", "on", "off"), default="auto", dest="serve_engine_process",
                   help="run the engine in a process of its own (on: the server's HTTP work never takes the GIL from "
                        "the engine loop; off: a thread of the server's process, where logits processors and "
                        "in-process plugins' objects can reach it); auto: on for CUDA, off on the CPU")
    g.add_argument("--timeout-graceful-shutdown", type=float, default=10.0, metavar="S",
                   help="on SIGINT/SIGTERM, let in-flight requests finish this long, then abort them (default 10)")
    g.add_argument("--log-level", default="warning", help="uvicorn's log level (default warning)")
    p.set_defaults(func=cmd_serve)
    return p


def cmd_serve(args) -> int:
    from ..cli import UsageError, _threads

    try:
        import fastapi  # noqa: F401  (the app is built on it)
        import uvicorn
    except ImportError as exc:  # pragma: no cover - they are dependencies of the package
        raise UsageError(f"deepinfer serve needs fastapi and uvicorn ({exc}); pip install fastapi uvicorn") from None
    if args.model_pos is not None and args.model is not None and args.model_pos != args.model:
        raise UsageError(f"give the model once: MODEL {args.model_pos!r} and --model {args.model!r} differ")
    model = args.model_pos or args.model
    for name in ("max_body_bytes", "max_tokens_limit", "stream_interval"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise UsageError(f"--{name.replace('_', '-')}={v} is invalid: must be >= 1")
    if not 0 <= args.gil_switch_interval <= 1:
        raise UsageError(f"--gil-switch-interval={args.gil_switch_interval} is invalid: must be seconds in [0, 1]")
    template = args.chat_template
    if template is not None and os.path.exists(template):
        with open(template, encoding="utf-8") as f:
            template = f.read()
    engine_kw = {k.removeprefix("engine_"): v for k, v in vars(args).items()
                 if k.startswith("engine_") and v is not None}
    from ..core.llm import LLM
    from ..models.loader import CheckpointError
    from .async_llm import AsyncLLM
    from .server import ServerSettings, build_app

    llm_kw = dict(model=model, recipe=args.recipe, dtype=args.dtype, max_model_len=args.max_model_len,
                  threads=_threads(args), device=args.device, backend=args.backend, tokenizer=args.tokenizer,
                  load_format=args.load_format, hf_overrides=args.hf_overrides, **engine_kw)
    common = dict(stream_interval=args.stream_interval, gil_switch_interval=args.gil_switch_interval or None)
    from .engine_process import wanted

    if wanted(args.serve_engine_process, args.device):  # (dest not engine_*: those are EngineConfig's flags)
        try:
            engine = AsyncLLM(engine_process=True, **common, **llm_kw)
        except ValueError as exc:  # the engine process could not build the LLM (its message names why)
            raise UsageError(str(exc)) from None
    else:
        try:
            llm = LLM(**llm_kw)
        except CheckpointError as exc:
            raise UsageError(str(exc)) from None
        engine = AsyncLLM(llm=llm, **common)
    llm = engine.llm
    name = args.served_model_name or model or "demo"
    settings = ServerSettings(model_name=name, api_key=args.api_key or os.environ.get("DEEPINFER_API_KEY") or None,
                              max_body_bytes=args.max_body_bytes, max_tokens_limit=args.max_tokens_limit,
                              tool_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                              chat_template=template, json_compact=args.disable_any_whitespace,
                              model_aliases=tuple(x for x in (model, str(llm.model_path))
                                                                          if x))
    app = build_app(engine, settings)

    @app.on_event("shutdown")
    def _stop_engine():  # after uvicorn has let in-flight requests finish (--timeout-graceful-shutdown)
        engine.shutdown()
        print("deepinfer serve: stopped", file=sys.stderr, flush=True)

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.timeout_graceful_shutdown, access_log=False)
    server = uvicorn.Server(config)
    _announce(server, args, name)
    server.run()
    engine.shutdown()
    return 0


def _announce(server, args, name) -> None:
    """Print the address once the socket is bound (tests and scripts read this line; --port 0 picks one)."""
    orig = server.startup

    async def startup(sockets=None):
        await orig(sockets=sockets)
        for s in server.servers:
            for sock in s.sockets:
                host, port = sock.getsockname()[:2]
                print(f"deepinfer serve: {name!r} on http://{host}:{port} (ready)", file=sys.stderr, flush=True)
    server.startup = startup
