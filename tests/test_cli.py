"""`pagefleet plan` run the way a user runs it, checked against seed 000's worked numbers; the
positionals of every command (a drain's group, a prompt) parse before, between or after its
options."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pagefleet.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
KiB, MiB, GiB = 2**10, 2**20, 2**30
SEED_SHAPE = ["--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--dtype", "bfloat16"]


def pagefleet(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pagefleet", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def plan_json(*args: str) -> dict:
    done = pagefleet("plan", *args, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_plan_json_reproduces_seed_000():
    out = plan_json(
        *SEED_SHAPE,
        *("--block-size", "16", "--lengths", "8192,4096,2048"),
        *("--device-memory", "24GiB", "--reserved", "17GiB"),
    )
    assert out["bytes_per_token"] == 128 * KiB
    assert out["block_bytes"] == 2 * MiB
    assert [r["tokens"] for r in out["requests"]] == [8192, 4096, 2048]
    assert [r["bytes"] for r in out["requests"]] == [GiB, GiB // 2, GiB // 4]
    assert [r["blocks"] for r in out["requests"]] == [512, 256, 128]
    assert [r["tail_waste_bytes"] for r in out["requests"]] == [0, 0, 0]
    assert out["total_bytes"] == 1.75 * GiB
    assert out["contiguous_reserved_bytes"] == 3 * GiB
    assert out["pool_bytes"] == 7 * GiB
    assert out["max_sequences"] == 7
    assert out["per_device_bytes_per_token"] == 128 * KiB
    assert out["shared_prefix_savings_bytes"] == 0


def test_plan_json_37_tokens_tail_block():
    (r,) = plan_json(*SEED_SHAPE, "--lengths", "37")["requests"]
    assert (r["blocks"], r["allocated_bytes"]) == (3, 6 * MiB)
    assert r["tail_waste_bytes"] == 1.375 * MiB


def test_plan_json_shared_prefix():
    out = plan_json(*SEED_SHAPE, "--lengths", "8192,8192", "--shared-prefix", "4096")
    assert out["total_bytes"] == 2 * GiB
    assert out["shared_prefix_savings_bytes"] == GiB // 2
    assert out["total_bytes"] - out["shared_prefix_savings_bytes"] == 1.5 * GiB


def test_plan_json_tensor_parallel():
    sharded = plan_json(*SEED_SHAPE, "--lengths", "8192", "--tp", "2")
    assert sharded["per_device_bytes_per_token"] == 64 * KiB
    replicated = plan_json("--layers", "32", "--kv-heads", "2", "--head-dim", "128", "--lengths", "16", "--tp", "4")
    assert replicated["local_kv_heads"] == 1
    assert replicated["per_device_bytes_per_token"] == 2 * 32 * 128 * 2  # one bf16 head


def test_plan_from_model_dir_matches_shape_flags(tmp_path):
    from transformers import LlamaConfig  # writes config.json the way a hub model has it

    LlamaConfig(
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        hidden_size=4096,
        dtype="bfloat16",
    ).save_pretrained(tmp_path)
    from_model = plan_json("--model", str(tmp_path), "--lengths", "8192,4096,2048")
    assert from_model["bytes_per_token"] == 128 * KiB
    assert from_model["shape"]["kv_dtype"] == "bfloat16"
    fp8 = plan_json("--model", str(tmp_path), "--dtype", "fp8", "--lengths", "8192")
    assert fp8["bytes_per_token"] == 64 * KiB


def test_plan_table_by_default():
    done = pagefleet(
        "plan",
        *SEED_SHAPE,
        "--lengths",
        "8192,4096,2048",
        "--device-memory",
        "24GiB",
        "--reserved",
        "17GiB",
    )
    assert done.returncode == 0, done.stderr
    assert "128 KiB" in done.stdout
    assert "1.75 GiB" in done.stdout
    assert "7 sequences of 8,192 tokens" in done.stdout
    with pytest.raises(json.JSONDecodeError):
        json.loads(done.stdout)


def test_help_lists_commands():
    done = pagefleet("--help")
    assert done.returncode == 0
    assert "plan" in done.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([*SEED_SHAPE, "--lengths", "37", "--device-memory", "24XB"], "invalid size"),
        (["--layers", "32", "--head-dim", "128", "--lengths", "37"], "--kv-heads"),
        ([*SEED_SHAPE[:6], "--dtype", "fp4", "--lengths", "37"], "fp4"),
        (["--layers", "32", "--kv-heads", "3", "--head-dim", "128", "--lengths", "37", "--tp", "2"], "not divisible"),
        ([*SEED_SHAPE, "--lengths", "8192,abc"], "abc"),
        ([*SEED_SHAPE, "--lengths", "8192", "--max-len", "4096"], "max_len"),
        ([*SEED_SHAPE, "--lengths", "8", "--device-memory", "1GiB", "--reserved", "2GiB"], "reserved"),
        ([*SEED_SHAPE], "max_len"),
        (["--model", "/nonexistent/model", "--lengths", "8"], "config.json"),
        (["--model", "/nonexistent/model", "--layers", "2", "--lengths", "8"], "not both"),
    ],
)
def test_plan_bad_input_exits_2_with_a_message(args, message):
    done = pagefleet("plan", *args)
    assert done.returncode == 2
    assert message in done.stderr
    assert "Traceback" not in done.stderr
    assert done.stdout == ""


def test_main_returns_exit_codes(capsys):
    assert main(["plan", *SEED_SHAPE, "--lengths", "37", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["requests"][0]["blocks"] == 3
    assert main(["plan", *SEED_SHAPE, "--lengths", "37", "--tp", "3"]) == 2
    assert main(["no-such-command"]) == 2


def test_plan_8bit_caches_fit_twice_the_8k_sequences():
    """SmolLM2-135M's KV shape on a 24 GiB device: int8 (its per-token scales included) and
    fp8 fit at least 1.9 times the bfloat16 cache's 8k-token sequences."""
    shape = ["--layers", "30", "--kv-heads", "3", "--head-dim", "64", "--max-len", "8192"]
    device = ["--device-memory", "24GiB", "--reserved", "1GiB"]
    fits = {
        d: plan_json(*shape, *device, "--kv-cache-dtype", d)["max_sequences"] for d in ("bfloat16", "int8", "fp8_e4m3")
    }
    assert fits["bfloat16"] == 130
    assert fits["int8"] == 253 and fits["fp8_e4m3"] == 261
    assert min(fits["int8"], fits["fp8_e4m3"]) >= 1.9 * fits["bfloat16"]
    assert plan_json(*shape, "--kv-cache-dtype", "int8")["bytes_per_token"] == 2 * 30 * 3 * 66


DRAIN = ["--cluster", "C", "--address", "A"]


@pytest.mark.parametrize(
    "argv",
    [
        ["groups", "drain", "group-1", *DRAIN],
        ["groups", "drain", *DRAIN, "group-1"],  # once "unrecognized arguments: group-1"
        ["groups", "drain", *DRAIN[:2], "group-1", *DRAIN[2:]],
        ["groups", *DRAIN, "drain", "group-1"],
        ["groups", *DRAIN[:2], "drain", *DRAIN[2:], "group-1"],
    ],
)
def test_groups_drain_takes_its_group_anywhere_after_drain(argv):
    args = build_parser().parse_args(argv)
    assert (args.action, args.group, args.cluster, args.address) == ("drain", "group-1", "C", "A")


@pytest.mark.parametrize(
    "argv",
    [
        ["groups", "start", "--address", "A", "--redis", "redis://r", "--num-blocks", "64"],
        ["groups", "--address", "A", "start", "--num-blocks", "64", "--redis", "redis://r"],
        ["groups", "status", "--json", "--address", "A"],
        ["groups", "stop", "--address", "A"],
        ["generate", "--max-tokens", "2", "hello", "--json"],
        ["generate", "hello", "--max-tokens", "2"],
    ],
)
def test_every_command_parses_options_around_its_positionals(argv):
    args = build_parser().parse_args(argv)
    assert args.address == "A" if argv[0] == "groups" else args.prompt == "hello"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["groups", "drain", *DRAIN], "required: group"),
        (["groups", "start", "--address", "A"], "required: --redis"),
        (["groups", "status"], "needs --address"),
        (["groups", "status", "--address", "A", "--num-blocks", "8"], "unrecognized"),
    ],
)
def test_groups_bad_input_exits_2_with_a_message(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_groups_drain_with_its_group_last_reaches_a_real_cluster(ray_runtime):
    """The real command on a real Ray cluster: past the parser, it finds no supervisor there."""
    done = pagefleet("groups", "drain", "--cluster", "none", "--address", ray_runtime.address, "group-1")
    assert done.returncode == 1, done.stderr
    assert "no pagefleet groups run in Ray namespace 'pagefleet-none'" in done.stderr


def test_plan_reports_each_tiers_capacity_in_tokens_and_documents():
    """Seed 000's device (7 GiB of pool: 3,584 blocks of 2 MiB) over a 64 GiB host tier and a
    1 TiB disk tier, in documents of 8,192 tokens (512 blocks)."""
    tiers = ("--kv-host-bytes", "64GiB", "--kv-disk-bytes", "1TiB", "--document-tokens", "8192")
    out = plan_json(*SEED_SHAPE, "--lengths", "2048", "--device-memory", "24GiB", "--reserved", "17GiB", *tiers)
    got = {t["medium"]: (t["blocks"], t["tokens"], t["documents"]) for t in out["tiers"]}
    assert got == {
        "device": (3584, 3584 * 16, 7),
        "host": (32 * 1024, 32 * 1024 * 16, 64),
        "disk": (512 * 1024, 512 * 1024 * 16, 1024),
    }
    assert out["blocks_per_document"] == 512
    # per device: two devices hold half the KV heads each, so twice the blocks in the same bytes
    sharded = plan_json(*SEED_SHAPE, "--lengths", "2048", "--tp", "2", *tiers)
    assert [(t["medium"], t["blocks"]) for t in sharded["tiers"]] == [("host", 64 * 1024), ("disk", 1024 * 1024)]
    table = pagefleet("plan", *SEED_SHAPE, "--lengths", "2048", *tiers)
    assert table.returncode == 0, table.stderr
    assert "documents of 8,192 tokens" in table.stdout
    assert "    host       64 GiB       32,768          524,288         64" in table.stdout


def test_plan_host_tier_holds_what_the_engine_allocates(tmp_path):
    """The plan of a model's host tier counts the blocks the engine's host tier has."""
    from pagefleet.llm import LLM
    from worker.model.builtin_model import make_model_dir

    model = make_model_dir(tmp_path, seed=1)
    host = 300_000
    out = plan_json(
        "--model",
        str(model),
        "--dtype",
        "float32",
        "--block-size",
        "8",
        "--lengths",
        "64",
        "--kv-host-bytes",
        str(host),
    )
    (tier,) = out["tiers"]
    stats = LLM(str(model), dtype="float32", block_size=8, num_blocks=16, max_model_len=64, kv_host_bytes=host).stats()
    assert tier["medium"] == "host" and tier["blocks"] == stats["kv_host_blocks_total"] > 0
    assert tier["tokens"] == tier["blocks"] * 8 and tier["documents"] == tier["blocks"] // 8


@pytest.mark.parametrize(
    "flags, message",
    [
        (("--kv-disk-bytes", "1GiB"), "kv_disk_bytes: a disk tier sits under a host tier"),
        (("--kv-host-bytes", "1KiB"), "kv_host_bytes=1024 holds no block"),
        (("--kv-host-bytes", "1GiB", "--document-tokens", "0"), "--document-tokens"),
    ],
)
def test_plan_refuses_tiers_it_cannot_count(flags, message):
    done = pagefleet("plan", *SEED_SHAPE, "--lengths", "16", *flags)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr
