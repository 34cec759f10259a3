"""The benchmark scripts run and print one well-formed JSON line per case (smoke sizes)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

import pytest

from benchmarks.oracles import BalancedOracle, CacheAwareThreshold, with_documents
from benchmarks.plot import PANEL_H
from benchmarks.traces import TraceConfig, TraceRequest, generate, read
from cluster.group import GroupStatus
from cluster.index import GroupMatch
from router.placement import PlacedShare, Placement

SVG = "{http://www.w3.org/2000/svg}"

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str, timeout: int = 300, stderr: list[str] | None = None) -> list[dict]:
    """The JSON lines a benchmark prints (its stderr's lines appended to `stderr`, if given)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=True,
    )
    if stderr is not None:
        stderr += out.stderr.splitlines()
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def test_block_manager_benchmark():
    cases = {c["case"]: c for c in run("benchmarks/block_manager.py", "--repeat", "2")}
    assert set(cases) == {"hash_tokens", "admit_free_8k", "schedule_step", "evict_8k"}
    assert cases["evict_8k"]["no_quota_us"] > 0 and cases["evict_8k"]["quota_us"] > 0
    assert cases["hash_tokens"]["ns_per_token"] > 0 and cases["hash_tokens"]["ratio_vs_peer"] > 0


def test_engine_benchmark_quick_agrees_with_transformers():
    lines = {c["system"]: c for c in run("benchmarks/engine.py", "--quick", "--dtype", "float32")}
    assert set(lines) == {"pagefleet", "generate_batch", "generate"}
    ours = lines["pagefleet"]
    assert ours["identical_tokens"] == {"generate_batch": 1.0, "generate": 1.0}
    assert ours["generated_tokens"] == lines["generate"]["generated_tokens"] > 0
    assert ours["ratio_vs_generate_batch"] > 0 and ours["prefix_hit_rate"] > 0
    # FLOP/s against the run's matmul peak: prefix hits spare pagefleet some of the work
    assert ours["matmul_peak_gflop_s"] > 0 and ours["dtype"] == "float32"
    assert 0 < ours["model_gflop"] < lines["generate"]["model_gflop"]
    for line in lines.values():
        assert line["gflop_s"] == pytest.approx(line["model_gflop"] / line["wall_s"], rel=0.01)
        assert line["peak_ratio"] == pytest.approx(line["gflop_s"] / line["matmul_peak_gflop_s"], rel=0.01)
    assert ours["prefill_steps"] >= 1 and ours["prefill_peak_ratio"] > 0


def test_cpu_attention_benchmark_smoke():
    lines = run("benchmarks/cpu_attention.py", "--repeat", "1", "--batch", "2")
    assert {(c["case"], c["dtype"]) for c in lines} == {
        (case, dtype)
        for case in ("decode_2x1000-1500", "prefill_1400", "prefill_600_after_800")
        for dtype in ("float32", "bfloat16")
    }
    for c in lines:  # the same attention as fused SDPA, to the dtype's rounding
        assert c["max_abs_diff"] < (1e-4 if c["dtype"] == "float32" else 5e-2), c
        assert c["pagefleet_ms"] > 0 and c["ratio_vs_fused_sdpa"] > 0


def test_decode_attention_benchmark_smoke():
    lines = run("benchmarks/decode_attention.py", "--repeat", "2", "--contexts", "20,300", "--batches", "1,3")
    assert {(c["dtype"], c["context"], c["batch"]) for c in lines} == {
        (dtype, context, batch) for dtype in ("bfloat16", "float32") for context in (20, 300) for batch in (1, 3)
    }
    for c in lines:
        for state in ("cold", "warm"):
            assert c[f"kernel_us_{state}"] > 0 and c[f"torch_us_{state}"] > 0
            ratio = c[f"kernel_us_{state}"] / c[f"torch_us_{state}"]  # (of the unrounded times)
            assert abs(c[f"kernel_vs_torch_{state}"] - ratio) < 0.01 * ratio + 1e-3


def test_kernels_benchmark_smoke():
    lines = run("benchmarks/kernels.py", "--smoke", "--kv-cache-dtype", "auto,int8,fp8_e4m3")
    assert lines and all(line["max_abs_err_vs_sdpa"] < 1e-3 for line in lines)
    decode = {c["kv_cache_dtype"]: c for c in lines if c["case"] == "decode"}
    assert set(decode) == {"float32", "int8", "fp8_e4m3"}  # without CUDA: float32 queries
    assert decode["fp8_e4m3"]["kv_bytes"] * 4 == decode["float32"]["kv_bytes"]
    assert decode["int8"]["kv_bytes"] * 4 > decode["float32"]["kv_bytes"] and "speedup_vs_16bit" in decode["int8"]


def test_routing_benchmark_smoke(tmp_path):
    trace = tmp_path / "trace.jsonl"
    run("-m", "benchmarks.traces", "--out", str(trace), "--groups", "2", "--blocks", "256", "--requests", "30")
    common = ("-m", "benchmarks.routing", "--trace", str(trace), "--groups", "2", "--blocks", "256")
    sim = {c["policy"]: c for c in run(*common, "--policy", "all", "--plot", str(tmp_path / "r.svg"))}
    assert list(sim) == [
        "least_loaded",
        "oracle",
        "prefix_aware",
        "prefix_hash",
        "round_robin",
        "oracle_balanced",
        "cache_aware_threshold",
    ]
    for case in sim.values():
        assert case["requests"] == 30 and 0 <= case["hit_rate"] <= 1
    # The plot: per policy (in the order printed), a bar per group for requests, then for
    # prefill tokens; the requests' bars are as tall as their counts, on one scale.
    svg = ET.parse(tmp_path / "r.svg").getroot()
    bars = svg.findall("{http://www.w3.org/2000/svg}rect[@class='bar']")
    assert len(bars) == 7 * 2 * 2
    counts = [v for c in sim.values() for v in c["requests_per_group"]["per_group"]]
    heights = [float(b.get("height")) for i in range(7) for b in bars[4 * i : 4 * i + 2]]
    assert max(heights) == pytest.approx(PANEL_H - 16, abs=0.1)
    ratios = [h / v for h, v in zip(heights, counts, strict=True) if v >= 5]
    assert ratios and max(ratios) / min(ratios) < 1.02
    titles = [t.text for t in svg.iter("{http://www.w3.org/2000/svg}text")]
    assert all(any(t.startswith(f"{name} ·") for t in titles) for name in sim)
    assert sim["oracle"]["hit_rate"] >= sim["round_robin"]["hit_rate"]
    (real,) = run(*common, "--policy", "prefix_aware", "--mode", "real", "--time-scale", "0.2")
    assert real["mode"] == "real" and real["requests"] == 30 and real["hit_rate"] > 0
    lines = run("-m", "benchmarks.routing", "--latency", "2", "--host-capacity", "1")
    assert [c["index"] for c in lines] == ["redis", "mirror", "memory"]
    for c in lines:  # with host tiers in the index: every group's, and the document on two
        assert c["decision_ms_p50_32k"] > 0 and c["hash_uncached_ms_p50_32k"] > 0
        assert c["host_blocks_per_group"] >= 2048


def trace_request(i: int, doc: str | None, doc_tokens: int = 0) -> TraceRequest:
    return TraceRequest(f"r{i}", i * 0.01, [1, 2, 3], None, 4, None, doc, doc_tokens)


def test_the_balanced_oracle_splits_a_hot_document_and_keeps_the_bound():
    """A document asked by half the requests of 4 groups gets two copies; every document's
    requests go to its copies; no group ends above the bound; a bad cap names the field."""
    docs = ["hot"] * 50 + ["a"] * 12 + ["b"] * 10 + ["c"] * 8 + [None] * 20
    trace = [trace_request(i, d, {"hot": 4000, "a": 3000}.get(d, 1000)) for i, d in enumerate(docs)]
    random.Random(0).shuffle(trace)
    groups = ["g0", "g1", "g2", "g3"]
    oracle = BalancedOracle.plan(trace, groups, cap=1.15)
    assert len(oracle.homes["hot"]) == 2 and len(set(oracle.homes["hot"])) == 2
    assert all(len(oracle.homes[d]) == 1 for d in "abc")
    assert not set(oracle.homes["a"]) & set(oracle.homes["hot"])  # the largest pools left
    statuses = dict.fromkeys(groups)
    placed = []
    for r in trace:
        oracle.expect(r.doc, 3)
        placed.append((r.doc, oracle.choose([b"x"], statuses, {}, PlacedShare()).group_id))
    assert all(g in oracle.homes[d] for d, g in placed if d is not None)
    per_group = Counter(g for _, g in placed)
    assert max(per_group.values()) <= 1.15 * len(trace) / len(groups)
    with pytest.raises(ValueError, match="cap"):
        BalancedOracle.plan(trace, groups, cap=0.9)


def test_engine_benchmark_kv_cache_dtypes_quick():
    """8-bit caches beside the 16-bit one at the same bytes: about twice the sequences."""
    lines = run("benchmarks/engine.py", "--quick", "--kv-cache-dtype", "int8,fp8_e4m3")
    by = {(c["case"], c["kv_cache_dtype"]): c for c in lines}
    assert set(by) == {(case, d) for case in ("throughput", "capacity") for d in ("bfloat16", "int8", "fp8_e4m3")}
    for d in ("int8", "fp8_e4m3"):
        run_, cap = by[("throughput", d)], by[("capacity", d)]
        assert run_["budget_bytes"] == by[("throughput", "bfloat16")]["budget_bytes"]
        assert by[("throughput", "bfloat16")]["kv_bytes_per_token"] >= 1.9 * run_["kv_bytes_per_token"]
        assert run_["gen_tok_s"] > 0 and run_["accuracy"]["greedy_prompts"] == 12
        assert (
            cap["admitted_at_once"]
            == cap["planned_sequences"]
            >= 1.9 * by[("capacity", "bfloat16")]["admitted_at_once"]
        )


def test_kv_accuracy_benchmark_smoke():
    from worker.model.builtin_model import builtin_model_path

    model = str(builtin_model_path())
    lines = run("benchmarks/kv_accuracy.py", "--model", model, "--tokens", "64", "--kv-cache-dtype", "int8")
    engine = {c["kv_cache_dtype"]: c for c in lines if c["case"] == "engine"}
    study = {c["granularity"]: c for c in lines if c["case"] == "granularity"}
    assert set(engine) == {"int8"} and len(study) == 6  # no fp8 engine: none of its scales
    # the engine's int8 cache is transformers' with per-token-and-head scales, to rounding
    assert engine["int8"]["ppl"] == pytest.approx(study["int8_per_token_head"]["ppl"], rel=1e-3)
    assert all(c["positions"] == 63 and c["kl_mean"] >= 0 for c in lines)


def test_decode_bound_benchmark_counts_fewer_weight_bytes_per_format():
    lines = run(
        "-m", "benchmarks.decode_bound", "--model", "builtin", "--tokens", "4", "--repeats", "1", "--buffer-mib", "32"
    )
    bw, *decode = lines
    assert bw["case"] == "bandwidth" and bw["read_gb_s"] > 0 and bw["copy_gb_s"] > 0
    by = {c["weight_dtype"]: c for c in decode}
    assert set(by) == {"float", "int8", "int4"}
    # the bound follows the bytes the weights take as loaded: int4 < int8 < float
    assert by["int4"]["weight_mb"] < by["int8"]["weight_mb"] < by["float"]["weight_mb"]
    assert by["int4"]["bound_tpot_ms"] < by["int8"]["bound_tpot_ms"] < by["float"]["bound_tpot_ms"]
    assert all(c["achieved_over_bound"] > 0 and c["tpot_ms"] > 0 for c in decode)


def test_serving_benchmark_smoke():
    lines = run("-m", "benchmarks.serving", "--quick", timeout=400)
    assert [(line["door"], line["rate"]) for line in lines] == [("grpc", 1.0), ("http", 1.0)]
    for line in lines:
        assert line["errors"] == 0 and line["requests"] == 6, line
        assert line["ttft_ms_p50"] > 0 and line["output_tok_s"] > 0 and line["door_ms_p50"] > 0
    assert set(lines[1]["vs_grpc"]) >= {"ttft_ms_p50", "door_ms_p50", "output_tok_s"}


def test_soak_benchmark_smoke():
    """Bounded by its request count, over every form of both doors, with an RSS per window."""
    lines = run(
        "-m",
        "benchmarks.soak",
        "--duration",
        "60",
        "--max-requests",
        "8",
        "--window",
        "1",
        "--concurrency",
        "2",
        "--max-tokens",
        "2",
        timeout=300,
    )
    assert lines[-1]["requests"] == 8 and sum(line["errors"] for line in lines) == 0, lines
    assert all(line["rss_mb"] > 0 for line in lines)


def test_the_routing_sweep_reports_load_and_warns_past_capacity(tmp_path):
    """--rates replays one trace at each rate: a line per rate and policy with its load, and
    a warning where the trace brings more work than the groups can do; --plot draws hit rate
    and TTFT p99 against the rate, a line per policy."""
    trace = tmp_path / "trace.jsonl"
    run("-m", "benchmarks.traces", "--out", str(trace), "--groups", "2", "--blocks", "256", "--requests", "30")
    policies, warnings = ["prefix_aware", "cache_aware_threshold"], []
    lines = run(
        "-m",
        "benchmarks.routing",
        "--trace",
        str(trace),
        "--groups",
        "2",
        "--blocks",
        "256",
        "--policy",
        ",".join(policies),
        "--rates",
        "20,2000",
        "--plot",
        str(tmp_path / "s.svg"),
        stderr=warnings,
    )
    assert [(c["rate"], c["policy"]) for c in lines] == [(r, p) for r in (20.0, 2000.0) for p in policies]
    prompt = sum(len(r.prompt_token_ids) for r in read(str(trace)))
    docs = {r.doc for r in read(str(trace)) if r.doc}
    for c in lines:
        assert c["prompt_tokens"] == prompt
        assert c["computed_tokens"] == pytest.approx(prompt * (1 - c["hit_rate"]), abs=1e-4 * prompt)
        assert 0 < c["utilisation"] <= 1 and c["offered_load"] >= c["utilisation"]
        assert c["docs"] == len(docs) and c["workers_per_doc"] >= 1
        assert c["replicas"] == round(c["docs"] * (c["workers_per_doc"] - 1)) and c["spills"] >= 0
        assert ("warning" in c) == (c["rate"] == 2000.0)  # 30 requests in 15 ms: past capacity
    assert len([w for w in warnings if w.startswith("warning:") and "2000/s" in w]) == 2
    assert lines[0]["offered_load"] < lines[2]["offered_load"]
    svg = ET.parse(tmp_path / "s.svg").getroot()
    curves = svg.findall(f"{SVG}polyline[@class='curve']")
    assert len(curves) == 3 * len(policies)  # hit rate, TTFT p99, blocks pulled: a line per policy
    for curve in curves:
        assert len(curve.get("points").split()) == 2  # a point per rate
    texts = [t.text for t in svg.iter(f"{SVG}text")]
    assert all(p in texts for p in policies) and "2000" in texts


def test_the_routers_policies_pull_in_the_simulation_and_the_references_do_not(tmp_path):
    """A hot document's questions spilled off its holder pull its KV into the spill group's host
    tier (the router's `pull_source` / `cold_source`), counted per line; oracle_balanced, a
    reference, recomputes; --no-pulls makes prefix_aware recompute too."""
    trace = tmp_path / "hot.jsonl"
    shape = "--groups 2 --blocks-per-group 256 --docs 6 --zipf-s 1.2 --questions-min 6 --questions-max 6"
    run("-m", "benchmarks.traces", "--out", str(trace), *shape.split(), "--requests", "60", "--seed", "0")
    common = (
        "-m",
        "benchmarks.routing",
        "--trace",
        str(trace),
        "--groups",
        "2",
        "--capacity",
        "1.25",
        "--rates",
        "100",
    )
    pulled = run(*common, "--policy", "prefix_aware,oracle_balanced", "--host-capacity", "1")
    alone = run(*common, "--policy", "prefix_aware", "--host-capacity", "1", "--no-pulls")
    lines = {(c["policy"], c["kv_pulls"]): c for c in pulled + alone}
    assert set(lines) == {("prefix_aware", True), ("oracle_balanced", False), ("prefix_aware", False)}
    on = lines["prefix_aware", True]
    assert on["pulls"] >= 1 and on["blocks_pulled"] >= on["pulls"]
    assert on["pull_placements"] >= on["pulls"] + on["pull_failures"]
    for c in (lines["oracle_balanced", False], lines["prefix_aware", False]):
        assert c["pull_placements"] == c["pulls"] == c["blocks_pulled"] == c["pull_failures"] == 0
    assert on["restored_tokens"] > 0  # pulled blocks are hits, restored from the host tier


def test_oracles_derive_documents_where_a_trace_names_none(tmp_path):
    """On a trace whose requests carry whole prompts, the oracles place by documents derived
    from shared leading blocks: the same documents as the trace named, so the same placement
    (not least_loaded or round robin under an oracle's name)."""
    named = tmp_path / "named.jsonl"
    run("-m", "benchmarks.traces", "--out", str(named), "--groups", "2", "--blocks", "256", "--requests", "40")
    bare = tmp_path / "bare.jsonl"
    with open(bare, "w") as f:
        for r in read(str(named)):
            line = {
                "id": r.id,
                "arrival_s": r.arrival_s,
                "prompt_token_ids": r.prompt_token_ids,
                "max_tokens": r.max_tokens,
                "tenant": r.tenant,
            }
            f.write(json.dumps(line) + "\n")
    derived = list(with_documents(lambda: read(str(bare))))
    by_name = {}
    for r, d in zip(read(str(named)), derived, strict=True):
        assert (r.doc is None) == (d.doc is None)
        if r.doc is not None:
            assert by_name.setdefault(r.doc, d.doc) == d.doc  # one derived name per document
            assert d.doc_tokens == r.doc_tokens // 16 * 16  # its whole blocks
    assert len(set(by_name.values())) == len(by_name)
    common = ("-m", "benchmarks.routing", "--groups", "2", "--blocks", "256", "--policy", "oracle,oracle_balanced")
    for a, b in zip(run(*common, "--trace", str(named)), run(*common, "--trace", str(bare)), strict=True):
        assert a["policy"] == b["policy"]
        assert (a["hit_rate"], a["requests_per_group"]) == (b["hit_rate"], b["requests_per_group"])
        assert b["docs"] == len(by_name) and b["workers_per_doc"] == a["workers_per_doc"]


def test_an_exact_repeat_of_a_block_aligned_prompt_is_predicted(tmp_path):
    """The engine computes a prompt's last token, so a repeat of a 64-token prompt finds 48
    tokens cached, not 63: the prediction says so and agrees with the engine."""
    trace = tmp_path / "repeat.jsonl"
    prompt = list(range(100, 164))
    trace.write_text(
        "".join(
            json.dumps({"id": f"r{i}", "arrival_s": i * 1.0, "prompt_token_ids": prompt, "max_tokens": 2}) + "\n"
            for i in range(3)
        )
    )
    (line,) = run(
        "-m", "benchmarks.routing", "--trace", str(trace), "--groups", "1", "--blocks", "64", "--policy", "prefix_aware"
    )
    assert line["predicted_equals_actual"] == 1.0
    assert line["hit_rate"] == line["predicted_hit_rate"] == round(2 * 48 / (3 * 64), 4)


def status(gid: str, running: int, waiting: int = 0) -> GroupStatus:
    return GroupStatus(gid, True, 1, ("sim",), 100, 100, 0, running, waiting, 0)


def test_the_cache_aware_threshold_rule():
    """Affinity to the longest match while the loads are balanced; the shortest queue once the
    most loaded group has more than balance_abs requests more than the least and more than
    balance_rel times as many; the least filled cache when the match is short."""
    rule = CacheAwareThreshold(block_size=16, cache_threshold=0.3, balance_abs=4, balance_rel=1.5)
    chain, placed = [bytes([i]) * 8 for i in range(10)], PlacedShare()
    placed.add("a", 5000), placed.add("b", 100), placed.add("c", 3000)
    match = {
        "a": GroupMatch("a", 1, 8, 0),
        "b": GroupMatch("b", 1, 0, 0),
        "c": GroupMatch("c", 1, 2, 0),
    }
    balanced = {"a": status("a", 6), "b": status("b", 3), "c": status("c", 4)}  # 6 - 3 <= 4
    assert rule.choose(chain, balanced, match, placed) == Placement("a", "prefix_hit", 8)
    imbalanced = {**balanced, "a": status("a", 6, 2)}  # 8 - 3 > 4 and 8 > 1.5 * 3
    assert rule.choose(chain, imbalanced, match, placed).group_id == "b"
    short = {g: m._replace(blocks=min(m.blocks, 3)) for g, m in match.items()}  # 3 <= 0.3 * 10
    p = rule.choose(chain, balanced, short, placed)
    assert (p.group_id, p.reason) == ("b", "smallest_cache")
    with pytest.raises(ValueError, match="cache_threshold"):
        CacheAwareThreshold(cache_threshold=1.5)


def test_a_trace_of_a_given_number_of_documents():
    cfg = TraceConfig(
        groups=4, blocks_per_group=1000, docs=60, doc_min_frac=0.0625, doc_max_frac=0.25, zipf_s=0.0, requests=3000
    )
    sizes = {line["doc"]: len(line["doc_token_ids"]) for line in generate(cfg) if "doc_token_ids" in line}
    assert len(sizes) == 60 and min(sizes.values()) >= 1000 and max(sizes.values()) <= 4000
    with pytest.raises(ValueError, match="docs"):
        TraceConfig(docs=-1)


def test_the_failover_benchmark_counts_tokens_repeated_and_missing():
    """benchmarks/failover.py's comparison with the undisturbed run: a stream that repeats a
    token after a resume, one that lost two, one that failed (not compared), one intact."""
    from benchmarks.failover import Stream, compare

    ref = [Stream(tokens=[1, 2, 3, 4, 5]) for _ in range(4)]
    got = [
        Stream(tokens=[1, 2, 3, 3, 4, 5]),  # the token at the cut sent twice
        Stream(tokens=[1, 2, 5]),  # two lost
        Stream(tokens=[1, 2], error="UNAVAILABLE"),
        Stream(tokens=[1, 2, 3, 4, 5]),
    ]
    assert compare(got, ref) == {"streams_differ": 2, "tokens_repeated": 1, "tokens_missing": 2}
    assert Stream(times=[0.0, 0.1, 0.5, 0.6]).stall == pytest.approx(0.4)


def test_the_failover_benchmark_resumes_a_dead_groups_streams_from_its_disk():
    """benchmarks/failover.py --case death_disk: with the read, every stream resumed on d1 read
    its prompt's blocks that d0's disk tier left and d1 computed fewer tokens than without it;
    no stream's tokens differ from an undisturbed run's in either mode."""
    args = ("--streams", "2", "--prompt-len", "64", "--max-tokens", "24", "--drain-after", "8")
    read, recompute, ratio = run("-m", "benchmarks.failover", "--case", "death_disk", *args)
    assert read["resumed"] == recompute["resumed"] == 2 and read["on_d1"] == 2
    assert read["blocks_read"] == 2 * 4 and recompute["blocks_read"] == 0
    assert read["differing"] == recompute["differing"] == []
    assert read["tokens_computed_d1"] < recompute["tokens_computed_d1"]
    assert ratio["tokens_computed_read_vs_recompute"] < 1


def test_step_overhead_benchmark_smoke():
    """benchmarks/step_overhead.py: every case runs its steps with every request decoding
    (the benchmark asserts it) and reports a positive step time and gap; with overlap, forwards
    ran ahead and were adopted. The served cases relay every request to its end (asserted
    there) and pickle a batch of deltas at least every few steps."""
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.step_overhead", "--quick", "--running", "1,64"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    every = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    lines = [x for x in every if x["path"] == "engine" and x["prompts"] == "aligned"]
    staggered = [x for x in every if x["path"] == "engine" and x["prompts"] == "staggered"]
    assert [(x["forward"], x["running"], x["overlap"]) for x in staggered] == [
        ("fixed_5ms", 64, False),
        ("fixed_5ms", 64, True),
    ]
    # positions enter new blocks in every step, and forwards still run ahead (a block early)
    assert staggered[1]["ahead_confirmed"] >= 15 and staggered[1]["ahead_discarded"] == 0
    served = [x for x in every if x["path"] == "served"]
    assert [(x["forward"], x["overlap"], x["form"]) for x in served] == [
        (f, o, form) for f in ("null", "fixed_5ms") for o in (False, True) for form in ("streams", "relay")
    ]
    for x in served:
        assert x["running"] == 64 and x["period_ms_p50"] > 0 and x["pickled_kb_per_step"] > 0
        assert x["batches"] > 0 and ("relay_vs_streams" in x) == (x["form"] == "relay")
    assert [(x["forward"], x["running"], x["overlap"]) for x in lines] == [
        (f, n, o) for f in ("null", "fixed_5ms") for n in (1, 64) for o in (False, True)
    ]
    assert all(x["step_ms_p50"] > 0 and x["gap_ms_p50"] > 0 for x in lines)
    # each step's gap from its logits holds its gap from its sampled ids (the argmax between)
    assert all(x["gap_after_logits_ms_p50"] >= x["gap_ms_p50"] for x in lines)
    assert all((x["ahead_confirmed"] > 0) == x["overlap"] for x in lines)
    assert all("gap_vs_serial" in x for x in lines if x["overlap"])


def test_the_gpu_check_script_says_it_needs_a_device_and_its_commands_parse():
    """scripts/gpu_check.sh (run where a CUDA device is lent): here it stops at once, saying
    why; the benchmark command lines it runs parse with their own parsers."""
    import re
    import shlex

    from benchmarks.engine import parse_args

    script = ROOT / "scripts" / "gpu_check.sh"
    done = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "no CUDA device" in done.stderr + done.stdout
    text = script.read_text().replace("\\\n", " ")
    (engine,) = re.findall(r"-m benchmarks\.engine (.*)", text)
    args = parse_args(shlex.split(engine))
    assert (args.model, args.device, args.dtype) == ("default", "cuda", "bfloat16")


def test_tenants_benchmark_smoke():
    """Four cases; with one tenant's burst past the group's capacity, the fair queue keeps the
    other tenant's TTFT p99 far below first come first served's, and bounding the heavy
    tenant's prefill per step brings it nearer B alone, at nearly A's throughput."""
    lines = {c["case"]: c for c in run("-m", "benchmarks.tenants", "--quick", "--rate-b", "10")}
    assert set(lines) == {"b_alone", "fifo", "fair", "fair_bounded"}
    assert lines["fair"]["B"]["ttft_s_p99"] < lines["fifo"]["B"]["ttft_s_p99"] / 5
    assert lines["fair"]["b_ttft_p99_vs_alone"] < lines["fifo"]["b_ttft_p99_vs_alone"]
    bounded, fair = lines["fair_bounded"], lines["fair"]
    assert bounded["b_ttft_p99_vs_alone"] < fair["b_ttft_p99_vs_alone"]
    a_rate = bounded["A"]["finished_output_tokens_per_s"]
    assert a_rate > 0.95 * fair["A"]["finished_output_tokens_per_s"]


def test_tenants_benchmark_real_engine_smoke():
    """The fairness cases on one real engine (the built-in model), briefly: every request of
    either tenant is answered in each case, B's documents are hit, and the lines carry B's
    TTFT p99 against B alone (timing itself is for a quiet machine: benchmarks/RESULTS.md)."""
    args = ("--quick", "--rate-b", "10", "--real", "--real-rate-b", "3", "--real-duration", "3")
    lines = {c["case"]: c for c in run("-m", "benchmarks.tenants", *args)}
    alone, fifo, fair = lines["real_b_alone"], lines["real_fifo"], lines["real_fair_bounded"]
    assert alone["B"]["requests"] == fifo["B"]["requests"] == fair["B"]["requests"] > 0
    assert fifo["A"]["requests"] == fair["A"]["requests"] > fair["B"]["requests"]
    assert fair["B"]["hit_rate"] > 0 and fair["A"]["finished_output_tokens_per_s"] > 0
    assert fair["b_ttft_p99_vs_alone"] > 0 and fifo["b_ttft_p99_vs_alone"] > 0


def test_structured_benchmark_smoke():
    """benchmarks/structured.py on the built-in model: every decode case runs its steps with all
    32 rows decoding (asserted there), serial and run ahead, constrained cases spend time in the
    mask, a batch with constrained rows still runs ahead, the TTFT case compiled a new schema
    per repeat, the validity suite's outputs all validate, and llguidance accepts the outputs
    xgrammar allows on the same schemas."""
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.structured", "--model", "builtin", "--steps", "3", "--rounds", "1"]
        + ["--repeats", "1", "--validity", "--backends"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    decode = [x for x in lines if x["case"] == "decode"]
    assert [(x["engine"], x["constrained"]) for x in decode] == [
        (e, c) for e in ("serial", "overlap") for c in (0, 8, 32)
    ]
    for x in decode:
        assert (x["mask_ms_per_step"] > 0) == (x["constrained"] > 0), x
        assert x["ahead"] == (0 if x["engine"] == "serial" else round(2 / 3, 3)), x  # all but the first
    (ttft,) = [x for x in lines if x["case"] == "ttft"]
    (valid,) = [x for x in lines if x["case"] == "validity"]
    assert valid["json_outputs_finished_valid"] == [3 * valid["schemas"]] * 3, valid
    assert valid["regex_outputs_finished_valid"][2] == valid["regex_outputs_finished_valid"][0], valid
    assert valid["choice_outputs_finished_valid"][2] == valid["choice_outputs_finished_valid"][0], valid
    (backends,) = [x for x in lines if x["case"] == "backends"]
    assert backends["agreed"] == backends["schemas"] and backends["full_steps"] > 0, backends
    assert backends["xgrammar_mask_ms_per_step"] > 0 and backends["llguidance_mask_ms_per_step"] > 0
    assert ttft["compiled"] >= 2 and ttft["new_schema_ms"] > 0


def test_the_llamacpp_peer_benchmark_runs_pagefleet_alone():
    """benchmarks/peer_llamacpp.py with `--peer none` (no llama.cpp build): the trace through
    the OpenAI client at each concurrency, every request's exact tokens, the documents' shared
    prefixes served from the cache."""
    lines = run(
        "-m", "benchmarks.peer_llamacpp", "--peer", "none", "--model", "builtin", "--quick", "--concurrency", "1,2"
    )
    assert [(x["server"], x["concurrency"]) for x in lines] == [("pagefleet", 1), ("pagefleet", 2)]
    for x in lines:
        assert x["errors"] == 0 and x["requests"] == 5 and x["output_tokens"] == 5 * 4, x
        assert x["ttft_ms_p50"] > 0 and x["tpot_ms_p50"] > 0 and x["output_tok_s"] > 0
        assert 0 < x["cached_prompt_tokens"] < x["prompt_tokens"] and "vs_llamacpp" not in x


def test_the_llamacpp_peer_benchmark_reuses_a_build_and_compares_same_run_figures(tmp_path):
    from benchmarks.peer_llamacpp import compare, llama_server_binary

    built = tmp_path / "build-9.9.9" / "bin" / "llama-server"
    built.parent.mkdir(parents=True)
    built.write_text("")
    assert llama_server_binary(tmp_path, "9.9.9") == built  # (no source, no cmake: reused)
    ours = {"output_tok_s": 30.0, "tpot_ms_p50": 10.0, "ttft_ms_p50": 50.0, "cached_prompt_tokens": 0}
    peer = {"output_tok_s": 20.0, "tpot_ms_p50": 8.0, "ttft_ms_p50": 100.0, "cached_prompt_tokens": 10}
    assert compare(ours, peer) == {"output_tok_s": 1.5, "tpot_ms_p50": 1.25, "ttft_ms_p50": 0.5}


def test_weight_accuracy_benchmark_smoke():
    lines = run("-m", "benchmarks.weight_accuracy", "--model", "builtin", "--tokens", "32", "--max-tokens", "4")
    by = {x["weight_dtype"]: x for x in lines}
    assert set(by) == {"int8", "int4"}
    assert by["int4"]["weight_mb"] < by["int8"]["weight_mb"] < by["int8"]["float_weight_mb"]
    for x in lines:
        assert x["positions"] == 31 and x["kl_mean"] >= 0 and 0 <= x["argmax_agreement"] <= 1
        assert x["ppl"] > 0 and x["ref_ppl"] > 0 and x["greedy_prompts"] == 12
        assert 0 <= x["greedy_prefix_fraction"] <= 1


def test_step_profile_accounts_for_the_time_between_two_forwards():
    """benchmarks/step_profile.py on the built-in model: the decode intervals of two streamed
    requests, the forward inside each, the event loop's work beside it, the client's view."""
    (line,) = run("-m", "benchmarks.step_profile", "--model", "builtin", "--requests", "2", "--tokens", "12")
    assert line["intervals"] >= 2 * 9  # (a request's decode forwards, less its first)
    assert 0 < line["forward_ms"] < line["period_ms"] and line["loop_busy_ms"] > 0
    assert line["client_itl_ms_p50"] > 0 and 0 < line["host_share"] < 1
    assert line["detokenize_ms"] > 0 and line["sample_ms"] > 0 and line["schedule_ms"] > 0


def test_kv_pull_benchmark_smoke():
    lines = run("-m", "benchmarks.kv_pull", "--doc-tokens", "256", "--repeats", "1", "--transport", "in_process")
    recompute, pull = lines
    assert recompute["case"] == "recompute" and pull["case"] == "pull"
    assert pull["blocks_pulled"] == 16 and pull["cached_tokens"] == 256 and pull["same_output_as_holder"]
    assert pull["question_tokens_computed"] < recompute["question_tokens_computed"]
