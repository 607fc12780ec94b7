"""Config parsing and validation: every ConfigError path quotes the bad value and exits 2."""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path
from typing import Any

import pytest

from resilrun.config import CONFIG_FIELDS, Config
from resilrun.errors import ConfigError, ExitCode
from resilrun.option_values import (
    DEFAULT_RDZV_PORT,
    RdzvConf,
    Std,
    nproc_without_devices,
    parse_endpoint,
    parse_nnodes,
    parse_rdzv_conf,
    parse_std_map,
    resolve_std,
)


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return str(path)


def _config_error(**values: Any) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        Config.from_cli(**values)
    assert info.value.exit_code == ExitCode.USAGE == 2
    return info.value


# -- parse_nnodes -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "expected"),
    [("1", (1, 1)), ("4", (4, 4)), ("2:4", (2, 4)), ("3:3", (3, 3)), (" 2 : 4 ", (2, 4))],
)
def test_parse_nnodes_reads_n_and_min_max(value: str, expected: tuple[int, int]) -> None:
    assert parse_nnodes(value) == expected


@pytest.mark.parametrize("value", ["", "x", "2:", ":4", "1:2:3", "-1", "2.5", "a:b", "1-2"])
def test_parse_nnodes_rejects_malformed_values_and_quotes_them(value: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_nnodes(value)
    assert f"'{value}'" in info.value.message
    assert info.value.hint
    assert info.value.exit_code == ExitCode.USAGE


def test_parse_nnodes_rejects_min_greater_than_max_quoting_both() -> None:
    with pytest.raises(ConfigError, match=r"min \(4\) must be <= max \(3\)"):
        parse_nnodes("4:3")


@pytest.mark.parametrize("value", ["0", "0:2"])
def test_parse_nnodes_rejects_zero_nodes(value: str) -> None:
    with pytest.raises(ConfigError, match=r"min \(0\) must be >= 1"):
        parse_nnodes(value)


def test_parse_nnodes_rejects_unicode_superscript_digits_with_a_config_error() -> None:
    with pytest.raises(ConfigError):
        parse_nnodes("²")


# -- parse_endpoint ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("head", ("head", DEFAULT_RDZV_PORT)),
        ("head:1234", ("head", 1234)),
        ("10.0.0.1:29500", ("10.0.0.1", 29500)),
        ("localhost:0", ("localhost", 0)),
        ("[::1]:29400", ("::1", 29400)),
        ("[fe80::1]", ("fe80::1", DEFAULT_RDZV_PORT)),
        ("  head:5  ", ("head", 5)),
    ],
)
def test_parse_endpoint_reads_host_and_port(value: str, expected: tuple[str, int]) -> None:
    assert parse_endpoint(value) == expected


def test_parse_endpoint_default_port_is_29400() -> None:
    assert DEFAULT_RDZV_PORT == 29400
    assert parse_endpoint("node0") == ("node0", 29400)


def test_parse_endpoint_uses_the_given_default_port() -> None:
    assert parse_endpoint("node0", default_port=7) == ("node0", 7)


@pytest.mark.parametrize("value", ["", "head:", "head:x", "::1", "[::1", "a:b:c", "head:-1", "[]:1"])
def test_parse_endpoint_rejects_malformed_values_and_quotes_them(value: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_endpoint(value)
    assert f"'{value}'" in info.value.message
    assert info.value.exit_code == ExitCode.USAGE


def test_parse_endpoint_rejects_a_port_above_65535_quoting_it() -> None:
    with pytest.raises(ConfigError, match=r"port \(70000\)"):
        parse_endpoint("head:70000")


# -- parse_rdzv_conf -----------------------------------------------------------------------------
def test_parse_rdzv_conf_of_empty_text_is_the_defaults() -> None:
    assert parse_rdzv_conf("") == RdzvConf()
    assert RdzvConf().join_timeout_s == 600.0
    assert RdzvConf().is_host is None


def test_parse_rdzv_conf_reads_every_known_key() -> None:
    conf = parse_rdzv_conf("join_timeout=900, last_call_timeout=5,close_timeout=7.5,read_timeout=12,is_host=true")
    assert conf == RdzvConf(
        join_timeout_s=900.0,
        last_call_timeout_s=5.0,
        close_timeout_s=7.5,
        read_timeout_s=12.0,
        is_host=True,
    )


def test_parse_rdzv_conf_accepts_dashes_in_key_names() -> None:
    assert parse_rdzv_conf("join-timeout=3").join_timeout_s == 3.0


@pytest.mark.parametrize(
    "value",
    [
        "keep_alive_interval=5",
        "keep_alive_max_attempt=3",
        "heartbeat_timeout=30",
        "timeout=900",
        "store_type=tcp",
        "use_libuv=0",
    ],
)
def test_parse_rdzv_conf_accepts_torchrun_keys_that_have_no_effect(value: str) -> None:
    assert parse_rdzv_conf(value) == RdzvConf()


def test_parse_rdzv_conf_rejects_an_unsupported_store_type() -> None:
    with pytest.raises(ConfigError, match="store_type 'file'"):
        parse_rdzv_conf("store_type=file")


def test_parse_rdzv_conf_rejects_an_unknown_key_and_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="key 'bogus' is unknown") as info:
        parse_rdzv_conf("join_timeout=5,bogus=1")
    assert info.value.hint is not None
    assert "join_timeout" in info.value.hint
    assert info.value.exit_code == ExitCode.USAGE


def test_parse_rdzv_conf_rejects_an_entry_without_equals_sign() -> None:
    with pytest.raises(ConfigError, match="entry 'join_timeout' has no '='"):
        parse_rdzv_conf("join_timeout")


@pytest.mark.parametrize("raw", ["abc", "", "1s"])
def test_parse_rdzv_conf_rejects_a_timeout_that_is_not_a_number(raw: str) -> None:
    with pytest.raises(ConfigError, match=f"join_timeout '{raw}' is not a number"):
        parse_rdzv_conf(f"join_timeout={raw}")


@pytest.mark.parametrize("raw", ["0", "-5", "nan"])
def test_parse_rdzv_conf_rejects_a_timeout_that_is_not_positive(raw: str) -> None:
    with pytest.raises(ConfigError, match=rf"read_timeout \({raw}\) must be > 0"):
        parse_rdzv_conf(f"read_timeout={raw}")


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("1", True),
        ("true", True),
        ("YES", True),
        ("on", True),
        ("0", False),
        ("False", False),
        ("no", False),
        ("off", False),
    ],
)
def test_parse_rdzv_conf_reads_is_host_as_a_boolean(raw: str, expected: bool) -> None:
    assert parse_rdzv_conf(f"is_host={raw}").is_host is expected


def test_parse_rdzv_conf_rejects_is_host_that_is_not_a_boolean() -> None:
    with pytest.raises(ConfigError, match="is_host 'maybe' is not a boolean"):
        parse_rdzv_conf("is_host=maybe")


# -- parse_std_map / resolve_std -----------------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "expected"), [("0", Std.NONE), ("1", Std.OUT), ("2", Std.ERR), ("3", Std.ALL), ("", Std.NONE)]
)
def test_parse_std_map_reads_one_value_for_every_rank(value: str, expected: Std) -> None:
    assert parse_std_map(value, "--tee") is expected


def test_parse_std_map_reads_a_per_local_rank_list() -> None:
    assert parse_std_map("0:1,1:3", "--tee") == {0: Std.OUT, 1: Std.ALL}


@pytest.mark.parametrize("value", ["4", "-1", "x", "0:4", "0:x", "a:1", "0:1,"])
def test_parse_std_map_rejects_bad_values_naming_the_flag_and_value(value: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_std_map(value, "--redirects")
    assert info.value.message.startswith("--redirects '")
    assert value.strip() in info.value.message
    assert info.value.exit_code == ExitCode.USAGE


def test_resolve_std_applies_a_single_value_to_every_local_rank() -> None:
    assert resolve_std(Std.ERR, 0) is Std.ERR
    assert resolve_std(Std.ERR, 7) is Std.ERR


def test_resolve_std_gives_none_to_local_ranks_missing_from_the_map() -> None:
    spec = {0: Std.OUT, 2: Std.ALL}
    assert resolve_std(spec, 0) is Std.OUT
    assert resolve_std(spec, 1) is Std.NONE
    assert resolve_std(spec, 2) is Std.ALL


# -- Config.from_cli: success paths --------------------------------------------------------------
def test_from_cli_with_only_a_script_gives_the_torchrun_defaults(script: str) -> None:
    config = Config.from_cli(script=script)
    assert config.node_range == (1, 1)
    assert config.rdzv_backend == "c10d"
    assert config.endpoint == ("localhost", 0)
    assert config.rdzv == RdzvConf()
    assert config.script_args == ()


def test_from_cli_treats_none_values_as_defaults(script: str) -> None:
    config = Config.from_cli(script=script, nnodes=None, max_restarts=None, node_rank=None)
    assert config.nnodes == "1:1"
    assert config.max_restarts == 0
    assert config.node_rank is None


def test_from_cli_lowercases_the_backend_and_turns_script_args_into_a_tuple(script: str) -> None:
    config = Config.from_cli(script=script, rdzv_backend="C10D", script_args=["--lr", "1"])
    assert config.rdzv_backend == "c10d"
    assert config.script_args == ("--lr", "1")


def test_standalone_forces_c10d_on_a_free_loopback_port_and_a_fresh_uuid_run_id(script: str) -> None:
    first = Config.from_cli(
        script=script, standalone=True, rdzv_backend="static", rdzv_endpoint="head:29400", rdzv_id="mine"
    )
    second = Config.from_cli(script=script, standalone=True)
    assert first.rdzv_backend == "c10d"
    assert first.rdzv_endpoint == "localhost:0"
    assert first.endpoint == ("localhost", 0)
    assert str(uuid.UUID(first.rdzv_id)) == first.rdzv_id
    assert first.rdzv_id != second.rdzv_id


def test_from_cli_accepts_a_multi_node_job_with_a_fixed_endpoint(script: str) -> None:
    config = Config.from_cli(script=script, nnodes="2:4", rdzv_endpoint="head:29400")
    assert config.node_range == (2, 4)
    assert config.endpoint == ("head", 29400)
    assert Config.from_cli(script=script, nnodes="4", rdzv_endpoint="head:29400", node_rank=3).node_rank == 3


def test_node_rank_with_an_elastic_node_range_is_refused(script: str) -> None:
    # A requested rank >= MIN could never be filled by a round that completes with MIN nodes.
    with pytest.raises(ConfigError, match="--node-rank needs a fixed --nnodes, not '2:4'"):
        Config.from_cli(script=script, nnodes="2:4", rdzv_endpoint="head:29400", node_rank=3)


def test_static_backend_without_an_endpoint_uses_master_addr_and_port(script: str) -> None:
    config = Config.from_cli(
        script=script, nnodes="2", rdzv_backend="static", node_rank=1, master_addr="10.0.0.9", master_port=1234
    )
    assert config.endpoint == ("10.0.0.9", 1234)


@pytest.mark.parametrize("nproc", ["1", "8", "auto", "cpu", "gpu", "cuda", " GPU "])
def test_from_cli_accepts_every_nproc_per_node_spelling(script: str, nproc: str) -> None:
    assert Config.from_cli(script=script, nproc_per_node=nproc).nproc_per_node == nproc


def test_module_mode_does_not_need_a_file(script: str) -> None:
    assert Config.from_cli(script="some.module", module=True).module


def test_no_python_finds_a_program_on_path() -> None:
    assert Config.from_cli(script="true", no_python=True).no_python


def test_config_derived_views_convert_seconds_to_timedelta(script: str) -> None:
    config = Config.from_cli(script=script, monitor_interval_s=0.5, shutdown_timeout_s=3.0)
    assert config.monitor_interval.total_seconds() == 0.5
    assert config.shutdown_timeout.total_seconds() == 3.0


def test_ranks_filter_is_none_when_empty_and_a_set_otherwise(script: str) -> None:
    assert Config.from_cli(script=script).ranks_filter is None
    assert Config.from_cli(script=script, local_ranks_filter="0, 2").ranks_filter == frozenset({0, 2})


def test_with_changes_returns_a_modified_copy(script: str) -> None:
    config = Config.from_cli(script=script)
    changed = config.with_changes(max_restarts=3)
    assert changed.max_restarts == 3
    assert config.max_restarts == 0


# -- Config.from_cli: every ConfigError path ----------------------------------------------------
@pytest.mark.parametrize("nproc", ["0", "-1", "two", "", "1.5"])
def test_bad_nproc_per_node_is_a_usage_error_quoting_the_value(script: str, nproc: str) -> None:
    error = _config_error(script=script, nproc_per_node=nproc)
    assert f"--nproc-per-node '{nproc}'" in error.message


def test_negative_max_restarts_is_a_usage_error_quoting_the_value(script: str) -> None:
    error = _config_error(script=script, max_restarts=-1)
    assert "--max-restarts (-1)" in error.message


@pytest.mark.parametrize("interval", [0.0, -0.5, float("nan")])
def test_non_positive_monitor_interval_is_a_usage_error(script: str, interval: float) -> None:
    error = _config_error(script=script, monitor_interval_s=interval)
    assert f"--monitor-interval ({interval})" in error.message


def test_negative_shutdown_timeout_is_a_usage_error(script: str) -> None:
    error = _config_error(script=script, shutdown_timeout_s=-1.0)
    assert "--shutdown-timeout (-1.0)" in error.message


def test_nan_shutdown_timeout_is_a_usage_error(script: str) -> None:
    _config_error(script=script, shutdown_timeout_s=float("nan"))


@pytest.mark.parametrize("port", [-1, 65536])
def test_master_port_out_of_range_is_a_usage_error(script: str, port: int) -> None:
    error = _config_error(script=script, master_port=port)
    assert f"--master-port ({port})" in error.message


def test_unknown_start_method_is_a_usage_error(script: str) -> None:
    error = _config_error(script=script, start_method="thread")
    assert "--start-method 'thread'" in error.message


@pytest.mark.parametrize("flag", ["redirects", "tee"])
def test_bad_redirects_or_tee_is_a_usage_error(script: str, flag: str) -> None:
    error = _config_error(script=script, **{flag: "9"})
    assert f"--{flag} '9'" in error.message


def test_standalone_with_two_nodes_is_a_usage_error_quoting_nnodes(script: str) -> None:
    error = _config_error(script=script, standalone=True, nnodes="2")
    assert "--standalone" in error.message
    assert "'2'" in error.message


def test_standalone_with_an_elastic_range_above_one_is_a_usage_error(script: str) -> None:
    error = _config_error(script=script, standalone=True, nnodes="1:2")
    assert "'1:2'" in error.message


def test_multi_node_without_an_endpoint_is_told_to_give_one(script: str) -> None:
    error = _config_error(script=script, nnodes="2")
    assert "needs --rdzv-endpoint" in error.message


def test_multi_node_without_an_endpoint_is_a_usage_error(script: str) -> None:
    error = _config_error(script=script, nnodes="2")
    assert "--rdzv-endpoint" in error.message


def test_port_zero_in_a_multi_node_job_is_a_usage_error_quoting_the_endpoint(script: str) -> None:
    error = _config_error(script=script, nnodes="1:2", rdzv_endpoint="head:0")
    assert "'head:0' has port 0" in error.message
    assert error.hint


def test_port_zero_in_a_single_node_job_is_allowed(script: str) -> None:
    assert Config.from_cli(script=script, rdzv_endpoint="localhost:0").endpoint == ("localhost", 0)


@pytest.mark.parametrize("rank", [-1, 2, 5])
def test_node_rank_outside_the_node_range_is_a_usage_error(script: str, rank: int) -> None:
    error = _config_error(script=script, nnodes="2", rdzv_endpoint="head:29400", node_rank=rank)
    assert f"--node-rank ({rank}) must be in 0..1" in error.message


def test_static_backend_without_node_rank_is_a_usage_error(script: str) -> None:
    error = _config_error(script=script, nnodes="2", rdzv_backend="static")
    assert "static needs --node-rank" in error.message


def test_static_backend_with_an_elastic_range_is_a_usage_error(script: str) -> None:
    error = _config_error(script=script, nnodes="1:2", rdzv_backend="static", node_rank=0)
    assert "'1:2'" in error.message


def test_missing_script_is_a_usage_error(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.py")
    error = _config_error(script=missing)
    assert f"'{missing}' does not exist" in error.message
    assert error.hint


def test_no_script_at_all_is_a_usage_error() -> None:
    error = _config_error()
    assert "no training script" in error.message


def test_module_and_no_python_together_are_a_usage_error(script: str) -> None:
    error = _config_error(script=script, module=True, no_python=True)
    assert "--module and --no-python" in error.message


def test_spares_with_no_python_are_a_usage_error() -> None:
    # A spare waits in the Python bootstrap before the script runs; a program run directly cannot.
    error = _config_error(script="true", no_python=True, spares=1)
    assert "--spares cannot be combined with --no-python" in error.message
    assert error.hint


def test_rerun_in_process_without_a_spare_is_a_usage_error(script: str) -> None:
    # The failed rank needs a process to run in while the survivors re-run the script in theirs.
    error = _config_error(script=script, rerun_in_process=True)
    assert "--rerun-in-process needs --spares" in error.message
    assert error.hint and "--spares 1" in error.hint
    assert Config.from_cli(script=script, rerun_in_process=True, spares=1).rerun_in_process


def test_no_python_with_a_missing_program_is_a_usage_error() -> None:
    name = f"resilrun-no-such-program-{uuid.uuid4().hex}"
    error = _config_error(script=name, no_python=True)
    assert f"program '{name}' was not found" in error.message


@pytest.mark.parametrize("value", ["a", "0,,1", "0;1", "1.5"])
def test_bad_local_ranks_filter_is_a_usage_error_quoting_the_value(script: str, value: str) -> None:
    error = _config_error(script=script, local_ranks_filter=value)
    assert f"--local-ranks-filter '{value}'" in error.message


def test_etcd_backend_without_an_endpoint_is_a_usage_error(script: str) -> None:
    error = _config_error(script=script, rdzv_backend="etcd")
    assert "--rdzv-backend etcd needs --rdzv-endpoint" in error.message
    assert error.hint is not None and "2379" in error.hint


def test_etcd_endpoint_takes_a_list_of_members_with_the_default_etcd_port(script: str) -> None:
    config = Config.from_cli(
        script=script, nnodes="2", rdzv_backend="etcd", rdzv_endpoint="e1:2380, e2 ,[::1]:3000", rdzv_id="j"
    )
    assert config.endpoints == [("e1", 2380), ("e2", 2379), ("::1", 3000)]
    assert config.endpoint == ("e1", 2380)


@pytest.mark.parametrize(
    ("endpoint", "conf", "fragment"),
    [
        ("e1:2379,e2:0", "", "port 0"),
        ("e1:2379,e2:x", "", "'e2:x'"),
        (",", "", "names no host"),
        ("e1:2379", "is_host=true", "is_host applies to the c10d backend only"),
    ],
)
def test_bad_etcd_endpoints_are_usage_errors(script: str, endpoint: str, conf: str, fragment: str) -> None:
    error = _config_error(script=script, nnodes="2", rdzv_backend="etcd", rdzv_endpoint=endpoint, rdzv_conf=conf)
    assert fragment in error.message


def test_unknown_backend_is_a_usage_error_quoting_it(script: str) -> None:
    error = _config_error(script=script, rdzv_backend="zookeeper")
    assert "--rdzv-backend 'zookeeper' is unknown" in error.message


def test_bad_rdzv_conf_is_reported_by_from_cli(script: str) -> None:
    error = _config_error(script=script, rdzv_conf="nope=1")
    assert "'nope'" in error.message


def test_bad_nnodes_is_reported_by_from_cli(script: str) -> None:
    error = _config_error(script=script, nnodes="2:1")
    assert "min (2) must be <= max (1)" in error.message


def test_bad_endpoint_is_reported_by_from_cli(script: str) -> None:
    error = _config_error(script=script, rdzv_endpoint="a:b:c")
    assert "'a:b:c'" in error.message


# -- field metadata ------------------------------------------------------------------------------
# resilrun's own flags have no torchrun (PET_*) spelling: their field says so (option_meta's
# pet=False), so the set is read from the fields rather than kept beside them.
_RESILRUN_ONLY = {f.name for f in CONFIG_FIELDS if not any(env.startswith("PET_") for env in f.metadata["env"])}
# torchrun's own options keep their PET_* spelling (a torchrun launch script's environment still works).
_TORCHRUN_OPTIONS = {"nnodes", "nproc_per_node", "rdzv_endpoint", "rdzv_backend", "max_restarts"}


def test_every_config_field_with_a_flag_has_resilrun_and_pet_env_names() -> None:
    for f in CONFIG_FIELDS:
        name = f.metadata["flag"].lstrip("-").replace("-", "_").upper()
        pet = [] if f.name in _RESILRUN_ONLY else [f"PET_{name}"]
        assert f.metadata["env"] == [f"RESILRUN_{name}", *pet], f.name
        assert f.metadata["help"]
        assert f.metadata["panel"] in ("Rendezvous", "Processes", "Health", "Checkpoints", "Observability", "Security")
    assert _TORCHRUN_OPTIONS.isdisjoint(_RESILRUN_ONLY)


def test_config_fields_exclude_the_script_and_its_arguments() -> None:
    names = {f.name for f in CONFIG_FIELDS}
    assert "script" not in names
    assert "script_args" not in names
    assert {"nnodes", "nproc_per_node", "rdzv_endpoint", "max_restarts"} <= names


def test_metrics_are_off_by_default_and_bind_loopback() -> None:
    config = Config.from_cli(script=__file__)
    assert config.metrics_port is None and config.metrics_addr == "127.0.0.1"


@pytest.mark.parametrize(("changes", "fragment"), [({"metrics_port": 70000}, "--metrics-port (70000)"),
                                                   ({"metrics_addr": " "}, "--metrics-addr is empty")])  # fmt: skip
def test_bad_metrics_settings_are_usage_errors(changes: dict[str, object], fragment: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        Config.from_cli(script=__file__, **changes)


@pytest.mark.parametrize(("flag", "expected"), [(False, True), (True, False)])
def test_no_snapshot_dedup_reaches_every_worker(tmp_path: Path, flag: bool, expected: bool) -> None:
    from resilrun.agent.workers.specs import NodeSetup, worker_specs
    from resilrun.env import read_worker_variables
    from resilrun.rendezvous.protocol import NodeInfo, RdzvState

    config = Config(nproc_per_node="2", no_snapshot_dedup=flag, script="train.py")
    setup = NodeSetup(nproc=2, addr="127.0.0.1", log_root=tmp_path, base_env={})
    state = RdzvState(round=1, complete=True, participants=(NodeInfo("n0", "127.0.0.1", 2),))
    specs = worker_specs(config, setup, "run", state, 0, "127.0.0.1:29500")
    assert [read_worker_variables(spec.env).dedup for spec in specs] == [expected, expected]


def test_every_option_that_takes_a_value_says_what_it_takes_on_its_own_field() -> None:
    # A run option is defined once, on its Config field: what --help and the man page show as its
    # value comes from there too, so a new option cannot be added without it.
    for spec in CONFIG_FIELDS:
        flag, value = spec.metadata["flag"], spec.metadata["value"]
        if isinstance(spec.default, bool):
            assert value is None, flag
        else:
            assert isinstance(value, str) and value, flag


@pytest.mark.parametrize(("value", "expected"), [("4", 4), (" 8 ", 8), ("CPU", os.cpu_count() or 1)])
def test_nproc_told_without_torch_is_the_number_or_the_cpu_count(value: str, expected: int) -> None:
    assert nproc_without_devices(value) == expected


@pytest.mark.parametrize("value", ["gpu", "cuda", "auto"])
def test_nproc_that_needs_the_device_count_is_left_to_torch(value: str) -> None:
    assert nproc_without_devices(value) is None


def test_straggler_options_are_parsed_where_they_are_defined() -> None:
    from resilrun.config import CONFIG_FIELDS
    from resilrun.options import cli_value

    fields = {f.name: f for f in CONFIG_FIELDS}
    assert cli_value(fields["stragglers"], " Swap ") == "swap"
    assert cli_value(fields["straggler_swaps"], "0") == 0
    with pytest.raises(ConfigError) as info:
        cli_value(fields["stragglers"], "evict")
    assert (info.value.message, info.value.hint) == (
        "--stragglers 'evict' is unknown",
        "use report (default), swap or off",
    )
    with pytest.raises(ConfigError, match=r"--straggler-swaps \(-1\) must be >= 0"):
        cli_value(fields["straggler_swaps"], "-1")
    with pytest.raises(ConfigError, match="is not an integer"):
        cli_value(fields["straggler_swaps"], "two")
