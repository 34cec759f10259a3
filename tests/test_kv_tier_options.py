"""The disk tier's read options (`kv_disk_async`, `kv_disk_read_delay_s`) wherever the other
tier options are given: `pagefleet serve`'s and `groups start`'s flags, the YAML's `engine:`
and `LLM(...)`, each reaching the engine it configures; a bad value is refused naming it."""

from __future__ import annotations

import pytest

from pagefleet.cli import build_parser, main, serve_config
from pagefleet.llm import LLM
from router.launch.config import load_config

TIERS = ("--kv-host-bytes", "1MiB", "--kv-disk-bytes", "8MiB")


def cache_of_serve(argv: list[str]):
    """The CacheConfig `pagefleet serve ARGV` gives its groups."""
    return serve_config(build_parser().parse_args(["serve", "--model", "builtin", *argv])).engine.engine_config().cache


def test_serve_flags_reach_the_engine_config_and_win_over_the_yaml(tmp_path):
    directory = str(tmp_path / "kv")
    cache = cache_of_serve([*TIERS, "--kv-disk-dir", directory, "--no-kv-disk-async", "--kv-disk-read-delay-s", "0.25"])
    assert (cache.kv_disk_dir, cache.kv_disk_async, cache.kv_disk_read_delay_s) == (directory, False, 0.25)
    assert cache_of_serve([*TIERS, "--kv-disk-dir", directory]).kv_disk_async is True  # the default
    path = tmp_path / "serve.yaml"
    path.write_text(
        f"engine:\n  kv_host_bytes: 1MiB\n  kv_disk_bytes: 8MiB\n  kv_disk_dir: {directory}\n"
        "  kv_disk_async: false\n  kv_disk_read_delay_s: 0.5\n"
    )
    cache = load_config(str(path), {"model": "builtin"}).engine.engine_config().cache
    assert (cache.kv_disk_async, cache.kv_disk_read_delay_s) == (False, 0.5)
    cache = cache_of_serve(["--config", str(path), "--kv-disk-async", "--kv-disk-read-delay-s", "0"])
    assert (cache.kv_disk_dir, cache.kv_disk_async, cache.kv_disk_read_delay_s) == (directory, True, 0.0)


def test_groups_start_flags_reach_the_groups_engine_config(tmp_path, monkeypatch):
    from pagefleet.groups_run import _spec

    monkeypatch.setenv("PAGEFLEET_CLUSTER_SECRET", "options")
    argv = ["groups", "start", "--address", "A", "--redis", "redis://r", "--model", "builtin", *TIERS]
    argv += ["--kv-disk-dir", str(tmp_path), "--no-kv-disk-async", "--kv-disk-read-delay-s", "1.5"]
    cache = _spec(build_parser().parse_args(argv)).engine.cache
    assert (cache.kv_disk_dir, cache.kv_disk_async, cache.kv_disk_read_delay_s) == (str(tmp_path), False, 1.5)


def test_llm_options_reach_the_disk_tier_and_the_block_manager(tmp_path):
    small = dict(dtype="float32", block_size=8, num_blocks=16, max_model_len=64)
    tiers = dict(kv_host_bytes=1 << 20, kv_disk_bytes=8 << 20)
    for read_async, delay in ((False, 0.125), (True, 0.0)):
        directory = tmp_path / str(read_async)
        llm = LLM(
            "builtin",
            kv_disk_dir=str(directory),
            kv_disk_async=read_async,
            kv_disk_read_delay_s=delay,
            **small,
            **tiers,
        )
        try:
            assert llm.engine.executor.worker.disk_tier.read_delay_s == delay
            assert (llm.engine.scheduler.bm.loader is not None) == read_async
        finally:
            llm.engine.executor.shutdown()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve", "--kv-disk-read-delay-s", "-1"], "--kv-disk-read-delay-s"),
        (["serve", "--kv-disk-read-delay-s", "soon"], "--kv-disk-read-delay-s"),
        (["serve", "--kv-disk-async=yes"], "--kv-disk-async"),
        (
            ["groups", "start", "--address", "A", "--redis", "redis://r", "--kv-disk-read-delay-s", "-0.5"],
            "--kv-disk-read-delay-s",
        ),
    ],
)
def test_a_bad_flag_exits_2_naming_it(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("engine", "field"),
    [
        ("kv_disk_read_delay_s: -1", "kv_disk_read_delay_s"),
        ("kv_disk_read_delay_s: fast", "kv_disk_read_delay_s"),
        ("kv_disk_read_delay_s: .inf", "kv_disk_read_delay_s"),
        ("kv_disk_async: sometimes", "kv_disk_async"),
        ("kv_disk_asynch: true", "kv_disk_asynch"),
    ],
)
def test_a_bad_yaml_value_is_refused_naming_the_field(tmp_path, engine, field):
    path = tmp_path / "serve.yaml"
    path.write_text(f"engine:\n  {engine}\n")
    with pytest.raises(ValueError, match=field):
        load_config(str(path), {"model": "builtin"}).engine.engine_config()
    with pytest.raises(ValueError, match=field):
        LLM("builtin", **{field: -1 if "delay" in field else "sometimes"})
