"""The `jsgl` command: generate, chat, serve, bench — with the engine's ablation switches as flags."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from jsgl.cli_errors import run_reporting
from jsgl.engine.config import PRECOMPILE_MODES, EngineConfig
from jsgl.errors import ConfigError
from jsgl.server.limits import ServerLimits

# One help line per EngineConfig field: what it sets, in which unit. A default that is a plain value is appended
# by add_engine_args; where None means "the platform decides", the text says what decides.
ENGINE_HELP = {
    "model": "the model: an alias (smollm2-135m), a .gguf file, or a Hugging Face folder (config.json and "
             "*.safetensors)",
    "device": "where the engine runs: auto is JAX's default backend; cpu, gpu or tpu must be there, else an error",
    "kv_cache_gb": "KV cache size in GiB: K and V of all layers, in the KV dtype (default: {cpu_kv_gb:g} on CPU, "
                   "from --mem-fraction on a GPU/TPU)",
    "num_kv_slots": "KV cache size in token slots; overrides --kv-cache-gb (default: from --kv-cache-gb or "
                    "--mem-fraction)",
    "mem_fraction": "fraction of the device's memory for weights + KV cache (SGLang's --mem-fraction-static); the "
                    "KV cache gets what weights and activations leave (default: {mem_fraction:g} on a GPU/TPU "
                    "unless --kv-cache-gb or --num-kv-slots is given; unused on CPU, whose pool is --kv-cache-gb)",
    "page_size": "KV cache page size in tokens (default: 1 on CPU, {page_size} on a GPU/TPU)",
    "max_running_requests": "most requests running at once (batch size of a decode step)",
    "chunked_prefill_size": "most new prompt tokens per prefill (extend) step, in tokens; at least 16",
    "prefill_share": "while requests decode, the most of the engine's time prefill steps take, in (0, 1]; a "
                     "prompt's chunks shrink as its context grows (1: prefill and decode steps alternate); steps "
                     "apart only (mixed steps carry their own budget)",
    "mixed_prefill_tokens": "mixed steps: while requests decode, each step also carries at most this many prefill "
                            "tokens (fewer at long context); 0: off (default: on a GPU/TPU --chunked-prefill-size "
                            "less --max-running-requests, at least half of it; off on CPU)",
    "context_length": "longest context of a request, in tokens (default: the model's max_position_embeddings)",
    "attention_backend": "attention kernels: native (pure JAX), pallas (GPU), tpu (Mosaic; not yet run on a TPU), cpu "
                         "(C++ kernel); auto: pallas on a GPU, tpu on a TPU (each checked against native on the device "
                         "first, native if it fails), cpu on a CPU that builds the kernels (float32, --tp 1), else "
                         "native",
    "layers": "the model's layers as one lax.scan (compiles one layer: start-up that does not grow with depth) or "
              "unrolled (faster on CPU; needed by the CPU kernels); auto: scanned on a TPU, unrolled on a GPU (until "
              "its speed is measured there) and CPU",
    "dtype": "dtype of weights and activations (matmuls accumulate in float32); auto: float32 on CPU, bfloat16 on "
             "a GPU/TPU",
    "kv_dtype": "KV cache dtype; int8: 8-bit values with a scale per token and head; auto: --dtype's",
    "matmul_backend": "matmul kernels: xla (XLA's dot), packed (float32 panels), gguf (the GGUF file's Q4_1/Q8_0 "
                      "blocks); auto: gguf on a CPU that builds the kernels (float32, --tp 1), else xla",
    "attention_budget_gb": "bound on an extend step's padded attention scores, in GiB",
    "prefix_cache": "prefix cache: radix (the radix tree), flat (no tree, an ablation), none (no reuse)",
    "cache_match_fraction": "use only this fraction of each radix prefix match, in [0, 1] (the rest is "
                            "recomputed; sets a hit rate, Fig. 8(a)(b)); 1: the whole match",
    "schedule_policy": "order of the waiting queue: lpm (longest cached prefix first), dfs-weight (the paper's DFS "
                       "order), fcfs, lof (longest max_new_tokens first), random",
    "starvation_s": "a request waiting longer than this many seconds is admitted first, whatever the priorities, and "
                    "is not preempted",
    "enable_priority_scheduling": "schedule by requests' `priority` (higher first, preempting lower ones); off: "
                                  "every request counts as priority 0",
    "jump_forward": "compressed-FSM jump-forward for regex and JSON-schema requests",
    "grammar_backend": "constrained decoding: jsgl (compressed FSM: regex, JSON schema, jump-forward) or "
                       "llguidance (also EBNF grammars)",
    "precompile": "compile the step shapes: background (common's, in a thread while serving; a step waits only "
                  "for its own shape), common (decode and extend buckets, at start), all (also prompt-logprob "
                  "extends), off (each on first use)",
    "executable_store": "save compiled step executables on disk and load them on the next start: auto (one "
                        "process, unless JSGL_EXECUTABLE_STORE=off), on, off; with background precompile the stored "
                        "shapes load at start",
    "overlap_schedule": "overlap scheduling: dispatch the next decode step before the running one is read back "
                        "(on CPU only for small decode batches)",
    "speculative_algorithm": "speculative decoding: ngram (drafts from the prefix cache's continuation of a request's "
                             "tokens, else from its own earlier text; cut by its grammar; verified in one decode step "
                             "with its jump-forward tokens) or none",
    "speculative_num_draft_tokens": "most draft tokens per request and step",
    "speculative_ngram_min_match_window_size": "shortest n-gram of a request's last tokens looked up in its text",
    "speculative_ngram_max_match_window_size": "longest n-gram of a request's last tokens looked up in its text (tried "
                                               "first)",
    "speculative_max_batch": "decode batches of more requests than this get no drafts (default: the platform's: 8 "
                             "on CPU, where twice the rows cost about twice from 16 rows up; 64 on a GPU/TPU, "
                             "unmeasured)",
    "seed": "seed of the sampling seeds drawn for requests that bring none",
    "tp": "tensor-parallel degree, in local devices; with --nnodes > 1 in all processes' devices (devices per node "
          "x nnodes)",
    "dist_init_addr": "multi-host: HOST:PORT of node rank 0 and a free port there, where the processes meet "
                      "(jax.distributed; default: none, one process)",
    "nnodes": "multi-host: the number of processes (nodes) one engine spans; rank 0 serves, the others follow "
              "its steps",
    "node_rank": "multi-host: this process's rank, 0 to nnodes - 1",
    "dist_timeout": "multi-host: seconds to wait for the other processes to join, and after which a silent one "
                      "counts as dead (every process then exits with that reason)",
    "weights_cache": "save the weights as placed (dtype, tp shards) as an orbax checkpoint and restore them on the "
                     "next start: auto (GGUF models only), orbax (also HF folders), off",
    "max_top_logprobs": "most top logprobs per token a request may ask for (top_logprobs_num)",
    "max_stop_sequences": "most stop strings per request",
    "max_stop_chars": "longest stop string, in characters",
    "constraint_timeout_s": "seconds a regex/schema index may take to build before its request fails (400)",
}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field (``--kv-cache-gb``, ``--prefix-cache``, ``--schedule-policy`` ...)."""
    from jsgl.engine.platform import ACCELERATOR_MEM_FRACTION, ACCELERATOR_PAGE_SIZE, CPU_KV_CACHE_GB

    platform = {"cpu_kv_gb": CPU_KV_CACHE_GB, "mem_fraction": ACCELERATOR_MEM_FRACTION,
                "page_size": ACCELERATOR_PAGE_SIZE}
    choices = {
        "device": ["auto", "cpu", "gpu", "tpu"],
        "prefix_cache": ["radix", "flat", "none"],
        "schedule_policy": ["lpm", "dfs-weight", "fcfs", "lof", "random"],
        "attention_backend": ["auto", "native", "pallas", "tpu", "cpu"],
        "matmul_backend": ["auto", "xla", "packed", "gguf"],
        "layers": ["auto", "scanned", "unrolled"],
        "grammar_backend": ["jsgl", "llguidance"],
        "precompile": list(PRECOMPILE_MODES),
        "weights_cache": ["auto", "orbax", "off"],
        "executable_store": ["auto", "on", "off"],
        "dtype": ["auto", "bfloat16", "float16", "float32"],
        "kv_dtype": ["auto", "bfloat16", "float16", "float32", "int8"],  # memory.KV_DTYPES
    }
    for field in dataclasses.fields(EngineConfig):
        flag = "--" + field.name.replace("_", "-")
        help_text = ENGINE_HELP.get(field.name, "").format(**platform)  # tests/test_cli.py: none may lack one
        if field.type in ("bool", bool):
            if help_text and "default:" not in help_text:
                help_text += f" (default: {'on' if field.default else 'off'})"
            if field.name.startswith("enable_"):  # SGLang's store_true flags: bare means on (on|off still taken)
                parser.add_argument(flag, type=_on_off, nargs="?", const=True, default=field.default,
                                    metavar="on|off", help=help_text)
                continue
            parser.add_argument(flag, type=lambda v: v.lower() in ("1", "on", "true", "yes"),
                                default=field.default, metavar="on|off", help=help_text)
        else:
            if help_text and "default:" not in help_text:
                help_text += " (default: %(default)s)"  # argparse fills it in (serve's set_defaults included)
            kind = {"int": int, "float": float}.get(str(field.type).split(" ")[0], str)
            parser.add_argument(flag, type=kind, default=field.default, choices=choices.get(field.name),
                                help=help_text)


def _on_off(value: str) -> bool:
    # Strict: a bare flag followed by a positional argument must not read it as "off".
    if value.lower() in ("1", "on", "true", "yes"):
        return True
    if value.lower() in ("0", "off", "false", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected on or off, not {value!r}")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)})


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    return {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p,
            "top_k": args.top_k, "sampling_seed": args.seed_sample, "stop": args.stop or None}


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128,
                   help="most tokens to generate (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature; 0: greedy (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling: keep the most likely tokens up to this probability mass; 1: off "
                        "(default: %(default)s)")
    p.add_argument("--top-k", type=int, default=-1,
                   help="keep only the k most likely tokens; -1: off (default: %(default)s)")
    p.add_argument("--seed-sample", type=int, default=None,
                   help="seed of this request's sampling (default: drawn from the engine's --seed)")
    p.add_argument("--stop", action="append",
                   help="stop string; repeat the flag for several (default: none)")


def _follow(cfg: EngineConfig) -> None:
    """A multi-host process of node rank > 0: its shards of the engine, running rank 0's steps until it stops."""
    from jsgl.engine.engine import Engine

    Engine(config=cfg).follow()


def cmd_generate(args: argparse.Namespace) -> int:
    from jsgl.engine.engine import Engine

    if args.node_rank > 0:
        _follow(engine_config(args))
        return 0
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


def print_memory_plan(args: argparse.Namespace) -> int:
    """`jsgl serve --dry-run`: the memory plan from the model's config alone, no weight loaded."""
    from jsgl.engine.backends import resolve_backends
    from jsgl.engine.memory import load_config, plan_memory, resolve_dtypes
    from jsgl.engine.platform import Platform, current_platform, max_step_tokens, resolve_defaults

    cfg = engine_config(args)
    config = load_config(cfg.model)
    device = (int(args.device_gb * (1 << 30)), "--device-gb") if args.device_gb else None
    # --device-gb stands for an accelerator of that size (--device's, a GPU unless tpu): its defaults (page
    # size, pool from the device, backends).
    accelerator = "tpu" if cfg.device == "tpu" else "gpu"
    platform = Platform(accelerator, "--device-gb", 1) if args.device_gb else current_platform(cfg.device)
    defaults = resolve_defaults(platform, page_size=cfg.page_size, kv_cache_gb=cfg.kv_cache_gb,
                                num_kv_slots=cfg.num_kv_slots, mem_fraction=cfg.mem_fraction,
                                mixed_prefill_tokens=cfg.mixed_prefill_tokens,
                                chunked_prefill_size=cfg.chunked_prefill_size,
                                max_running_requests=cfg.max_running_requests)
    cfg = dataclasses.replace(cfg, **dataclasses.asdict(defaults))
    dtype, kv_dtype = resolve_dtypes(cfg.dtype, cfg.kv_dtype, platform.name)
    backends = resolve_backends(cfg.attention_backend, cfg.matmul_backend, tp=cfg.tp, dtype=dtype,
                                kv_dtype=kv_dtype, page_size=cfg.page_size, platform=platform.name,
                                layers=cfg.layers)
    if not backends.length_free(config):  # as the engine: padded attention mixes no steps
        cfg = dataclasses.replace(cfg, mixed_prefill_tokens=0)
    plan = plan_memory(config, tp=cfg.tp, mem_fraction=cfg.mem_fraction, kv_cache_gb=cfg.kv_cache_gb,
                       num_kv_slots=cfg.num_kv_slots,
                       max_step_tokens=max_step_tokens(cfg.chunked_prefill_size, cfg.mixed_prefill_tokens,
                                                       cfg.max_running_requests),
                       max_batch=cfg.max_running_requests, device_bytes=device,
                       weight_itemsize=dtype.itemsize, kv_dtype=kv_dtype)
    print(f"model {cfg.model}: {config.architecture}, {config.num_layers} layers, {config.num_heads} heads "
          f"({config.num_kv_heads} KV), hidden {config.hidden_size}, vocab {config.vocab_size}; weights "
          f"{dtype}, KV {kv_dtype}; {platform.name} defaults: page size {cfg.page_size}, mixed steps "
          + (f"of up to {cfg.mixed_prefill_tokens} prefill tokens" if cfg.mixed_prefill_tokens else "off"))
    print(f"backends: attention {backends.attention}, matmul {backends.matmul}, layers {backends.layers}")
    print(plan.render())
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    if args.dry_run:
        return print_memory_plan(args)
    if (args.dp > 1 or args.ray_address) and args.nnodes > 1:
        raise ConfigError("--dp and --nnodes together are not supported yet (replicas of a multi-host engine): "
                          "give one of them")
    if args.node_rank > 0:  # rank 0 serves; this process only computes its shards
        _follow(engine_config(args))
        return 0
    limits = ServerLimits(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ServerLimits)})
    if args.dp > 1 or args.ray_address:
        return serve_replicas(args, limits)
    from jsgl.server.app import serve

    serve(engine_config(args), host=args.host, port=args.port, api_key=args.api_key, limits=limits,
          timeout_keep_alive=args.timeout_keep_alive, limit_concurrency=args.limit_concurrency,
          metrics=not args.disable_metrics)
    return 0


def serve_replicas(args: argparse.Namespace, limits: ServerLimits) -> int:
    """`jsgl serve --dp N`: N replicas as Ray actors behind sglang-router, until SIGINT/SIGTERM."""
    import signal
    import threading

    from jsgl.server.router_process import check_installed

    if args.api_key:  # sglang-router does not pass a client's key on to the workers in this wiring
        raise ConfigError("--api-key cannot be combined with --dp (the router does not forward the key to the "
                          "replicas); serve on a private address or put a proxy that checks keys in front")
    check_installed()
    from jsgl.server.replicas import Replicas

    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        if not stop.is_set():  # the first signal interrupts a start-up under way; stop() is not interrupted
            stop.set()
            raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    replicas = None
    try:
        replicas = Replicas(engine_config(args), dp=args.dp, policy=args.router_policy, ray_address=args.ray_address,
                            host=args.host, port=args.port, limits=limits,
                            control_key=args.control_plane_api_key)
        print(f"jsgl: {args.dp} replicas of {args.model} behind sglang-router ({args.router_policy}) at "
              f"{replicas.url}", file=sys.stderr, flush=True)
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        if replicas is not None:
            replicas.stop()
            print("jsgl: replicas and router stopped", file=sys.stderr, flush=True)
    return 0


def config_runner_args(argv: list[str]) -> list[str]:
    """What follows `bench` but `--config FILE`: the config runner's own flags as written (argparse reads the
    value of `--json PATH` as the positional benchmark name)."""
    out, skip = [], False
    for token in argv[argv.index("bench") + 1:]:
        if skip or token == "--config" or token.startswith("--config="):
            skip = token == "--config"
            continue
        out.append(token)
    return out


def cmd_bench(args: argparse.Namespace, rest: list[str], argv: list[str]) -> int:
    import importlib
    import importlib.util

    if args.help:  # with a benchmark (or config) named, its own parser prints its flags
        if not (args.which or args.config):
            args.print_help()
            return 0
        rest = [*rest, "--help"]
    if args.config:  # an ablation grid from a file (experiments/configs/*.toml)
        runner_args = config_runner_args(argv)
        if runner_args[:1] == [args.which]:  # a name given first, not a flag's value
            raise SystemExit("jsgl bench: give a benchmark name or --config FILE, not both")
        from jsgl.experiments.config_runner import main as run_config_file

        return run_config_file([args.config, *runner_args]) or 0
    if not args.which:
        raise SystemExit("jsgl bench: name a benchmark (e.g. decode, radix, workloads) or give --config FILE")
    name = f"jsgl.experiments.bench_{args.which}"
    if importlib.util.find_spec(name) is None:  # experiments that are not benchmarks (soak)
        name = f"jsgl.experiments.{args.which}"
    module = importlib.import_module(name)
    return module.main(rest) or 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jsgl", description=__doc__,
                                     epilog="jsgl COMMAND --help lists a command's flags with their defaults.")
    # Each command's help fits on one line of `jsgl --help` (tests/test_cli.py).
    sub = parser.add_subparsers(dest="command", required=True, title="commands", metavar="COMMAND")
    gen = sub.add_parser("generate", help="continue a prompt, streamed to stdout",
                         description="Continue a prompt with the model, streamed to stdout.")
    gen.add_argument("prompt", help="the text to continue")
    gen.add_argument("-v", "--verbose", action="store_true",
                     help="print the output's meta info and the engine's stats to stderr (default: off)")
    _add_sampling_args(gen)
    add_engine_args(gen)
    chat = sub.add_parser("chat", help="chat with the model in its chat template",
                          description="Chat with the model in its chat template; an empty line is skipped, EOF ends.")
    chat.add_argument("--system", default=None, help="system message (default: none)")
    _add_sampling_args(chat)
    add_engine_args(chat)
    serve = sub.add_parser("serve", help="HTTP server: SGLang's /generate and the OpenAI API",
                           description="HTTP server: SGLang's /generate and the OpenAI API (/v1/*).")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    serve.add_argument("--port", type=int, default=30000, help="port to listen on (default: %(default)s)")
    serve.add_argument("--api-key", default=None,
                       help="key clients send as 'Authorization: Bearer KEY' (default: none, no key asked)")
    serve.add_argument("--admin-key", default=None,
                       help="key for abort_all and /flush_cache (default: none: anyone without --api-key, "
                            "nobody with it)")
    limits = ServerLimits()
    serve.add_argument("--max-body-bytes", type=int, default=limits.max_body_bytes,
                       help="largest request body, in bytes (413 beyond) (default: %(default)s)")
    serve.add_argument("--max-batch-prompts", type=int, default=limits.max_batch_prompts,
                       help="prompts (times n) per HTTP request (default: %(default)s)")
    serve.add_argument("--max-concurrent-requests", type=int, default=limits.max_concurrent_requests,
                       help="live requests over all clients (503 beyond) (default: %(default)s)")
    serve.add_argument("--timeout-keep-alive", type=int, default=5,
                       help="uvicorn: seconds an idle keep-alive connection stays open (default: %(default)s)")
    serve.add_argument("--limit-concurrency", type=int, default=None,
                       help="uvicorn: most open connections (503 beyond) (default: no limit)")
    serve.add_argument("--disable-metrics", action="store_true",
                       help="no Prometheus metrics at /metrics (default: off, i.e. metrics on)")
    serve.add_argument("--enable-metrics", action="store_true",
                       help="SGLang's flag, accepted: metrics are on unless --disable-metrics (default: on)")
    serve.add_argument("--dp", type=int, default=1,
                       help="data parallelism: this many engine replicas as Ray actors behind sglang-router, which "
                            "listens on --host/--port (needs jsgl[distributed]) (default: %(default)s)")
    serve.add_argument("--router-policy", default="cache_aware", choices=["cache_aware", "round_robin",
                                                                          "power_of_two"],
                       help="with --dp: how sglang-router picks a replica (default: %(default)s)")
    serve.add_argument("--ray-address", default=None,
                       help="with --dp: join this Ray cluster (ray.init(address=...)) (default: none, a local "
                            "cluster started and stopped with the server)")
    serve.add_argument("--control-plane-api-key", default=None, metavar="KEY",
                       help="with --dp: the key of the router's admin routes (/workers: list, add, remove), as "
                            "'Authorization: Bearer KEY' (default: a fresh random key, known to jsgl alone)")
    add_engine_args(serve)
    serve.add_argument("--dry-run", action="store_true",
                       help="print the memory plan (weights, activations, KV slots per device) and exit "
                            "(default: off)")
    serve.add_argument("--device-gb", type=float, default=None,
                       help="with --dry-run: plan for a device of this many GiB (e.g. 80 for an H100) "
                            "(default: this machine's device)")
    serve.set_defaults(precompile="common")  # a server pays its compiles at start, not on users' first requests
    sub.add_parser("figures", help="the paper's figures: PNGs and results.md",
                   description="Run the paper's evaluation: one PNG per figure and results.md "
                               "(experiments/figures.py; its flags pass through: jsgl figures --help).",
                   add_help=False)
    # -h is ours: with a benchmark named, it passes through to the benchmark's own parser.
    bench = sub.add_parser("bench", help="run a benchmark from experiments/", add_help=False,
                           description="Run a benchmark from experiments/ (bench_NAME.py): the flags after NAME "
                                       "are the benchmark's own (jsgl bench NAME --help).")
    bench.add_argument("-h", "--help", action="store_true",
                       help="show this help, or with NAME the benchmark's flags, and exit (default: off)")
    bench.add_argument("which", nargs="?", metavar="NAME",
                       help="the benchmark, e.g. decode, radix, json, server, workloads, soak (default: none; "
                            "then --config)")
    bench.add_argument("--config", default=None, metavar="FILE",
                       help="run an ablation config instead: a path or a file name in experiments/configs/*.toml "
                            "(default: none)")
    bench.set_defaults(print_help=bench.print_help)
    return parser


def main(argv: list[str] | None = None) -> int:
    from jsgl.engine.platform import prepare_gpu_allocator

    prepare_gpu_allocator()  # before JAX starts: a GPU's allocator must hold mem_fraction of the device
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    args, rest = parser.parse_known_args(argv)
    if rest and args.command not in ("bench", "figures"):  # those two pass the rest on to their own parsers
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    # One place for how a command fails: a refusal as one line (exit 2), a bug as its traceback (exit 1).
    return run_reporting(args.command, lambda: run_command(args, rest, argv))


def run_command(args: argparse.Namespace, rest: list[str], argv: list[str]) -> int:
    if args.command == "bench":
        return cmd_bench(args, rest, argv)
    if args.command == "figures":
        from jsgl.experiments.figures import main as figures_main

        return figures_main(rest) or 0
    return {"generate": cmd_generate, "chat": cmd_chat, "serve": cmd_serve}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
