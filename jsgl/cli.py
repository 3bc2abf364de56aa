"""The `jsgl` command: generate, chat, serve, bench — with the engine's ablation switches as flags."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from jsgl.engine.config import EngineConfig
from jsgl.server.limits import ServerLimits


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field (``--kv-cache-gb``, ``--prefix-cache``, ``--schedule-policy`` ...)."""
    choices = {
        "device": ["auto", "cpu", "gpu", "tpu"],
        "prefix_cache": ["radix", "flat", "none"],
        "schedule_policy": ["lpm", "dfs-weight", "fcfs", "lof", "random"],
        "attention_backend": ["auto", "native", "pallas", "cpu"],
        "matmul_backend": ["auto", "xla", "packed", "gguf"],
        "grammar_backend": ["jsgl", "llguidance"],
        "precompile": ["off", "common", "all"],
        "weights_cache": ["auto", "orbax", "off"],
        "dtype": ["auto", "bfloat16", "float16", "float32"],
        "kv_dtype": ["auto", "bfloat16", "float16", "float32", "int8"],  # memory.KV_DTYPES
    }
    for field in dataclasses.fields(EngineConfig):
        flag = "--" + field.name.replace("_", "-")
        if field.type in ("bool", bool):
            parser.add_argument(flag, type=lambda v: v.lower() in ("1", "on", "true", "yes"),
                                default=field.default, metavar="on|off")
        else:
            kind = {"int": int, "float": float}.get(str(field.type).split(" ")[0], str)
            parser.add_argument(flag, type=kind, default=field.default, choices=choices.get(field.name))


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)})


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    return {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p,
            "top_k": args.top_k, "sampling_seed": args.seed_sample, "stop": args.stop or None}


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed-sample", type=int, default=None, help="seed of this request's sampling")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")


def cmd_generate(args: argparse.Namespace) -> int:
    from jsgl.engine.engine import Engine

    engine = Engine(config=engine_config(args))
    try:
        handle = engine.submit(args.prompt, _sampling(args))
        sys.stdout.write(args.prompt)
        for chunk in handle.stream():
            sys.stdout.write(chunk.text_delta)
            sys.stdout.flush()
        out = handle.result()
        sys.stdout.write("\n")
        if args.verbose:
            print(out.meta_info, engine.stats(), file=sys.stderr)
    finally:
        engine.shutdown()
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from jsgl.engine.engine import Engine
    from jsgl.server.chat_spans import render_chat_spans

    engine = Engine(config=engine_config(args))
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    try:
        while True:
            try:
                line = input("you> ")
            except EOFError:
                break
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line})
            # What was typed is text: a special token's string in it cannot close its turn (chat_spans.py).
            prompt = render_chat_spans(engine.tokenizer, messages, add_generation_prompt=True)
            sys.stdout.write("assistant> ")
            handle = engine.submit(prompt, _sampling(args))
            for chunk in handle.stream():
                sys.stdout.write(chunk.text_delta)
                sys.stdout.flush()
            sys.stdout.write("\n")
            messages.append({"role": "assistant", "content": handle.result().text})
    finally:
        engine.shutdown()
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    if args.dry_run:  # the memory plan from the model's config alone: no weight is loaded
        from jsgl.engine.memory import load_config, plan_memory, resolve_dtypes
        from jsgl.engine.platform import Platform, current_platform, resolve_defaults

        cfg = engine_config(args)
        config = load_config(cfg.model)
        device = (int(args.device_gb * (1 << 30)), "--device-gb") if args.device_gb else None
        try:
            # --device-gb stands for an accelerator of that size: its defaults (page size, pool from the device).
            platform = Platform("gpu", "--device-gb", 1) if args.device_gb else current_platform(cfg.device)
            defaults = resolve_defaults(platform, page_size=cfg.page_size, kv_cache_gb=cfg.kv_cache_gb,
                                        num_kv_slots=cfg.num_kv_slots, mem_fraction=cfg.mem_fraction)
            cfg = dataclasses.replace(cfg, **dataclasses.asdict(defaults))
            dtype, kv_dtype = resolve_dtypes(cfg.dtype, cfg.kv_dtype, platform.name)
            plan = plan_memory(config, tp=cfg.tp, mem_fraction=cfg.mem_fraction, kv_cache_gb=cfg.kv_cache_gb,
                               num_kv_slots=cfg.num_kv_slots, max_step_tokens=cfg.chunked_prefill_size,
                               max_batch=cfg.max_running_requests, device_bytes=device,
                               weight_itemsize=dtype.itemsize, kv_dtype=kv_dtype)
        except ValueError as exc:
            print(f"jsgl serve: {exc}", file=sys.stderr)
            return 2
        print(f"model {cfg.model}: {config.architecture}, {config.num_layers} layers, {config.num_heads} heads "
              f"({config.num_kv_heads} KV), hidden {config.hidden_size}, vocab {config.vocab_size}; weights "
              f"{dtype}, KV {kv_dtype}; {platform.name} defaults: page size {cfg.page_size}")
        print(plan.render())
        return 0
    from jsgl.server.app import serve

    limits = ServerLimits(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ServerLimits)})
    serve(engine_config(args), host=args.host, port=args.port, api_key=args.api_key, limits=limits,
          timeout_keep_alive=args.timeout_keep_alive, limit_concurrency=args.limit_concurrency)
    return 0


def cmd_bench(args: argparse.Namespace, rest: list[str]) -> int:
    import importlib
    import importlib.util

    if args.config:  # an ablation grid from a file (experiments/configs/*.toml)
        if args.which:
            raise SystemExit("jsgl bench: give a benchmark name or --config FILE, not both")
        from jsgl.experiments.config_runner import main as run_config_file

        return run_config_file([args.config, *rest]) or 0
    if not args.which:
        raise SystemExit("jsgl bench: name a benchmark (e.g. decode, radix, workloads) or give --config FILE")
    name = f"jsgl.experiments.bench_{args.which}"
    if importlib.util.find_spec(name) is None:  # experiments that are not benchmarks (soak)
        name = f"jsgl.experiments.{args.which}"
    module = importlib.import_module(name)
    return module.main(rest) or 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jsgl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a continuation of a prompt (streams to stdout)")
    gen.add_argument("prompt")
    gen.add_argument("-v", "--verbose", action="store_true")
    _add_sampling_args(gen)
    add_engine_args(gen)
    chat = sub.add_parser("chat", help="chat with the model using its chat template")
    chat.add_argument("--system", default=None)
    _add_sampling_args(chat)
    add_engine_args(chat)
    serve = sub.add_parser("serve", help="HTTP server: SGLang /generate and the OpenAI API")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=30000)
    serve.add_argument("--api-key", default=None)
    serve.add_argument("--admin-key", default=None, help="key for abort_all and /flush_cache")
    limits = ServerLimits()
    serve.add_argument("--max-body-bytes", type=int, default=limits.max_body_bytes)
    serve.add_argument("--max-batch-prompts", type=int, default=limits.max_batch_prompts,
                       help="prompts (times n) per HTTP request")
    serve.add_argument("--max-concurrent-requests", type=int, default=limits.max_concurrent_requests,
                       help="live requests over all clients (503 beyond)")
    serve.add_argument("--timeout-keep-alive", type=int, default=5, help="uvicorn: idle keep-alive seconds")
    serve.add_argument("--limit-concurrency", type=int, default=None, help="uvicorn: open connections (503 beyond)")
    add_engine_args(serve)
    serve.add_argument("--dry-run", action="store_true",
                       help="print the memory plan (weights, activations, KV slots per device) and exit")
    serve.add_argument("--device-gb", type=float, default=None,
                       help="with --dry-run: plan for a device of this many GiB (e.g. 80 for an H100) instead of "
                            "this machine's")
    serve.set_defaults(precompile="common")  # a server pays its compiles at start, not on users' first requests
    sub.add_parser("figures", help="run the paper's evaluation: one PNG per figure and results.md "
                                   "(experiments/figures.py; its args pass through)", add_help=False)
    bench = sub.add_parser("bench", help="run a benchmark from experiments/ (extra args pass through)")
    bench.add_argument("which", nargs="?", help="e.g. decode, radix, json, server, workloads")
    bench.add_argument("--config", default=None,
                       help="run an ablation config instead (experiments/configs/*.toml; a path or a file name there)")
    return parser


def main(argv: list[str] | None = None) -> int:
    from jsgl.engine.platform import prepare_gpu_allocator

    prepare_gpu_allocator()  # before JAX starts: a GPU's allocator must hold mem_fraction of the device
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        return cmd_bench(args, rest)
    if args.command == "figures":
        from jsgl.experiments.figures import main as figures_main

        return figures_main(rest) or 0
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return {"generate": cmd_generate, "chat": cmd_chat, "serve": cmd_serve}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
