"""The ``deepinfer`` command: generate | chat | serve | plugins | pipeline | init-model | bench | check.

Exit status: 0 on success, 1 when a request failed (the others still print),
2 for a bad argument or value (``error: ...`` on stderr, no traceback), 130 on
Ctrl-C. Heavy imports (torch, the loader) happen inside the subcommands so
``deepinfer --help`` stays quick.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import sys
from typing import Optional, Sequence

EXIT_OK, EXIT_REQUEST_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class UsageError(ValueError):
    """A bad command-line value found after parsing; printed as ``error: ...`` with exit status 2."""


class _OwnRequestErrors(logging.Filter):
    """The commands report each failed request themselves (``error: prompt i: ...``), so the engine's warning
    about the same failure (``deepinfer: request %s failed...``) is dropped rather than printed twice."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("deepinfer: request %s failed")


_OWN_REQUEST_ERRORS = _OwnRequestErrors()


# --- argument groups shared by subcommands -------------------------------------------------------------------

RECIPE_HELP = "a built-in recipe (default, reference, throughput, latency, deterministic) or a .toml file"


def _model_args(p: argparse.ArgumentParser, recipe: str = "default",
                max_model_len: str = "the checkpoint's", parallel: bool = True) -> None:
    p.add_argument("--model", default=None,
                   help="checkpoint directory or Hugging Face id (default: the bundled demo model)")
    p.add_argument("--recipe", default=recipe, metavar="NAME|FILE",
                   help=f"{RECIPE_HELP} (default: {recipe}); `deepinfer pipeline --recipe X` shows what it chooses")
    p.add_argument("--dtype", default=None, help="auto | float32 | bfloat16 | float16 (default: the recipe's, else "
                                                 "auto: float32 on the CPU, the checkpoint's dtype on a GPU)")
    p.add_argument("--max-model-len", type=int, default=None, help=f"context length (default: {max_model_len})")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="CPU threads for torch (default: DEEPINFER_NUM_THREADS if set, else torch's own choice, "
                        "one per core); on a busy machine 1 or 2 is often much faster")
    if not parallel:  # serve adds a flag for every EngineConfig field, these among them
        return
    g = p.add_argument_group("parallel serving (README 'Parallel serving'; under torchrun every rank runs the command)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=None, metavar="T",
                   help="ranks (devices) the model is sharded over (default 1)")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=None, metavar="D", help="default 1 (only 1 yet)")
    g.add_argument("--enable-expert-parallel", action="store_true", default=None,
                   help="shard MoE experts over the ranks (needed for MoE models with -tp > 1)")
    g.add_argument("--expert-parallel-comm", choices=("alltoall", "allreduce"), default=None,
                   help="expert dispatch/combine (default alltoall)")


def parallel_kwargs(args) -> dict:
    """The parallel-serving flags that were given, as LLM keywords."""
    names = ("tensor_parallel_size", "data_parallel_size", "enable_expert_parallel", "expert_parallel_comm")
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def _threads(args) -> Optional[int]:
    """--threads, validated (None when not given)."""
    if args.threads is not None and args.threads < 1:
        raise UsageError(f"--threads={args.threads} is invalid: must be >= 1")
    return args.threads


# SamplingParams fields the flags set; None means "SamplingParams' own default".
_SAMPLING_FLAGS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "ignore_eos", "n",
                   "logprobs")


# Where a sampling flag's default comes from when it is not given: the checkpoint's generation_config.json
# (the keys LLM.generation_defaults reads), else SamplingParams' own default.
_CKPT_DEFAULT = "default: the checkpoint's generation_config.json, else {}"


def _sampling_args(p: argparse.ArgumentParser, n: bool = True, max_tokens: int = 16) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=None,
                   help=f"tokens to generate per completion (default {max_tokens})")
    g.add_argument("--temperature", type=float, default=None,
                   help="0 = greedy (" + _CKPT_DEFAULT.format("1.0") + ")")
    g.add_argument("--top-p", type=float, default=None,
                   help="nucleus sampling mass in (0, 1] (" + _CKPT_DEFAULT.format("1.0: off") + ")")
    g.add_argument("--top-k", type=int, default=None,
                   help="keep the k most likely tokens; 0 or -1: off (" + _CKPT_DEFAULT.format("off") + ")")
    g.add_argument("--min-p", type=float, default=None,
                   help="drop tokens below min_p x the top probability (" + _CKPT_DEFAULT.format("0: off") + ")")
    g.add_argument("--seed", type=int, default=None, help="per-request sampling seed (default: unseeded)")
    g.add_argument("--stop", action="append", default=None, metavar="S",
                   help="stop string (excluded from the output); repeat the flag for several: --stop a --stop b")
    g.add_argument("--ignore-eos", action="store_true", default=None, help="keep generating past EOS")
    if n:
        g.add_argument("--n", type=int, default=None, help="completions per prompt (default 1)")
        g.add_argument("--logprobs", type=int, default=None, metavar="N",
                       help="with --json: report the top-N logprobs of every generated token")
    g = p.add_argument_group("structured outputs (at most one; needs xgrammar: pip install 'deepinfer[structured]')")
    g.add_argument("--json-schema", default=None, metavar="FILE", help="the output is JSON valid under this schema")
    g.add_argument("--regex", default=None, help="the output matches this regular expression")
    g.add_argument("--choice", action="append", default=None, metavar="S",
                   help="the output is exactly one of the choices; one per flag: --choice yes --choice no")
    g.add_argument("--grammar", default=None, metavar="FILE", help="the output is a sentence of this EBNF grammar "
                                                                    "(xgrammar's EBNF, rule root)")
    g.add_argument("--disable-any-whitespace", action="store_true", default=False,
                   help="JSON with xgrammar's fixed separators and no other whitespace (small models otherwise "
                        "tend to pad JSON with newlines)")
    g.add_argument("--jump-forward", action="store_true", default=False,
                   help="append the text the grammar forces without model steps")


def _structured(args):
    """StructuredOutputsParams from --json-schema / --regex / --choice / --grammar, or None."""
    from .core.params import StructuredOutputsParams

    given = {k: getattr(args, k, None) for k in ("json_schema", "regex", "choice", "grammar")}
    given = {k: v for k, v in given.items() if v is not None}
    options = {k: True for k in ("disable_any_whitespace", "jump_forward") if getattr(args, k, False)}
    if not given:
        if options:
            raise UsageError("--" + next(iter(options)).replace("_", "-") + " needs one of --json-schema, --regex, "
                             "--choice, --grammar")
        return None
    if len(given) > 1:
        raise UsageError("give at most one of " + ", ".join("--" + k.replace("_", "-") for k in given))
    (flag, value), = given.items()
    if flag in ("json_schema", "grammar"):
        try:
            with open(value, encoding="utf-8") as f:
                value = f.read()
        except OSError as exc:
            raise UsageError(f"--{flag.replace('_', '-')} {value}: cannot read it ({exc.strerror})") from None
    return StructuredOutputsParams(**{"json" if flag == "json_schema" else flag: value}, **options)


def _sampling_params(args, **defaults):
    from .core.params import SamplingParams

    kw = dict(defaults)
    for name in _SAMPLING_FLAGS:
        v = getattr(args, name, None)
        if v is not None:
            kw[name] = v
    kw["structured_outputs"] = _structured(args)
    return SamplingParams(**kw)  # raises ValueError naming the field


def _load_llm(args, **extra):
    from .core.llm import LLM
    from .models.loader import CheckpointError

    try:
        return LLM(model=args.model, recipe=args.recipe, dtype=args.dtype, max_model_len=args.max_model_len,
                   threads=_threads(args), **parallel_kwargs(args), **extra)
    except CheckpointError as exc:
        _demo_hint(args, exc)


def _demo_hint(args, exc: Exception):
    """Re-raise a checkpoint error; when no --model was given, say how to get one."""
    if args.model is None:
        raise UsageError(f"{exc}\n  hint: pass --model DIR, or make a random-weight checkpoint with "
                         "`deepinfer init-model --arch llama --out DIR`") from None
    raise exc


# --- generate -------------------------------------------------------------------------------------------------

def _logprobs_json(entries: Optional[list], token_ids: list) -> Optional[list]:
    if entries is None:
        return None
    out = []
    for tok, d in zip(token_ids, entries):
        chosen = d.get(tok)
        top = sorted(d.items(), key=lambda kv: (kv[1].rank is None, kv[1].rank or 0))
        out.append({
            "token_id": tok,
            "token": chosen.decoded_token if chosen else None,
            "logprob": chosen.logprob if chosen else None,
            "rank": chosen.rank if chosen else None,
            "top": [{"token_id": t, "token": lp.decoded_token, "logprob": lp.logprob, "rank": lp.rank}
                    for t, lp in top],
        })
    return out


def _completion_json(c, with_logprobs: bool) -> dict:
    d = {"index": c.index, "text": c.text, "token_ids": list(c.token_ids), "finish_reason": c.finish_reason}
    if c.stop_reason is not None:
        d["stop_reason"] = c.stop_reason
    if with_logprobs:
        d["logprobs"] = _logprobs_json(c.logprobs, c.token_ids)
        d["cumulative_logprob"] = c.cumulative_logprob
    if c.error:
        d["error"] = c.error
    return d


def cmd_generate(args) -> int:
    """Text output: each completion's text (with a ``--- prompt i ---`` header when there are several);
    ``--json``: one object per prompt, ``{index, prompt, prompt_token_ids, completions: [...], error?}``."""
    if args.logprobs is not None and not args.json:
        raise UsageError("--logprobs needs --json (the text output prints only the completions)")
    params = _sampling_params(args)  # validated before the (slow) model load
    prompts = list(args.prompts)
    if not prompts:
        if sys.stdin is None or (sys.stdin.isatty() and not args.json):
            print("reading the prompt from stdin (end with Ctrl-D)", file=sys.stderr)
        text = sys.stdin.read() if sys.stdin is not None else ""
        if not text.strip():
            raise UsageError("no prompt: pass PROMPT arguments or pipe the prompt text on stdin")
        prompts = [text[:-1] if text.endswith("\n") else text]
    llm = _load_llm(args)
    params = _sampling_params(args, **llm.generation_defaults)  # flags win over the checkpoint's defaults
    outs = llm.generate(prompts, params, use_tqdm=not args.json and sys.stderr.isatty())
    status = EXIT_OK
    many = len(outs) > 1 or params.n > 1
    for i, out in enumerate(outs):
        if out.error:
            status = EXIT_REQUEST_FAILED
            print(f"error: prompt {i}: {out.error}", file=sys.stderr)
        if args.json:
            obj = {"index": i, "prompt": prompts[i] if isinstance(prompts[i], str) else None,
                   "prompt_token_ids": list(out.prompt_token_ids),
                   "completions": [_completion_json(c, params.logprobs is not None) for c in out.outputs]}
            if out.error:
                obj["error"] = out.error
            print(json.dumps(obj, ensure_ascii=False))
            continue
        if out.error:
            continue
        for c in out.outputs:
            if many:
                print(f"--- prompt {i}" + (f", completion {c.index}" if params.n > 1 else "") + " ---")
            print(c.text)
    sys.stdout.flush()
    return status


# --- chat -----------------------------------------------------------------------------------------------------

CHAT_MAX_TOKENS = 256


def cmd_chat(args) -> int:
    """Interactive on a terminal (``user>`` / ``assistant>`` prompts); otherwise each reply is printed after
    a ``--- reply N ---`` line (N from 1), so replies of several lines stay apart."""
    params = _sampling_params(args, max_tokens=CHAT_MAX_TOKENS)
    llm = _load_llm(args)
    params = _sampling_params(args, max_tokens=CHAT_MAX_TOKENS, **llm.generation_defaults)
    tok = llm.tokenizer
    interactive = sys.stdin.isatty()
    status, replies = EXIT_OK, 0
    history: list = [{"role": "system", "content": args.system}] if args.system else []
    if interactive:
        print("chat: type a message; /reset clears the history, /exit or Ctrl-D quits", file=sys.stderr)
    while True:
        if interactive:
            print("user> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line:
            break  # EOF
        msg = line.rstrip("\n")
        if msg.strip() in ("/exit", "/quit"):
            break
        if msg.strip() == "/reset":
            history = history[:1] if args.system else []
            continue
        if not msg.strip():
            continue
        history.append({"role": "user", "content": msg})
        ids = tok.encode(tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True))
        if interactive:
            print("assistant> ", end="", flush=True)
        else:
            replies += 1
            print(f"--- reply {replies} ---", flush=True)
        shown, final = "", None
        for out in llm.stream({"prompt_token_ids": ids}, params):
            final = out
            if out.error:
                break
            text = out.outputs[0].text
            if text.startswith(shown) and len(text) > len(shown):
                sys.stdout.write(text[len(shown):])
                sys.stdout.flush()
                shown = text
        if final is None or final.error:
            if shown:
                sys.stdout.write("\n")
                sys.stdout.flush()
            print(f"error: {final.error if final else 'no output'}", file=sys.stderr)
            status = EXIT_REQUEST_FAILED
            history.pop()
            continue
        reply = final.outputs[0].text
        if reply.startswith(shown) and len(reply) > len(shown):
            sys.stdout.write(reply[len(shown):])
        sys.stdout.write("\n")
        sys.stdout.flush()
        history.append({"role": "assistant", "content": reply})
    return status


# --- plugins / pipeline ---------------------------------------------------------------------------------------

def plugin_report() -> list:
    """One dict per loaded plugin: name, origin, and what it registered (stages as kind/name).

    A name two plugins registered is listed under both, marked: ``(kept, shadows P)`` on the one in use and
    ``(shadowed by P)`` on the other.
    """
    from .core.plugins import get_plugin_manager, get_registry, plugin_origin

    pm = get_plugin_manager()
    reg = get_registry(pm)
    by_plugin = reg.by_plugin()
    marks: dict = {}  # id(entry) -> its clash marks
    for kept, lost in reg.shadowed:
        marks.setdefault(id(kept), []).append(f"kept, shadows {lost.plugin}")
        marks.setdefault(id(lost), []).append(f"shadowed by {kept.plugin}")
        by_plugin.setdefault(lost.plugin, []).append(lost)

    def labels(entries, category: str) -> list:
        out = []
        for e in sorted((e for e in entries if e.category == category or (category == "parser" and e.category.endswith(
                "_parser"))), key=lambda e: (e.kind or "", e.name)):
            notes = marks.get(id(e), []) + ([] if e.available is None or e.available() else ["unavailable"])
            out.append((f"{e.kind}/{e.name}" if category in ("stage", "parser") else e.name)
                       + (f" ({'; '.join(notes)})" if notes else ""))
        return out

    report = []
    for name, _plugin in pm.list_name_plugin():
        entries = by_plugin.get(name, [])
        report.append({"name": name, "origin": plugin_origin(pm, name),
                       **{key: labels(entries, cat) for key, cat in
                          (("stages", "stage"), ("backends", "backend"), ("models", "model"), ("recipes", "recipe"),
                           ("parsers", "parser"))}})
    return report


def cmd_plugins(args) -> int:
    report = plugin_report()
    if args.json:
        print(json.dumps(report, indent=2))
        return EXIT_OK
    for p in report:
        print(f"{p['name']}  ({p['origin']})")
        shown = False
        for key in ("stages", "backends", "models", "recipes", "parsers"):
            if p[key]:
                print(f"  {key + ':':<10}{', '.join(p[key])}")
                shown = True
        if not shown:
            print("  (registers nothing)")
    return EXIT_OK


def cmd_pipeline(args) -> int:
    from .core.graph import Pipeline

    if args.recipe is not None and args.recipe_opt is not None and args.recipe != args.recipe_opt:
        raise UsageError(f"two recipes given ({args.recipe!r} and --recipe {args.recipe_opt!r}); give one")
    pipe = Pipeline.from_recipe(args.recipe_opt or args.recipe or "default")
    print(pipe.to_dot() if args.dot else pipe.describe())
    return EXIT_OK


# --- init-model / bench ---------------------------------------------------------------------------------------

def cmd_init_model(args) -> int:
    from .init_model import ARCHS, create_checkpoint, num_parameters

    size = ARCHS[args.arch].default_size if args.size is None else args.size
    cfg = create_checkpoint(args.out, arch=args.arch, size=size, seed=args.seed, vocab_size=args.vocab_size,
                            init_std=args.init_std, force=args.force)
    n = num_parameters(args.out)
    if args.vocab_size is not None and cfg["vocab_size"] < args.vocab_size:
        print(f"note: the built-in tokenizer corpus offers {cfg['vocab_size']} tokens, not {args.vocab_size}; "
              "the model's vocab matches the tokenizer", file=sys.stderr)
    print(f"wrote {cfg['architectures'][0]} ({size}: {cfg['num_hidden_layers']} layers, d={cfg['hidden_size']}, "
          f"vocab {cfg['vocab_size']}, {n / 1e6:.2f}M parameters, seed {args.seed}) to {args.out}")
    return EXIT_OK


def cmd_bench(args) -> int:
    from .bench import bench

    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')}={getattr(args, name)} is invalid: must be >= 1")
    threads = _threads(args)
    from .models.loader import CheckpointError

    if args.burstiness is not None and args.request_rate is None:
        raise UsageError("--burstiness needs --request-rate")
    sampling = {k: getattr(args, k) for k in ("temperature", "top_p", "top_k") if getattr(args, k) is not None}
    try:
        bench(model=args.model, num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
              prompts_file=args.prompts_file, seed=args.seed, recipe=args.recipe, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, dtype=args.dtype, max_model_len=args.max_model_len,
              warmups=args.warmups, out=args.out or None, threads=threads, request_rate=args.request_rate,
              burstiness=1.0 if args.burstiness is None else args.burstiness, input_len_range=args.input_len_range,
              output_len_range=args.output_len_range, sampling=sampling)
    except CheckpointError as exc:
        _demo_hint(args, exc)
    return EXIT_OK


def cmd_bench_sweep(args) -> int:
    from .bench_sweep import main

    return EXIT_OK if main(args) else EXIT_USAGE


# --- check ----------------------------------------------------------------------------------------------------

def _ids(text: str, flag: str) -> list:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise UsageError(f"{flag} {text!r}: expected token ids separated by commas or spaces") from None


def cmd_check_yoco(args) -> int:
    """A table per comparison (a line per forced token and a summary line); --out appends the rows and the
    summaries (``"kind": "position"`` / ``"summary"``) as JSONL."""
    from .check_yoco import COMPARISONS, check_yoco, format_table, greedy_continuation

    given = [f for f in ("prompt", "prompt_file", "prompt_ids") if getattr(args, f) is not None]
    if len(given) != 1:
        raise UsageError("give exactly one of --prompt, --prompt-file, --prompt-ids")
    if args.continuation is not None and args.continuation_ids is not None:
        raise UsageError("give at most one of --continuation, --continuation-ids")
    for name in ("top_k", "max_tokens"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')}={getattr(args, name)} is invalid: must be >= 1")
    comparisons = [c for part in args.compare or [",".join(COMPARISONS)] for c in part.split(",") if c]
    bad = [c for c in comparisons if c not in COMPARISONS]
    if bad:
        raise UsageError(f"--compare {bad[0]!r} is invalid: expected some of {', '.join(COMPARISONS)}")
    if args.prompt_file is not None:
        try:
            with open(args.prompt_file, encoding="utf-8") as f:
                args.prompt = f.read()
        except OSError as exc:
            raise UsageError(f"--prompt-file {args.prompt_file}: cannot read it ({exc.strerror})") from None
    llm = _load_llm(args)
    tok = llm.tokenizer
    prompt = _ids(args.prompt_ids, "--prompt-ids") if args.prompt_ids is not None else tok.encode(args.prompt)
    if args.continuation_ids is not None:
        cont = _ids(args.continuation_ids, "--continuation-ids")
    elif args.continuation is not None:
        cont = tok.encode(args.continuation, add_special_tokens=False)
    else:
        cont = greedy_continuation(llm.engine.model, prompt, args.max_tokens)
    rows, summaries, notes = check_yoco(llm, prompt, cont, top_k=args.top_k, threshold=args.threshold,
                                        comparisons=comparisons)
    print(format_table(rows, summaries, notes))
    if args.out:
        model = str(llm.model_path)
        with open(args.out, "a", encoding="utf-8") as f:
            for kind, items in (("position", rows), ("summary", summaries)):
                for r in items:
                    f.write(json.dumps({"kind": kind, "model": model, "dtype": str(llm.config.dtype), **r}) + "\n")
    return EXIT_OK


# --- the parser -----------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    from .init_model import ARCHS, DEFAULT_INIT_STD

    parser = argparse.ArgumentParser(prog="deepinfer", description="DeepInfer: LLM inference as a graph of stages.")
    parser.add_argument("--version", action="version", version=f"deepinfer {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("generate", help="complete prompts (arguments, or stdin)",
                       description="Complete each PROMPT (or the text on stdin) and print the completions.")
    p.add_argument("prompts", nargs="*", metavar="PROMPT")
    _model_args(p)
    _sampling_args(p)
    p.add_argument("--json", action="store_true",
                   help="one JSON object per line and prompt: index, prompt, prompt_token_ids, completions (a "
                        "list of {index, text, token_ids, finish_reason, logprobs if asked}), error if it failed")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive chat on stdin/stdout",
                       description="Read user lines from stdin, keep the history, print the assistant's replies. "
                                   "/reset clears the history; /exit or EOF quits.")
    _model_args(p)
    p.add_argument("--system", default=None, help="system prompt")
    _sampling_args(p, n=False, max_tokens=CHAT_MAX_TOKENS)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("plugins", help="list loaded plugins and what each provides")
    p.add_argument("--json", action="store_true", help="print the list as JSON")
    p.set_defaults(func=cmd_plugins)

    p = sub.add_parser("pipeline", help="show what a recipe chooses: stages with their arguments, backend, engine "
                                        "settings")
    p.add_argument("recipe", nargs="?", default=None, metavar="RECIPE", help=f"{RECIPE_HELP} (default: default)")
    p.add_argument("--recipe", dest="recipe_opt", default=None, metavar="NAME|FILE", help="the same, as a flag")
    p.add_argument("--dot", action="store_true", help="print Graphviz dot instead of text")
    p.set_defaults(func=cmd_pipeline)

    p = sub.add_parser("init-model", help="write a random-weight checkpoint (config.json, safetensors, tokenizer)")
    p.add_argument("--arch", required=True, choices=sorted(ARCHS), help="architecture to write")
    groups: dict = {}  # (sizes, default) -> architectures
    for name, a in sorted(ARCHS.items()):
        groups.setdefault((tuple(a.sizes), a.default_size), []).append(name)
    sizes = "; ".join(f"{', '.join(names)}: {'|'.join(s)} (default {d})" for (s, d), names in groups.items())
    p.add_argument("--size", default=None, choices=sorted({s for a in ARCHS.values() for s in a.sizes}),
                   help=f"model size, per architecture: {sizes}")
    p.add_argument("--out", required=True, metavar="DIR", help="new or empty directory to write")
    p.add_argument("--force", action="store_true",
                   help="write into a non-empty DIR, first removing the checkpoint files there (weights, shard "
                        "index, configs, tokenizer); other files are kept")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="tokenizer/model vocab (default 1024; the built-in corpus caps it near 1185)")
    p.add_argument("--init-std", type=float, default=DEFAULT_INIT_STD,
                   help=f"std of the normal weight init (default {DEFAULT_INIT_STD})")
    p.set_defaults(func=cmd_init_model)

    p = sub.add_parser("bench", help="throughput benchmark, offline or (--request-rate) serving; prints a table "
                                     "(and a JSONL row with --out)")
    _model_args(p, recipe="throughput", max_model_len="the longest prompt + the longest output")
    p.add_argument("--num-prompts", type=int, default=32,
                   help="prompts, all submitted at once unless --request-rate (default 32)")
    p.add_argument("--input-len", type=int, default=64, help="tokens per random prompt (default 64)")
    p.add_argument("--output-len", type=int, default=64, help="tokens generated per prompt, EOS ignored (default 64)")
    p.add_argument("--prompts-file", default=None, metavar="F",
                   help="prompt texts, one per line, instead of random ids")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts, arrivals and lengths (default 0)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="batch size cap (default: the recipe's)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget per step (default: the recipe's)")
    p.add_argument("--warmups", type=int, default=1, help="short untimed runs first (default 1)")
    g = p.add_argument_group("serving workload (--request-rate or a length range; reports TTFT, ITL, TPOT, E2E)")
    g.add_argument("--request-rate", type=float, default=None, metavar="R",
                   help="requests/s arriving as a Poisson process (inf: all at once)")
    g.add_argument("--burstiness", type=float, default=None, metavar="K",
                   help="gamma inter-arrival times of shape K (default 1: Poisson; < 1 burstier, > 1 steadier)")
    g.add_argument("--input-len-range", type=int, nargs=2, default=None, metavar=("LO", "HI"),
                   help="prompt lengths drawn uniformly from LO..HI (default: --input-len)")
    g.add_argument("--output-len-range", type=int, nargs=2, default=None, metavar=("LO", "HI"),
                   help="output lengths drawn uniformly from LO..HI, EOS ignored (default: --output-len)")
    g = p.add_argument_group("sampling (default greedy)")
    g.add_argument("--temperature", type=float, default=None, help="0 = greedy (default 0)")
    g.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass in (0, 1] (default 1.0: off)")
    g.add_argument("--top-k", type=int, default=None, help="sample among the k most likely (default 0: off)")
    p.add_argument("--out", default=None, metavar="FILE",
                   help="JSONL file to append the result row to (default: none, only the table is printed)")
    p.set_defaults(func=cmd_bench)

    from .entrypoints.bench_client import add_bench_serve_parser
    from .entrypoints.cli_serve import add_serve_parser

    add_serve_parser(sub, functools.partial(_model_args, parallel=False))
    add_bench_serve_parser(sub)
    from . import bench_sweep, sweep_plot

    p = sub.add_parser("bench-sweep", help="speculative decoding in steady decode over concurrency and draft "
                                           "settings (also spelled `deepinfer bench sweep`); JSONL rows with --out",
                       description=bench_sweep.__doc__.split("\n\n")[1])
    bench_sweep.add_arguments(p)
    p.set_defaults(func=cmd_bench_sweep)
    p = sub.add_parser("bench-sweep-plot", help="tokens/s against concurrency from sweep rows: a table, an SVG with "
                                                "--svg (also spelled `deepinfer bench sweep-plot`)",
                       description=sweep_plot.__doc__.split("\n\n")[1])
    sweep_plot.add_arguments(p)
    p.set_defaults(func=sweep_plot.main)

    p = sub.add_parser("check", help="numerical checks of fast paths against their oracles")
    check = p.add_subparsers(dest="check", metavar="CHECK", required=True)
    p = check.add_parser("yoco", help="mask vs compact and exact vs bounded replay over a fixed trajectory",
                         description="Score one trajectory (a prompt plus forced continuation tokens) on both sides "
                                     "of each comparison and report, per forced token, the logprob difference, "
                                     "the top-K overlap and the first divergence. Comparisons: pool (CED pool by "
                                     "mask vs gather), path (full-sequence path vs engine path), replay (exact vs "
                                     "bounded replay). See the README, 'Checking YOCO'.")
    _model_args(p)
    g = p.add_argument_group("trajectory (one prompt flag; a continuation flag or --max-tokens)")
    g.add_argument("--prompt", default=None, help="prompt text (tokenized as generate does)")
    g.add_argument("--prompt-file", default=None, metavar="FILE", help="prompt text from a file")
    g.add_argument("--prompt-ids", default=None, metavar="IDS", help="prompt token ids, e.g. 0,17,42")
    g.add_argument("--continuation", default=None, help="forced continuation text (no special tokens added)")
    g.add_argument("--continuation-ids", default=None, metavar="IDS", help="forced continuation token ids")
    g.add_argument("--max-tokens", type=int, default=16,
                   help="without a continuation: this many tokens generated greedily by the full-sequence path "
                        "with exact replay (default 16)")
    p.add_argument("--compare", action="append", default=None, metavar="C[,C]",
                   help="comparisons to run: pool, path, replay (default: all that apply to the model)")
    p.add_argument("--top-k", type=int, default=10, help="K of the top-K overlap (default 10)")
    p.add_argument("--threshold", type=float, default=0.1,
                   help="|dlogprob| above which a position counts as diverged (default 0.1 nats)")
    p.add_argument("--out", default=None, metavar="FILE", help="JSONL file to append the rows and summaries to")
    p.set_defaults(func=cmd_check_yoco)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] in (["bench", "serve"], ["bench", "sweep"], ["bench", "sweep-plot"]):  # bench-serve, bench-sweep...
        argv = [f"bench-{argv[1]}", *argv[2:]]
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2, message already printed)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("deepinfer.core.engine").addFilter(_OWN_REQUEST_ERRORS)  # once: the same object each call
    try:
        if hasattr(args, "threads"):
            _threads(args)  # a bad --threads is refused before stdin is read or a model loads
        return args.func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # pragma: no cover - `deepinfer ... | head`
        return EXIT_OK
    except (ValueError, OSError) as exc:  # bad values, unknown names, missing files: say so, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
