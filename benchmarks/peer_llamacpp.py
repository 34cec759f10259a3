"""pagefleet against llama.cpp's own server on the same GGUF file, one server at a time.

    python -m benchmarks.peer_llamacpp                                  # both, concurrency 1, 4, 16
    python -m benchmarks.peer_llamacpp --peer none --model builtin --quick   # pagefleet alone (smoke)

llama.cpp's `llama-server` is built from the sources that the `llama-cpp-python` source
distribution vendors (`--llamacpp-version`, default 0.3.36), with cmake, `-march=native`
(GGML_NATIVE), into a cache folder (`--cache-dir`, default ~/.cache/pagefleet/llamacpp): a build
already there is reused, a missing source distribution is fetched with `pip download`. None of
it is part of pagefleet's install or CI; it takes minutes once.

Both servers get the same threads (`--threads`, default 2: llama.cpp's `-t`/`-tb`, torch's
through OMP_NUM_THREADS), the same slots (`--slots`: llama.cpp's `-np`, pagefleet's
`--max-num-seqs`) and the same KV tokens (`--kv-tokens`: llama.cpp's `-c` over one unified KV
buffer, pagefleet's `--num-blocks` x 16), on 127.0.0.1. llama.cpp runs with continuous batching
and its prompt cache (its defaults: `--cache-prompt`, `--cache-ram`); pagefleet with its
defaults (the GGUF's layers kept in 4 bits, bf16 activations where the CPU has bf16 units).

The workload is the research-assistant trace (benchmarks/workloads.py): 4 documents of 600 to
1,500 tokens with 4 questions each and 4 short chats, 32 output tokens each (EOS ignored),
greedy; prompts as token ids, so both servers compute exactly the same tokens. One OpenAI
streaming client (`openai.AsyncOpenAI`, `/v1/completions`) sends it closed loop: `concurrency`
requests in flight, the next in trace order sent as one ends. Each (server, concurrency) run
starts a fresh server (no cache carried over), warms it with two unrelated requests, then
sends the trace; for each concurrency llama.cpp runs first, then pagefleet, so their ratio is
taken minutes apart on the same machine (`--rounds` repeats the whole interleaving).

One JSON line per server and concurrency: output tokens/s over the run, TTFT p50/p99 (and p50
of the questions on a document asked before: `ttft_repeat_ms_p50`), TPOT p50/p99 (per request:
the time after its first token over the tokens after it), prompt and cached prompt tokens as
each server's usage reports them. pagefleet's line carries `vs_llamacpp`: its figures over the
llama.cpp line's of the same round and concurrency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.workloads import BenchRequest, ResearchWorkload, research_requests  # noqa: E402
from tests.redis_server import free_port  # noqa: E402
from tests.serve_process import start_serve  # noqa: E402
from worker.model_source import resolve_model  # noqa: E402

CACHE = Path.home() / ".cache" / "pagefleet" / "llamacpp"
SERVERS = ("llamacpp", "pagefleet")


# --- llama.cpp's server: built once into the cache ---------------------------------------------


def llama_server_binary(cache: Path, version: str) -> Path:
    """`llama-server` built from llama-cpp-python `version`'s vendored llama.cpp, under `cache`:
    reused when present, else built (and the source distribution fetched when absent)."""
    binary = cache / f"build-{version}" / "bin" / "llama-server"
    if binary.is_file():
        return binary
    src = cache / f"llama_cpp_python-{version}"
    if not (src / "vendor" / "llama.cpp" / "CMakeLists.txt").is_file():
        sdist = cache / f"llama_cpp_python-{version}.tar.gz"
        if not sdist.is_file():
            progress(f"fetching the llama-cpp-python {version} source distribution into {cache}")
            cache.mkdir(parents=True, exist_ok=True)
            pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(cache)]
            subprocess.run([*pip, f"llama-cpp-python=={version}"], check=True)
        with tarfile.open(sdist) as tar:
            tar.extractall(cache, filter="data")
    build = binary.parent.parent
    progress(f"building llama-server into {build} (-march=native; a few minutes, once)")
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    subprocess.run(
        [
            "cmake",
            "-S",
            str(src / "vendor" / "llama.cpp"),
            "-B",
            str(build),
            *generator,
            "-DCMAKE_BUILD_TYPE=Release",
            "-DGGML_NATIVE=ON",  # -march=native
            "-DLLAMA_BUILD_SERVER=ON",
            "-DLLAMA_BUILD_TESTS=OFF",
            "-DLLAMA_BUILD_EXAMPLES=OFF",
            "-DLLAMA_CURL=OFF",
            "-DBUILD_SHARED_LIBS=OFF",
        ],
        check=True,
    )
    subprocess.run(
        ["cmake", "--build", str(build), "--target", "llama-server", "-j", str(os.cpu_count() or 2)], check=True
    )
    return binary


def progress(message: str) -> None:
    print(f"[peer_llamacpp] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Setup:
    """What both servers are given alike."""

    model: str  # the resolved path: a GGUF file (or the built-in model's directory, pagefleet only)
    threads: int
    slots: int
    kv_tokens: int
    max_model_len: int


class Server:
    """A running server's process and its OpenAI base URL; stops it on exit."""

    def __init__(self, name: str, proc: subprocess.Popen, base_url: str, log: Path, closer=None) -> None:
        self.name, self.proc, self.base_url, self.log, self.closer = name, proc, base_url, log, closer

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        if self.closer:
            self.closer()
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)


def start_llamacpp(binary: Path, setup: Setup, log: Path) -> Server:
    """llama-server on 127.0.0.1, once its /health answers 200."""
    port = free_port()
    args = [str(binary), "-m", setup.model, "--host", "127.0.0.1", "--port", str(port)]
    args += ["-t", str(setup.threads), "-tb", str(setup.threads), "-np", str(setup.slots)]
    args += ["-c", str(setup.kv_tokens), "--kv-unified", "--cont-batching", "--cache-prompt"]
    with open(log, "w") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    server = Server("llamacpp", proc, f"http://127.0.0.1:{port}/v1", log)
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            server.__exit__()
            raise RuntimeError("llama-server not ready after 300 s")
        time.sleep(0.2)


def start_pagefleet(setup: Setup, log: Path) -> Server:
    """`pagefleet serve` with its defaults, the same slots, KV tokens and threads."""
    http_port = free_port()
    flags = [
        "--model",
        setup.model,
        f"--http-port={http_port}",
        "--no-metrics",
        "--grace=1",
        f"--max-num-seqs={setup.slots}",
        f"--num-blocks={setup.kv_tokens // 16}",
        "--block-size=16",
        f"--max-model-len={setup.max_model_len}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(setup.threads)}
    proc, client = start_serve(flags, free_port(), log, 300, env=env)
    return Server("pagefleet", proc, f"http://127.0.0.1:{http_port}/v1", log, client.close)


# --- the client ---------------------------------------------------------------------------------


@dataclass
class Sample:
    """One request as the client saw it."""

    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    repeat: bool = False  # a question on a document an earlier request of the trace asked about
    error: str | None = None


async def one(client: openai.AsyncOpenAI, model: str, req: BenchRequest, repeat: bool) -> Sample:
    s, t0 = Sample(repeat=repeat), time.perf_counter()
    try:
        stream = await client.completions.create(
            model=model,
            prompt=list(req.prompt),
            max_tokens=req.max_tokens,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            if chunk.choices and not s.ttft:
                s.ttft = time.perf_counter() - t0
            if chunk.usage:
                s.output_tokens = chunk.usage.completion_tokens
                s.prompt_tokens = chunk.usage.prompt_tokens
                details = chunk.usage.prompt_tokens_details
                s.cached_tokens = (details.cached_tokens or 0) if details else 0
    except Exception as e:  # counted, not fatal: a benchmark reports what failed
        s.error = f"{type(e).__name__}: {e}"[:200]
    s.e2e = time.perf_counter() - t0
    return s


async def drive(base_url: str, trace: list[BenchRequest], concurrency: int) -> tuple[list[Sample], float]:
    """The trace, `concurrency` requests in flight (closed loop, in trace order); its samples
    and the makespan."""
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    http = httpx.AsyncClient(timeout=600, limits=limits)
    async with openai.AsyncOpenAI(base_url=base_url, api_key="none", http_client=http, max_retries=0) as client:
        model = (await client.models.list()).data[0].id
        seen, repeats = set(), []
        for r in trace:
            repeats.append(r.doc >= 0 and r.doc in seen)
            seen.add(r.doc)
        queue = list(zip(trace, repeats, strict=True))[::-1]
        samples: list[Sample] = []

        async def worker() -> None:
            while queue:
                req, repeat = queue.pop()
                samples.append(await one(client, model, req, repeat))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return samples, time.perf_counter() - start


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3, 2)


def summarize(server: str, concurrency: int, samples: list[Sample], makespan: float, setup: Setup) -> dict:
    ok = [s for s in samples if s.error is None and s.ttft]
    tpot = [(s.e2e - s.ttft) / (s.output_tokens - 1) for s in ok if s.output_tokens > 1]
    line = {
        "bench": "peer_llamacpp",
        "server": server,
        "concurrency": concurrency,
        "requests": len(samples),
        "errors": len(samples) - len(ok),
        "output_tok_s": round(sum(s.output_tokens for s in ok) / makespan, 2),
        "ttft_ms_p50": pct([s.ttft for s in ok], 0.5),
        "ttft_ms_p99": pct([s.ttft for s in ok], 0.99),
        "ttft_repeat_ms_p50": pct([s.ttft for s in ok if s.repeat], 0.5),
        "tpot_ms_p50": pct(tpot, 0.5),
        "tpot_ms_p99": pct(tpot, 0.99),
        "prompt_tokens": sum(s.prompt_tokens for s in ok),
        "cached_prompt_tokens": sum(s.cached_tokens for s in ok),
        "output_tokens": sum(s.output_tokens for s in ok),
        "threads": setup.threads,
        "slots": setup.slots,
        "kv_tokens": setup.kv_tokens,
    }
    errors = [s.error for s in samples if s.error]
    if errors:
        line["first_error"] = errors[0]
    return line


def compare(ours: dict, peer: dict) -> dict:
    """pagefleet's figures over llama.cpp's (same round, same concurrency)."""
    keys = ("output_tok_s", "ttft_ms_p50", "ttft_repeat_ms_p50", "tpot_ms_p50", "tpot_ms_p99", "cached_prompt_tokens")
    return {k: round(ours[k] / peer[k], 3) for k in keys if ours.get(k) and peer.get(k)}


def workload(quick: bool, vocab: int, seed: int) -> list[BenchRequest]:
    if quick:
        shape = ResearchWorkload(2, (64, 96), 2, (8, 16), 1, (8, 16), (4, 4), vocab, seed)
    else:
        shape = ResearchWorkload(4, (600, 1500), 4, (16, 48), 4, (16, 64), (32, 32), vocab, seed)
    return research_requests(shape)


def vocab_size(model: str) -> int:
    """The model's vocabulary: a GGUF file's token list, or a directory's config.json."""
    if model.lower().endswith(".gguf"):
        from gguf import GGUFReader

        return len(GGUFReader(model).fields["tokenizer.ggml.tokens"].data)
    return json.loads((Path(model) / "config.json").read_text())["vocab_size"]


def run_one(name: str, setup: Setup, binary: Path | None, trace, warm, concurrency: int, tmp: Path) -> dict:
    log = tmp / f"{name}-{concurrency}.log"
    server = start_llamacpp(binary, setup, log) if name == "llamacpp" else start_pagefleet(setup, log)
    with server:
        asyncio.run(drive(server.base_url, warm, 2))
        samples, makespan = asyncio.run(drive(server.base_url, trace, concurrency))
    return summarize(name, concurrency, samples, makespan, setup)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="a .gguf file, builtin (with --peer none), or the default model")
    p.add_argument("--peer", choices=("llamacpp", "none"), default="llamacpp")
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--kv-tokens", type=int, default=32768, help="KV tokens of each server (a multiple of 16)")
    p.add_argument("--rounds", type=int, default=1, help="repeat the interleaved runs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="a tiny trace (smoke)")
    p.add_argument("--cache-dir", type=Path, default=CACHE)
    p.add_argument("--llamacpp-version", default="0.3.36", help="the llama-cpp-python release whose sources to build")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # (stopped: the running server stops too)
    model = resolve_model(args.model)
    if args.peer == "llamacpp" and not model.lower().endswith(".gguf"):
        raise SystemExit(f"--model must be a GGUF file for llama.cpp (got {model}); --peer none runs pagefleet alone")
    binary = llama_server_binary(args.cache_dir, args.llamacpp_version) if args.peer == "llamacpp" else None
    setup = Setup(model, args.threads, args.slots, args.kv_tokens, 2048)
    vocab = vocab_size(model)
    trace = workload(args.quick, vocab, args.seed)
    warm = workload(True, vocab, args.seed + 1000)[:2]
    names = SERVERS if args.peer == "llamacpp" else ("pagefleet",)
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for concurrency in (int(c) for c in args.concurrency.split(",")):
                by_server = {}
                for name in names:
                    line = run_one(name, setup, binary, trace, warm, concurrency, Path(tmp))
                    line["round"] = round_
                    if name == "pagefleet" and "llamacpp" in by_server:
                        line["vs_llamacpp"] = compare(line, by_server["llamacpp"])
                    by_server[name] = line
                    print(json.dumps(line), flush=True)
                    lines.append(line)
    return lines


if __name__ == "__main__":
    main(sys.argv[1:])
