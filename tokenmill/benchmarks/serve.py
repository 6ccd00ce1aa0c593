"""`tokenmill bench serve`: an online-serving load generator for any OpenAI-compatible server.

Contract (mirrors `vllm bench serve` so numbers and flags are comparable):
  * `add_cli_args(parser)` registers vLLM's flag names and defaults; `main(args)` runs the benchmark,
    prints vLLM's result block and returns the result dict (the same dict `--save-result` writes).
  * Only the `random` dataset exists: prompts are uniformly sampled vocabulary ids, decoded to text and
    re-encoded until they have the requested token length; requests carry `ignore_eos: true` so every
    request produces exactly its `max_tokens`.
  * Requests stream (`stream: true`, `stream_options.include_usage`). TTFT = time to the first chunk with
    content, ITL = gaps between content chunks, E2EL = whole request, TPOT = (E2EL - TTFT) / (out - 1).
    Output token counts come from the final usage block (fallback: number of content chunks).
  * `--structured-output-ratio R` gives that fraction of the requests, interleaved with the others, an output
    constraint (structured_dataset.py says which and how it is sent); the report then adds TTFT/TPOT/ITL for the
    structured and the free requests apart, and structured median TPOT / free median TPOT.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import httpx
import numpy as np

from tokenmill import envs
from tokenmill.benchmarks import structured_dataset as sd
from tokenmill.benchmarks.serve_metrics import (METRIC_HEADERS, RequestOutput, compute_metrics, format_report,
                                                format_split_report, split_metrics)

DEFAULT_VOCAB_SIZE = 32000
# Long enough that a slow server at high load is measured instead of cut off (vLLM uses 6 hours too).
REQUEST_TIMEOUT_S = 6 * 60 * 60
BACKEND_ENDPOINTS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}

_EPILOG = """\
Tokenizer: with --tokenizer (a local directory or cached HF id) prompts are built with that transformers
tokenizer. Without it the served model's tokenizer is used through the server's POST /tokenize and
POST /detokenize; the vocabulary size then comes from GET /tokenizer_info when the server offers it
(key 'vocab_size', special ids from 'added_tokens_decoder'), else %d is assumed - pass --tokenizer for
models with a smaller vocabulary.""" % DEFAULT_VOCAB_SIZE


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Register the `bench serve` flags on `parser` (vLLM's names and defaults)."""
    parser.epilog = _EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    add = parser.add_argument
    add("--backend", default="openai", choices=sorted(BACKEND_ENDPOINTS),
        help="openai: /v1/completions; openai-chat: /v1/chat/completions.")
    add("--base-url", default=None, help="Server URL (e.g. http://host:8000); overrides --host/--port.")
    add("--host", default="127.0.0.1")
    add("--port", type=int, default=8000)
    add("--endpoint", default=None,
        help="API path (default: /v1/completions, or /v1/chat/completions for --backend openai-chat).")
    add("--model", default=None, help="Model name to send (default: the first entry of GET /v1/models).")
    add("--tokenizer", default=None, help="Local tokenizer for building prompts (default: the server's).")
    add("--trust-remote-code", action="store_true", help="Passed to AutoTokenizer for --tokenizer.")
    add("--dataset-name", default="random", help="Dataset; only 'random' is supported.")
    add("--random-input-len", type=int, default=1024, help="Prompt tokens per request (excl. prefix).")
    add("--random-output-len", type=int, default=128, help="Output tokens per request (max_tokens).")
    add("--random-range-ratio", type=float, default=0.0,
        help="Lengths are uniform in [len*(1-r), len*(1+r)]; 0 <= r < 1.")
    add("--random-prefix-len", type=int, default=0, help="Random prefix tokens shared by all prompts.")
    add("--num-prompts", type=int, default=1000)
    add("--request-rate", type=float, default=float("inf"),
        help="Requests per second; inf sends all at once, otherwise arrivals are Poisson/gamma.")
    add("--burstiness", type=float, default=1.0,
        help="Gamma shape of inter-arrival times: 1 = Poisson, <1 burstier, >1 more uniform.")
    add("--max-concurrency", type=int, default=None, help="Cap on requests in flight.")
    add("--seed", type=int, default=0)
    add("--ignore-eos", action="store_true",
        help="Send ignore_eos=true (always done for the random dataset).")
    add("--temperature", type=float, default=None, help="Sampling temperature (default 0: greedy).")
    add("--top-p", type=float, default=None)
    add("--top-k", type=int, default=None)
    add("--api-key", default=None, help="Bearer token (default: $OPENAI_API_KEY).")
    add("--structured-output-ratio", type=float, default=0.0,
        help="Fraction of requests (0..1, spread evenly through the run) that carry an output constraint; "
             "the report then splits TTFT/TPOT/ITL into structured and free requests.")
    add("--structured-output-kind", default=None, choices=sd.KINDS,
        help="Constraint of the structured requests (default json): json = a set of JSON schemas (nested "
             "objects, arrays, enums, bounded numbers), regex = a set of regular expressions, choice = lists of "
             "choices. Sent as structured_outputs, or response_format json_schema for chat + json.")
    add("--structured-output-disable-any-whitespace", action="store_true",
        help="Send structured_outputs.disable_any_whitespace=true (compact JSON; chat + json then uses "
             "structured_outputs, since response_format has no such option).")
    add("--replay-output-lens", default=None, metavar="RESULT_JSON",
        help="Give request i the max_tokens (with ignore_eos) of request i in an earlier run's result JSON (its "
             "output_lens): with the same --seed and prompts, a run with --structured-output-ratio 0 then has the "
             "same arrivals and departures as the structured run it replays, without the constraints, which is "
             "the fair baseline for the constraints' cost.")
    add("--save-result", action="store_true", help="Write the result JSON.")
    add("--result-dir", default=None, help="Directory for the result JSON (default: cwd).")
    add("--result-filename", default=None,
        help="Default: {backend}-{rate}qps[-concurrency{n}]-{model}-{YYYYMMDD-HHMMSS}.json")
    add("--output-json", default=None, metavar="PATH",
        help="Also write the result JSON to this path (the same dict as --save-result).")
    add("--metadata", metavar="KEY=VALUE", nargs="*", default=None, help="Extra fields for the result JSON.")
    add("--percentile-metrics", default="ttft,tpot,itl", help="Comma list of ttft,tpot,itl,e2el to print.")
    add("--metric-percentiles", default="99", help="Comma list of percentiles, e.g. 25,50,99.")
    add("--disable-tqdm", action="store_true")


# ---------------------------------------------------------------------------------------------- prompts
@dataclass
class SampleRequest:
    prompt: str
    prompt_len: int
    output_len: int


class LocalTokenizer:
    """A transformers tokenizer; special tokens are excluded from the sampling pool."""

    def __init__(self, name: str, trust_remote_code: bool = False):
        from transformers import AutoTokenizer
        self.tok = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
        special = set(self.tok.all_special_ids)
        self.pool = np.array([i for i in range(len(self.tok)) if i not in special], dtype=np.int64)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)


class ServerTokenizer:
    """The served model's tokenizer through POST /tokenize and /detokenize (thread-safe)."""

    def __init__(self, base_url: str, model: str, headers: dict[str, str]):
        self.client = httpx.Client(base_url=base_url, headers=headers, timeout=60)
        self.model = model
        vocab, special = DEFAULT_VOCAB_SIZE, set()
        try:
            resp = self.client.get("/tokenizer_info")
            info = resp.json() if resp.status_code == 200 else {}
        except (httpx.HTTPError, ValueError):
            info = {}
        if isinstance(info.get("vocab_size"), int) and info["vocab_size"] > 0:
            vocab = info["vocab_size"]
        for tid, tok in (info.get("added_tokens_decoder") or {}).items():
            if isinstance(tok, dict) and tok.get("special") and str(tid).isdigit():
                special.add(int(tid))
        self.pool = np.array([i for i in range(vocab) if i not in special], dtype=np.int64)

    def _post(self, path: str, body: dict) -> dict:
        resp = self.client.post(path, json={"model": self.model, **body})
        if resp.status_code != 200:
            raise RuntimeError(f"POST {path} failed with HTTP {resp.status_code}: {resp.text[:300]} "
                               "(pass --tokenizer to build prompts locally)")
        return resp.json()

    def encode(self, text: str) -> list[int]:
        return self._post("/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"]

    def decode(self, ids: list[int]) -> str:
        return self._post("/detokenize", {"tokens": ids})["prompt"]

    def close(self) -> None:
        self.client.close()


def _uniform_lens(rng: np.random.Generator, length: int, ratio: float, n: int, minimum: int) -> np.ndarray:
    low, high = int(length * (1 - ratio)), int(length * (1 + ratio))
    return np.maximum(rng.integers(low, high + 1, size=n), minimum)


def sample_random_requests(tokenizer, num_prompts: int, input_len: int, output_len: int,
                           range_ratio: float, prefix_len: int, seed: int) -> list[SampleRequest]:
    """Build `num_prompts` random text prompts of about prefix_len + input_len tokens.

    Deterministic for a seed: each prompt draws from its own generator, so the thread pool that
    overlaps the tokenizer round trips cannot change the result.
    """
    rng = np.random.default_rng(seed)
    pool = tokenizer.pool
    prefix = pool[rng.integers(0, len(pool), size=prefix_len)].tolist()
    in_lens = _uniform_lens(rng, input_len, range_ratio, num_prompts, 0 if prefix_len else 1)
    out_lens = _uniform_lens(rng, output_len, range_ratio, num_prompts, 1)

    def build(i: int) -> SampleRequest:
        prng = np.random.default_rng([seed, i])
        target = prefix_len + int(in_lens[i])
        ids = prefix + pool[prng.integers(0, len(pool), size=int(in_lens[i]))].tolist()
        # decode -> encode is not an identity (tokens merge or split at word boundaries), so re-fit
        # the ids a few times until the *text* we send has the requested token length.
        for _ in range(8):
            text = tokenizer.decode(ids)
            got = tokenizer.encode(text)
            if len(got) == target:
                break
            ids = got[:target] if len(got) > target else \
                got + pool[prng.integers(0, len(pool), size=target - len(got))].tolist()
        return SampleRequest(text, len(got), int(out_lens[i]))

    with ThreadPoolExecutor(max_workers=16) as ex:
        return list(ex.map(build, range(num_prompts)))


# --------------------------------------------------------------------------------------------- requests
def _build_payload(backend: str, model: str, req: SampleRequest, ignore_eos: bool,
                   sampling: dict[str, Any]) -> dict[str, Any]:
    payload: dict[str, Any] = {"model": model, "stream": True, "stream_options": {"include_usage": True}}
    if backend == "openai-chat":
        payload["messages"] = [{"role": "user", "content": req.prompt}]
        payload["max_completion_tokens"] = req.output_len
    else:
        payload["prompt"] = req.prompt
        payload["max_tokens"] = req.output_len
    if ignore_eos:
        payload["ignore_eos"] = True
    payload.update(sampling)
    return payload


def _chunk_text(choice: dict) -> str:
    if "text" in choice:  # completions
        return choice.get("text") or ""
    delta = choice.get("delta") or {}  # chat; reasoning models stream thoughts first, which are tokens too
    return delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") or ""


def _is_token_chunk(choices: list) -> bool:
    """Whether a stream chunk reports generated tokens. A completions chunk is sent per step that produced
    tokens, and its text may be empty (a token that completes no character yet), as vLLM's benchmark counts it;
    a chat chunk counts once it carries content (the first one carries only the role)."""
    for c in choices:
        if _chunk_text(c) or ("text" in c and c.get("finish_reason") is None):
            return True
    return False


async def send_request(client: httpx.AsyncClient, url: str, payload: dict, prompt_len: int) -> RequestOutput:
    """Stream one request; never raises - failures come back with success=False and `error` set."""
    out = RequestOutput(prompt_len=prompt_len)
    pieces: list[str] = []
    usage_tokens = None
    start = last = out.start_time = time.perf_counter()
    try:
        async with client.stream("POST", url, json=payload) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                raise RuntimeError(f"HTTP {resp.status_code}: {body[:500]}")
            async for line in resp.aiter_lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    raise RuntimeError(f"stream error: {chunk['error']}")
                now = time.perf_counter()
                choices = chunk.get("choices") or []
                if _is_token_chunk(choices):
                    text = "".join(_chunk_text(c) for c in choices)
                    if not pieces:
                        out.ttft = now - start
                    else:
                        out.itl.append(now - last)
                    last = now
                    pieces.append(text)
                    out.chunk_times.append(now)
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
        out.latency = time.perf_counter() - start
        if not pieces:
            raise RuntimeError("no token chunk received (cannot measure TTFT)")
        out.generated_text = "".join(pieces)  # one piece per token chunk, possibly empty
        out.output_tokens = usage_tokens if usage_tokens is not None else len(pieces)
        out.success = True
    except Exception as e:  # noqa: BLE001 - every failure is a failed request, not a crashed benchmark
        out.latency = time.perf_counter() - start
        out.error = f"{type(e).__name__}: {e}" if not isinstance(e, RuntimeError) else str(e)
    return out


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> np.ndarray:
    """Send times (s from start): all 0 for rate=inf, else cumulative gamma(shape=burstiness) gaps
    with mean 1/rate (burstiness 1 = exponential gaps = Poisson arrivals). First request at 0."""
    if rate == float("inf"):
        return np.zeros(n)
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (rate * burstiness), size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps)


async def run_benchmark(url: str, requests: list[SampleRequest], payloads: list[dict], headers: dict,
                        rate: float, burstiness: float, max_concurrency: int | None, seed: int,
                        disable_tqdm: bool) -> tuple[list[RequestOutput], float, float]:
    """Send every payload on its arrival schedule; returns (outputs, duration_s, perf_counter start)."""
    # httpx pools at most 100 connections by default, which would silently cap concurrency.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=60)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    pbar = None
    if not disable_tqdm:
        from tqdm import tqdm
        pbar = tqdm(total=len(requests))
    offsets = arrival_offsets(len(requests), rate, burstiness, seed)

    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout) as client:
        async def one(i: int) -> RequestOutput:
            if sem is None:
                out = await send_request(client, url, payloads[i], requests[i].prompt_len)
            else:
                async with sem:
                    out = await send_request(client, url, payloads[i], requests[i].prompt_len)
            if pbar is not None:
                pbar.update(1)
            return out

        t0 = time.perf_counter()
        tasks = []
        for i in range(len(requests)):
            # Sleep to an absolute schedule so that per-iteration overhead does not drift the rate.
            delay = t0 + offsets[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i)))
        outputs = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    if pbar is not None:
        pbar.close()
    return list(outputs), duration, t0


# ------------------------------------------------------------------------------------------------- main
def _validate(args: argparse.Namespace) -> tuple[list[str], list[float], dict[str, str]]:
    if args.dataset_name != "random":
        raise ValueError(f"--dataset-name {args.dataset_name!r} is not supported by tokenmill bench serve; "
                         "only 'random' is available.")
    if not 0.0 <= args.random_range_ratio < 1.0:
        raise ValueError("--random-range-ratio must be in [0, 1).")
    if args.num_prompts < 1 or args.random_input_len < 0 or args.random_output_len < 1 \
            or args.random_prefix_len < 0 or args.random_prefix_len + args.random_input_len < 1:
        raise ValueError("--num-prompts and --random-output-len must be >= 1 and the prompt non-empty.")
    if args.request_rate <= 0 or args.burstiness <= 0:
        raise ValueError("--request-rate and --burstiness must be > 0.")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1.")
    metrics = [s.strip() for s in args.percentile_metrics.split(",") if s.strip()]
    if bad := [s for s in metrics if s not in METRIC_HEADERS]:
        raise ValueError(f"Unknown --percentile-metrics {bad}; choose from {', '.join(METRIC_HEADERS)}.")
    try:
        percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    except ValueError:
        raise ValueError("--metric-percentiles must be a comma list of numbers.") from None
    if any(not 0 <= p <= 100 for p in percentiles):
        raise ValueError("--metric-percentiles must be within [0, 100].")
    if args.structured_output_ratio == 0.0:
        given = [f for f, v in (("--structured-output-kind", args.structured_output_kind),
                                ("--structured-output-disable-any-whitespace",
                                 args.structured_output_disable_any_whitespace)) if v]
        if given:
            raise ValueError(f"{' and '.join(given)} {'need' if len(given) > 1 else 'needs'} "
                             "--structured-output-ratio > 0.")
    sd.structured_flags(1, args.structured_output_ratio)  # raises for a ratio outside [0, 1]
    metadata = {}
    for item in args.metadata or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--metadata expects KEY=VALUE, got {item!r}.")
        metadata[key] = value
    return metrics, percentiles, metadata


def main(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark described by `args` (see add_cli_args); print the report; return the result dict.

    Raises ValueError for invalid arguments and RuntimeError when the server cannot be queried for the
    model name or tokenizer. Failed benchmark requests do not raise: they are counted in `failed`.
    """
    metrics, percentiles, metadata = _validate(args)
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    url = base_url + (args.endpoint or BACKEND_ENDPOINTS[args.backend])
    api_key = args.api_key or envs.OPENAI_API_KEY
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    model = args.model
    if model is None:
        try:
            resp = httpx.get(base_url + "/v1/models", headers=headers, timeout=30)
            resp.raise_for_status()
            model = resp.json()["data"][0]["id"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
            raise RuntimeError(f"Could not get the model name from {base_url}/v1/models ({e}); "
                               "pass --model.") from e

    if args.tokenizer:
        tokenizer = LocalTokenizer(args.tokenizer, args.trust_remote_code)
    else:
        tokenizer = ServerTokenizer(base_url, model, headers)
    try:
        requests = sample_random_requests(tokenizer, args.num_prompts, args.random_input_len,
                                          args.random_output_len, args.random_range_ratio,
                                          args.random_prefix_len, args.seed)
    finally:
        if isinstance(tokenizer, ServerTokenizer):
            tokenizer.close()

    if args.replay_output_lens:
        with open(args.replay_output_lens) as f:
            lens = json.load(f).get("output_lens")
        if not isinstance(lens, list) or len(lens) != len(requests):
            raise ValueError(f"--replay-output-lens: {args.replay_output_lens} holds no output_lens list of "
                             f"{len(requests)} entries (one per prompt of this run).")
        requests = [dataclasses.replace(r, output_len=max(1, int(n))) for r, n in zip(requests, lens)]
    sampling = {"temperature": 0.0 if args.temperature is None else args.temperature}  # greedy, as vLLM
    if args.top_p is not None:
        sampling["top_p"] = args.top_p
    if args.top_k is not None:
        sampling["top_k"] = args.top_k
    # vLLM's random dataset always asks for ignore_eos so every request generates its full output length.
    ignore_eos = args.ignore_eos or args.dataset_name == "random"
    payloads = [_build_payload(args.backend, model, r, ignore_eos, sampling) for r in requests]
    kind = args.structured_output_kind or "json"
    structured = sd.structured_flags(len(requests), args.structured_output_ratio)
    specs: list[Any] = [None] * len(requests)
    for k, i in enumerate(i for i, s in enumerate(structured) if s):
        specs[i] = sd.constraint_for(kind, k)
        sd.add_constraint(payloads[i], args.backend, kind, specs[i], k,
                          args.structured_output_disable_any_whitespace)

    dist = "Poisson process" if args.burstiness == 1.0 else "Gamma distribution"
    print(f"Traffic request rate: {args.request_rate}")
    print(f"Burstiness factor: {args.burstiness} ({dist})")
    print(f"Maximum request concurrency: {args.max_concurrency}")
    outputs, duration, t0 = asyncio.run(run_benchmark(
        url, requests, payloads, headers, args.request_rate, args.burstiness, args.max_concurrency,
        args.seed, args.disable_tqdm))

    m = compute_metrics(outputs, duration, t0, percentiles)
    if m["failed"]:
        first = next(o.error for o in outputs if not o.success)
        print(f"{m['failed']} request(s) failed; first error: {first}", file=sys.stderr)
    print(format_report(m, args.max_concurrency, args.request_rate, metrics, percentiles))
    split: dict[str, Any] = {}
    valid: list[bool | None] = [None] * len(outputs)
    if any(structured):
        valid = [sd.answer_is_valid(kind, spec, o.generated_text) if s and o.success else None
                 for o, s, spec in zip(outputs, structured, specs)]
        split = split_metrics(outputs, structured, valid, duration, t0, percentiles)
        split.update(structured_output_ratio=args.structured_output_ratio, structured_output_kind=kind,
                     structured_flags=structured, structured_valid=valid)
        print(format_split_report(split, kind, metrics, percentiles))

    now = datetime.now()
    result: dict[str, Any] = {
        "date": now.strftime("%Y%m%d-%H%M%S"), "backend": args.backend, "endpoint_type": args.backend,
        "model_id": model, "tokenizer_id": args.tokenizer or model, "num_prompts": args.num_prompts,
        "request_rate": args.request_rate if args.request_rate != float("inf") else "inf",
        "burstiness": args.burstiness, "max_concurrency": args.max_concurrency, **metadata, **m,
        "input_lens": [o.prompt_len for o in outputs], "output_lens": [o.output_tokens for o in outputs],
        "ttfts": [o.ttft for o in outputs], "itls": [o.itl for o in outputs],
        "start_times": [o.start_time - t0 for o in outputs], "e2els": [o.latency for o in outputs],
        "generated_texts": [o.generated_text for o in outputs], "errors": [o.error for o in outputs], **split,
    }
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f)
        print(f"Result written to {args.output_json}")
    if args.save_result:
        name = args.result_filename
        if not name:
            conc = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
            name = f"{args.backend}-{args.request_rate}qps{conc}-{model.split('/')[-1]}-{result['date']}.json"
        path = os.path.join(args.result_dir, name) if args.result_dir else name
        if args.result_dir:
            os.makedirs(args.result_dir, exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f)
        print(f"Result saved to {path}")
    return result


def run_cli(argv: list[str] | None = None) -> int:
    """`tokenmill bench serve ARGS`: 0 when the benchmark ran, 1 (with the reason on stderr) when it could not."""
    parser = argparse.ArgumentParser(prog="tokenmill bench serve", description=__doc__.splitlines()[0])
    add_cli_args(parser)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        main(args)
    except (RuntimeError, ValueError, OSError) as e:
        print(f"tokenmill bench serve: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(run_cli())
