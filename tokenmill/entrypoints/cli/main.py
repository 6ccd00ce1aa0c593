"""The `tokenmill` command: `tokenmill serve [MODEL] [vLLM flags]`, `tokenmill bench serve|throughput|latency`."""
from __future__ import annotations

import argparse
import sys

import tokenmill

_OFFLINE_BENCH = {"throughput": "Offline throughput on random prompts (also --backend hf).",
                  "latency": "Offline latency of one batch, repeated, with percentiles."}


def _top_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tokenmill", description="tokenmill: a vLLM-compatible LLM serving engine.")
    p.add_argument("-v", "--version", action="version", version=tokenmill.__version__)
    sub = p.add_subparsers(dest="command", metavar="{serve,bench}")
    sub.add_parser("serve", help="Start the OpenAI-compatible API server (see `tokenmill serve --help`).",
                   add_help=False)
    sub.add_parser("bench", help="Benchmarks: serve, throughput, latency (see `tokenmill bench --help`).",
                   add_help=False)
    return p


def serve(argv: list[str]) -> None:
    from tokenmill.config.args import parse_serve_args
    from tokenmill.entrypoints.openai.api_server import run_server
    engine_kwargs, frontend = parse_serve_args(argv, prog="tokenmill serve")
    run_server(engine_kwargs, frontend)


def bench(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="tokenmill bench", description="Benchmark a server or the engine.")
    sub = p.add_subparsers(dest="bench_command", metavar="{serve,throughput,latency}")
    serve_p = sub.add_parser("serve", help="Online benchmark against a running OpenAI-compatible server.")
    for name, help in _OFFLINE_BENCH.items():
        sub.add_parser(name, help=help, add_help=False)
    if argv and argv[0] in _OFFLINE_BENCH:
        # These take every engine flag of `tokenmill serve` besides their own, so they parse their own argv.
        import importlib
        module = importlib.import_module(f"tokenmill.benchmarks.{argv[0]}")
        sys.argv[0] = f"tokenmill bench {argv[0]}"
        module.main(argv[1:])
        return 0
    if argv and argv[0] == "serve":
        try:
            from tokenmill.benchmarks import serve as bench_serve
        except ImportError as e:
            print(f"tokenmill bench serve is not available: {e}", file=sys.stderr)
            return 2
        bench_serve.add_cli_args(serve_p)
        args = p.parse_args(argv)
        try:
            result = bench_serve.main(args)
        except (RuntimeError, ValueError, OSError) as e:
            print(f"tokenmill bench serve: {e}", file=sys.stderr)
            return 1
        return result if isinstance(result, int) else 0
    p.parse_args(argv)
    p.print_help()
    return 2


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
