"""End-to-end serving throughput: N concurrent streaming chat requests through `fuzzyspec serve`.

Starts the server in this process on a free local port (embedded target + shipped draft LM), then for
each concurrency C sends C requests at once through the official `openai` client (streaming, greedy,
M tokens each, held-out ShareGPT prompts) and reports aggregate tokens/s, the mean time to first token
and the mean request latency. Each method runs as a separate round: the server's per-request `method`
and `fsd_threshold` choose it.

Usage: python benchmarks/bench_server.py [--concurrency 1,4,16] [--max-tokens 64] [--methods ar,sd,fsd]
           [--threshold 0.5] [--threads 2]
"""
from __future__ import annotations

import argparse
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import torch
import uvicorn

from fuzzyspec.api import ModelPair
from fuzzyspec.serve.app import ServeConfig, Server, create_app
from fuzzyspec.eval.tasks import get_task


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--methods", default="ar,sd,fsd")
    parser.add_argument("--threshold", type=float, default=0.5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    pair = ModelPair.load()
    server = Server(pair, ServeConfig(model_name="m", defaults={"temperature": 0.0, "max_new_tokens": 256},
                                      max_batch=16))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    running = uvicorn.Server(uvicorn.Config(create_app(server), host="127.0.0.1", port=port, log_level="error"))
    threading.Thread(target=running.run, daemon=True).start()
    while not running.started:
        time.sleep(0.05)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
    levels = [int(c) for c in args.concurrency.split(",")]
    prompts = [e.prompt for e in get_task("freeform").examples(max(levels))]

    def ask(prompt: str, method: str) -> tuple[int, float, float]:
        start, first, tokens = time.perf_counter(), None, 0
        stream = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": prompt}], max_tokens=args.max_tokens, temperature=0,
            stream=True, stream_options={"include_usage": True},
            extra_body={"method": method, "fsd_threshold": args.threshold})
        for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter() - start
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return tokens, first or 0.0, time.perf_counter() - start

    ask(prompts[0], "sd")  # warm-up
    print(f"fuzzyspec bench_server: SmolLM2-135M-Instruct + shipped draft LM over HTTP, streaming chat, greedy, "
          f"{args.max_tokens} tokens max, bfloat16, {args.threads} threads, torch {torch.__version__}")
    print(f"{'method':<8} {'clients':>7} {'tok/s':>8} {'first token s':>14} {'latency s':>10}")
    for method in args.methods.split(","):
        for level in levels:
            began = time.perf_counter()
            with ThreadPoolExecutor(level) as pool:
                results = list(pool.map(lambda p: ask(p, method), prompts[:level]))
            wall = time.perf_counter() - began
            tokens = sum(r[0] for r in results)
            print(f"{method:<8} {level:>7} {tokens / wall:>8.1f} {sum(r[1] for r in results) / level:>14.2f} "
                  f"{sum(r[2] for r in results) / level:>10.2f}", flush=True)
    running.should_exit = True


if __name__ == "__main__":
    main()
