"""The `tokenmill` command: `tokenmill serve [MODEL] [vLLM flags]`, `tokenmill bench NAME [flags]`."""
from __future__ import annotations

import argparse
import importlib
import sys

import tokenmill

# `tokenmill bench NAME` runs "module:function" under tokenmill.benchmarks with the rest of the command line
# (a list of strings). The function parses its own flags (`tokenmill bench NAME --help`) and returns an exit
# status or a result (exit status 0). A new benchmark is one line here.
BENCHMARKS: dict[str, tuple[str, str]] = {
    "serve": ("serve:run_cli", "Online benchmark against a running OpenAI-compatible server."),
    "throughput": ("throughput:main", "Offline throughput on random prompts (also --backend hf)."),
    "latency": ("latency:main", "Offline latency of one batch, repeated, with percentiles."),
    "profile": ("workload_profile:main", "Where an offline workload's time goes: engine phases, steps by batch size, "
                                "host functions, kernels."),
    "step-gaps": ("step_gaps:main", "CUDA: device idle time between batch-1 decode graph replays."),
    "all-reduce": ("all_reduce:main", "CUDA, 2+ GPUs: all-reduce latency, NCCL vs the symmetric-memory kernel."),
    "spec": ("spec_decode:main", "Speculative decoding on real weights at batch 1: ngram and suffix against no "
                                 "drafts, on prompts that quote their context and on ordinary chats."),
    "kv-footprint": ("kv_footprint:main", "The KV memory one long request holds at its peak, per layer group, against "
                                          "every layer global (device-free)."),
    "kernels": ("kernels:main", "CUDA: measure where the Triton gemv beats cuBLAS; write the device's table."),
}


def _top_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tokenmill", description="tokenmill: a vLLM-compatible LLM serving engine.")
    p.add_argument("-v", "--version", action="version", version=tokenmill.__version__)
    sub = p.add_subparsers(dest="command", metavar="{serve,bench}")
    sub.add_parser("serve", help="Start the OpenAI-compatible API server (see `tokenmill serve --help`).",
                   add_help=False)
    sub.add_parser("bench", help=f"Benchmarks: {', '.join(BENCHMARKS)} (see `tokenmill bench --help`).",
                   add_help=False)
    return p


def serve(argv: list[str]) -> None:
    # The engine core's process starts now, so that its imports (seconds of them) overlap this process's.
    if not any(a in ("-h", "--help", "--headless") or a.startswith("--api-server-count") for a in argv):
        from tokenmill.engine import standby
        standby.prestart()
    from tokenmill.gc_utils import gc_paused
    with gc_paused():
        from tokenmill.config.args import parse_serve_args
        from tokenmill.entrypoints.openai.api_server import run_server
    engine_kwargs, frontend = parse_serve_args(argv, prog="tokenmill serve")
    run_server(engine_kwargs, frontend)


def _bench_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tokenmill bench", description="Benchmark a server or the engine.",
                                epilog="`tokenmill bench NAME --help` lists a benchmark's own flags.")
    sub = p.add_subparsers(dest="bench_command", metavar="{" + ",".join(BENCHMARKS) + "}")
    for name, (_, help) in BENCHMARKS.items():
        sub.add_parser(name, help=help, add_help=False)
    return p


def bench(argv: list[str]) -> int:
    if not argv or argv[0] not in BENCHMARKS:
        p = _bench_parser()
        p.parse_args(argv)  # exits: --help, or an unknown name
        p.print_help()
        return 2
    name = argv[0]
    module_name, func_name = BENCHMARKS[name][0].split(":")
    try:
        module = importlib.import_module(f"tokenmill.benchmarks.{module_name}")
    except ImportError as e:
        print(f"tokenmill bench {name} is not available: {e}", file=sys.stderr)
        return 2
    sys.argv[0] = f"tokenmill bench {name}"
    try:
        result = getattr(module, func_name)(argv[1:])
    except ValueError as e:  # a flag value the benchmark refused
        print(f"tokenmill bench {name}: {e}", file=sys.stderr)
        return 2
    return result if isinstance(result, int) else 0


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "serve":
        serve(argv[1:])
        return
    if argv and argv[0] == "bench":
        sys.exit(bench(argv[1:]))
    p = _top_parser()
    args = p.parse_args(argv)
    if args.command is None:
        p.print_help()
        sys.exit(2)


if __name__ == "__main__":
    main()
