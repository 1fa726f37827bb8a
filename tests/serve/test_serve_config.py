"""``elastickv serve`` configuration: defaults, TOML, flags, and an exact error for every bad
field — before anything starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from elastickv.serve.config import (
    ServeConfigError,
    builtin_config,
    config_from_flags,
    config_from_mapping,
    load_config,
)


def model(**fields: object) -> dict[str, object]:
    return {"name": "a", "model": "tiny-llama", **fields}


def mapping(*models: dict[str, object], **device: object) -> dict[str, object]:
    return {"device": {"budget": "64M", **device}, "model": list(models)}


def test_no_configuration_serves_two_builtin_models_of_different_shapes() -> None:
    from elastickv.models import BUILTIN_MODELS

    config = builtin_config()
    assert [m.source for m in config.models] == ["tiny-llama", "tiny-llama-bf16"]
    shapes = {
        (s.num_hidden_layers, s.num_key_value_heads, s.head_dim, s.dtype)
        for s in (BUILTIN_MODELS[m.source] for m in config.models)
    }
    assert len(shapes) == 2
    assert config.host == "127.0.0.1"
    assert sum(m.min_kv for m in config.models) <= config.budget
    assert config_from_flags([], min_kv=None, max_kv=None) == config


def test_toml_file_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "serve.toml"
    path.write_text(
        """
[router]
port = 9000
queue_limit = 4
wake_timeout = "2m"

[device]
budget = "1G"
page_size = "64K"

[[model]]
name = "chat"
model = "tiny-llama"
args = ["--enforce-eager"]
min_kv = "64M"
max_kv = "512M"
priority = 2
pinned = true
release_after = "10s"
stop_after = "never"

[[model]]
model = "tiny-llama-bf16"
"""
    )
    config = load_config(path)
    chat, other = config.models
    assert (config.port, config.queue_limit, config.wake_timeout_s) == (9000, 4, 120.0)
    assert (config.budget, config.page_size) == (1 << 30, 64 << 10)
    assert chat.args == ("--enforce-eager",) and chat.priority == 2 and chat.pinned
    assert (chat.min_kv, chat.max_kv, chat.release_after_s, chat.stop_after_s) == (
        64 << 20,
        512 << 20,
        10.0,
        None,
    )
    assert other.name == "tiny-llama-bf16"
    # No max_kv: the budget minus the others' floors.
    assert config.cap_of(other) == (1 << 30) - (64 << 20)
    assert config.cap_of(chat) == 512 << 20


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        (mapping(model(min_kv="3X")), "min_kv = '3X': not a size"),
        (mapping(model(max_kv="1M", min_kv="2M")), "max_kv = 1.0 MiB is below its min_kv"),
        (mapping(model(priority="high")), "priority = 'high': must be a whole number"),
        (mapping(model(pinned="yes")), "pinned = 'yes': use true or false"),
        (mapping(model(release_after="soon")), "release_after = 'soon': not a positive"),
        (mapping(model(stop_after=-1)), "stop_after = -1: not a positive duration"),
        (mapping(model(args="--enforce-eager")), "args = '--enforce-eager': must be a list"),
        (mapping(model(colour="red")), "unknown field(s) colour"),
        (mapping(model(model="/no/such/dir")), "'/no/such/dir' is neither a model directory"),
        (mapping(model(), model(name="a")), "model name 'a' is used twice"),
        (mapping(model(name="bad name")), "model name 'bad name'"),
        (mapping(model(min_kv="60M"), model(name="b", min_kv="8M")), "cannot guarantee"),
        # The page size as it was typed, not in bytes.
        (mapping(model(), page_size="3K"), "page_size = '3K' (3.0 KiB): must be a power of two"),
        # A misspelt built-in model gets the name it was meant to be.
        (mapping(model(model="tiny-llma")), "tiny-llama-deep); did you mean 'tiny-llama'?"),
        # Contradictions: a pinned model is never stopped; stopping before releasing.
        (
            mapping(model(pinned=True, stop_after="20s")),
            "pinned = true never stops it, but stop_after = '20s' stops it after 20 s idle",
        ),
        (
            mapping(model(stop_after="5s", release_after="30s")),
            "stop_after = 5s is not longer than its release_after = 30s (the default)",
        ),
        (mapping(model(stop_after="5s")), "release_after = 30s (the default): its engine would"),
        (
            mapping(model(min_kv="64K")),
            "min_kv = 64.0 KiB is smaller than one page ([device] page_size = 2.0 MiB (the "
            "default)); give it at least the engine's null block and one request, or use smaller "
            'pages (e.g. page_size = "64K")',
        ),
        (mapping(model(), budget="lots"), "[device] budget = 'lots': not a size"),
        ({"device": {"budget": "1G"}}, "no [[model]] tables"),
        ({"model": [model()]}, "[device] budget is required"),
        ({**mapping(model()), "router": {"port": 70000}}, "[router] port = 70000"),
        ({**mapping(model()), "router": {"prot": 1}}, "[router]: unknown field(s) prot"),
        ({**mapping(model()), "python": "/no/python"}, "python = '/no/python' is not an exec"),
        ({**mapping(model()), "extra": 1}, "the top level: unknown field(s) extra"),
        (mapping(model(env={"ELASTICKV_BUDGET": "1G"})), "ELASTICKV_BUDGET is set by serve"),
        (
            mapping(model(env={"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": 5})),
            "VLLM_HTTP_TIMEOUT_KEEP_ALIVE is set by serve",
        ),
        (
            mapping(model(env={"VLLM_RPC_BASE_PATH": "/tmp"})),
            "VLLM_RPC_BASE_PATH is set by serve",
        ),
        (mapping(model(env={"BAD NAME": "1"})), "'BAD NAME' is not an environment variable"),
        (mapping(model(env=["A=1"])), "env = ['A=1']: must be a table"),
        (mapping(model(env={"A": [1]})), "env A = [1]: must be a string or a number"),
        (mapping(model(pd="yes")), "pd = 'yes': use true, or a table"),
        (mapping(model(pd={"prefil_args": []})), "unknown field(s) prefil_args"),
        (mapping(model(pd={"decode_args": "--x"})), "decode_args = '--x': must be a list"),
        (
            mapping(model(pd={"prefill_env": {"VLLM_NIXL_SIDE_CHANNEL_PORT": "1"}})),
            "VLLM_NIXL_SIDE_CHANNEL_PORT is set by serve",
        ),
        (
            mapping(model(pd=True, args=["--kv-transfer-config", "{}"])),
            "args set --kv-transfer-config; a pd model's engines get theirs from serve",
        ),
        (
            mapping(model(pd={"decode_args": ["--kv_transfer_config={}"]})),
            "decode_args set --kv-transfer-config",
        ),
        (
            mapping(model(pd={"nixl_progress_wait_ms": "5ms"})),
            "pd nixl_progress_wait_ms = '5ms': use a whole number of milliseconds from 0 to 1000",
        ),
        (mapping(model(pd={"nixl_progress_wait_ms": 1001})), "nixl_progress_wait_ms = 1001"),
        (mapping(model(pd={"nixl_progress_wait_ms": True})), "nixl_progress_wait_ms = True"),
        (
            mapping(model(pd={"nixl_progress_wait_ms": 5}), mode="static"),
            "nixl_progress_wait_ms needs elastickv in the engine",
        ),
        (mapping(model(pd=True), model(name="a/prefill")), "model name 'a/prefill' is used"),
        (mapping(model(name="b/prefill"), model(name="b", pd=True)), "used twice"),
    ],
)
def test_every_bad_field_is_named_with_its_value(data: dict[str, object], needle: str) -> None:
    with pytest.raises(ServeConfigError) as info:
        config_from_mapping(data, source="t.toml")
    assert needle in str(info.value)


def test_a_pd_model_is_two_engines_under_one_name() -> None:
    from elastickv.serve.engine import ENGINE_KEEP_ALIVE_S, build_launch

    pd = {
        "decode_args": ["--max-num-seqs", "4"],
        "prefill_env": {"VLLM_CPU_OMP_THREADS_BIND": "0"},
        "decode_env": {"VLLM_CPU_OMP_THREADS_BIND": 1},
        "nixl_progress_wait_ms": 5,
    }
    data = mapping(
        model(name="chat", pd=pd, args=["--enforce-eager"], env={"OMP": "2"}, min_kv="8M"),
        model(name="other", min_kv="8M"),
    )
    config = config_from_mapping(data, source="t.toml")
    assert config.names() == ["chat/prefill", "chat/decode", "other"]
    assert config.served_names() == ["chat", "other"]
    prefill, decode = config.pairs()["chat"]
    assert (prefill.role, decode.role) == ("prefill", "decode")
    assert prefill.served_name == decode.served_name == "chat"
    assert prefill.args == ("--enforce-eager",)
    assert decode.args == ("--enforce-eager", "--max-num-seqs", "4")
    assert dict(prefill.env) == {"OMP": "2", "VLLM_CPU_OMP_THREADS_BIND": "0"}
    assert dict(decode.env) == {"OMP": "2", "VLLM_CPU_OMP_THREADS_BIND": "1"}
    # Each engine has its own floor: both are reserved from the budget.
    assert prefill.min_kv == decode.min_kv == 8 << 20
    assert config_from_mapping(mapping(model(pd=True, min_kv="8M")), source="t").names() == [
        "a/prefill",
        "a/decode",
    ]

    launches = [
        build_launch(config, m, python="py", model_path="/m", port=8000 + i, log_dir=Path("/l"))
        for i, m in enumerate((prefill, decode))
    ]
    for launch, m in zip(launches, (prefill, decode), strict=True):
        argv = list(launch.argv)
        assert argv[argv.index("--served-model-name") + 1] == "chat"
        assert '"kv_connector": "NixlConnector"' in argv[argv.index("--kv-transfer-config") + 1]
        assert launch.env["ELASTICKV_INSTANCE"] == m.name
        assert launch.env["VLLM_CPU_OMP_THREADS_BIND"] == dict(m.env)["VLLM_CPU_OMP_THREADS_BIND"]
        assert launch.log_path.name == f"chat_{m.role}.log"
    ports = {launch.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] for launch in launches}
    assert len(ports) == 2  # a NIXL side channel each
    plain = build_launch(
        config, config.model("other"), python="py", model_path="/m", port=1, log_dir=Path("/l")
    )
    assert "--kv-transfer-config" not in plain.argv
    assert "VLLM_NIXL_SIDE_CHANNEL_PORT" not in plain.env
    # Both engines of the pair, and only they, get NIXL's progress wait.
    assert [launch.env.get("ELASTICKV_NIXL_PROGRESS_WAIT_MS") for launch in launches] == ["5"] * 2
    assert "ELASTICKV_NIXL_PROGRESS_WAIT_MS" not in plain.env
    # Every engine keeps idle connections longer than the router does (see the router test).
    for launch in (*launches, plain):
        assert launch.env["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"] == str(ENGINE_KEEP_ALIVE_S)


def test_model_directory_needs_a_config_json(tmp_path: Path) -> None:
    with pytest.raises(ServeConfigError, match=r"has no config\.json"):
        config_from_mapping(mapping(model(model=str(tmp_path))), source="t.toml")
    (tmp_path / "config.json").write_text("{}")
    config = config_from_mapping(mapping(model(model=str(tmp_path))), source="t.toml")
    assert not config.models[0].builtin


def test_flags_need_a_budget_and_name_models() -> None:
    with pytest.raises(ServeConfigError, match="--budget is required"):
        config_from_flags(["tiny-llama"], min_kv=None, max_kv=None)
    config = config_from_flags(
        ["chat=tiny-llama", "tiny-llama-bf16"], min_kv="8M", max_kv=None, budget=64 << 20
    )
    assert [m.name for m in config.models] == ["chat", "tiny-llama-bf16"]
    assert all(m.min_kv == 8 << 20 for m in config.models)
    with pytest.raises(ServeConfigError, match="need --model"):
        config_from_flags([], min_kv="1M", max_kv=None)


def test_unreadable_or_invalid_toml(tmp_path: Path) -> None:
    with pytest.raises(ServeConfigError, match="no such file"):
        load_config(tmp_path / "missing.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("[device\nbudget=")
    with pytest.raises(ServeConfigError, match="not valid TOML"):
        load_config(broken)


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "elastickv.cli.main", "serve", *args],
        capture_output=True, text=True, timeout=120, start_new_session=True,
        env=None if env is None else {**os.environ, **env},
    )  # fmt: skip


def test_cli_rejects_bad_config_before_starting_anything(tmp_path: Path) -> None:
    path = tmp_path / "serve.toml"
    path.write_text('[device]\nbudget = "1G"\n[[model]]\nmodel = "/does/not/exist"\n')
    proc = run_cli("--config", str(path))
    assert proc.returncode == 2
    assert proc.stderr.startswith("elastickv: error: model 'exist': model = '/does/not/exist'")
    assert "Traceback" not in proc.stderr
    proc = run_cli("--config", str(path), "--model", "tiny-llama")
    assert proc.returncode == 2 and "cannot be combined with --config" in proc.stderr


def test_cli_check_prints_the_plan() -> None:
    proc = run_cli("--check")
    assert proc.returncode == 0, proc.stderr
    assert "tiny-llama:" in proc.stdout and "tiny-llama-bf16:" in proc.stdout
    assert "KV budget 32.0 MiB" in proc.stdout


def test_pinned_means_never_stopped_and_agrees_with_never() -> None:
    pinned = config_from_mapping(mapping(model(pinned=True)), source="t").models[0]
    assert pinned.pinned and pinned.stop_after_s is None
    both = config_from_mapping(mapping(model(pinned=True, stop_after="never")), source="t")
    assert both.models[0].stop_after_s is None
    tiers = config_from_mapping(mapping(model(release_after="5s", stop_after="1m")), source="t")
    assert (tiers.models[0].release_after_s, tiers.models[0].stop_after_s) == (5.0, 60.0)
    # Straight to stopping, without the release tier, is said explicitly.
    direct = config_from_mapping(mapping(model(release_after="never", stop_after="5s")), source="t")
    assert (direct.models[0].release_after_s, direct.models[0].stop_after_s) == (None, 5.0)


@pytest.mark.parametrize(
    ("budget", "engines", "page", "floor"),
    [
        (8 << 30, 2, 2 << 20, 64 << 20),  # plenty: DEFAULT_MIN_KV each
        (16 << 20, 1, 2 << 20, 16 << 20),  # a lone model on a small budget: all of it
        (20 << 20, 3, 2 << 20, 6 << 20),  # an even share, in whole pages
        (1 << 20, 2, 2 << 20, 2 << 20),  # never less than a page (the budget check then says so)
    ],
)
def test_an_unset_min_kv_is_a_share_of_the_budget_in_pages(
    budget: int, engines: int, page: int, floor: int
) -> None:
    from elastickv.serve.config import default_min_kv

    assert default_min_kv(budget, engines, page) == floor


def test_flags_without_min_kv_fit_a_small_budget() -> None:
    """``--model tiny-llama --budget 16M`` was refused: min_kv defaulted to 64 MiB."""
    config = config_from_flags(["tiny-llama"], min_kv=None, max_kv=None, budget=16 << 20)
    assert config.models[0].min_kv == 16 << 20
    pair = config_from_flags(["a=tiny-llama", "b=tiny-llama"], min_kv=None, max_kv=None,
                             budget=16 << 20)  # fmt: skip
    assert [m.min_kv for m in pair.models] == [8 << 20, 8 << 20]
    pd = config_from_mapping(mapping(model(pd=True), budget="64M"), source="t")
    assert [m.min_kv for m in pd.models] == [32 << 20, 32 << 20]  # two engines


def test_flag_sizes_are_echoed_as_typed() -> None:
    proc = run_cli("--page-size", "3K", "--check")
    assert proc.returncode == 2
    assert "--page-size = '3K' (3.0 KiB): must be a power of two" in proc.stderr
    proc = run_cli("--budget", "lots", "--check")
    assert proc.returncode == 2 and "--budget = 'lots': not a size" in proc.stderr


def test_check_refuses_what_a_start_refuses(tmp_path: Path) -> None:
    """``serve --check --budget 100G`` said nothing while the start refused the budget."""
    env = {"ELASTICKV_LEDGER_DIR": str(tmp_path / "ledger")}
    proc = run_cli("--budget", "100T", "--check", env=env)
    assert proc.returncode == 2, proc.stdout
    assert "[device] budget = 100.0 TiB is more than the" in proc.stderr
    assert "a new host ledger has" in proc.stderr
    assert not (tmp_path / "ledger").exists()  # nothing created
    from elastickv.control import open_ledger

    with open_ledger("host", directory=str(tmp_path / "ledger"), total_bytes=64 << 20,
                     utilization=1.0) as ledger, ledger.register("tiny-llama"):  # fmt: skip
        clash = run_cli("--check", env=env)
        assert clash.returncode == 2
        assert "already has live instances named 'tiny-llama'" in clash.stderr
    small = run_cli("--check", "--budget", "128M", env=env)  # the ledger stays: 64 MiB
    assert small.returncode == 2
    assert "more than the host ledger has available (64.0 MiB of 64.0 MiB" in small.stderr
    fits = run_cli("--check", env=env)
    assert fits.returncode == 0, fits.stderr
    assert "host ledger" in fits.stdout and "64.0 MiB of 64.0 MiB available" in fits.stdout


def test_a_builtin_model_runs_in_its_own_dtype(tmp_path: Path) -> None:
    """vLLM's ``--dtype auto`` ran the float32 ``tiny-llama`` in bfloat16 ("Downcasting
    torch.float32 to torch.bfloat16"), while the docs call it fp32."""
    from elastickv.serve.engine import build_launch

    (tmp_path / "config.json").write_text("{}")
    data = mapping(
        model(name="fp32"),
        model(name="bf16", model="tiny-llama-bf16"),
        model(name="mine", args=["--dtype", "bfloat16"]),
        model(name="dir", model=str(tmp_path)),
    )
    config = config_from_mapping(data, source="t")

    def dtype(name: str) -> list[str]:
        argv = list(build_launch(config, config.model(name), python="py", model_path="/m",
                                 port=1, log_dir=tmp_path).argv)  # fmt: skip
        return [argv[i + 1] for i, a in enumerate(argv) if a == "--dtype"]

    assert dtype("fp32") == ["float32"]
    assert dtype("bf16") == ["bfloat16"]
    assert dtype("mine") == ["bfloat16"]  # the model's own args win, and only they count
    assert dtype("dir") == []  # a model directory: vLLM's choice, as the user gave it


def test_settings_serve_ignores_are_named_with_the_one_meant() -> None:
    """A mistyped ``ELASTICKV_*`` variable in serve's environment changed nothing, silently."""
    env = {"ELASTICKV_BUGDET": "2G", "ELASTICKV_LEDGER_DIRR": "/x", "ELASTICKV_BUDGET": "2G"}
    proc = run_cli("--check", env=env)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert (
        "elastickv serve: ignoring ELASTICKV_BUGDET from the environment (not an elastickv "
        "setting: did you mean ELASTICKV_BUDGET?)" in lines
    )
    assert any(
        "ELASTICKV_LEDGER_DIRR" in line and "ELASTICKV_LEDGER_DIR?" in line for line in lines
    )
    assert any(
        "ELASTICKV_BUDGET from" in line and "from the configuration" in line for line in lines
    )
    assert "Traceback" not in proc.stderr


KEY = "s3cret-" + "k" * 25


def test_a_router_beyond_loopback_needs_a_key_or_an_explicit_choice(tmp_path: Path) -> None:
    exposed = {**mapping(model()), "router": {"host": "0.0.0.0"}}
    with pytest.raises(ServeConfigError) as refused:
        config_from_mapping(exposed, source="t")
    message = str(refused.value)
    assert "[router] host = '0.0.0.0' exposes the models" in message
    assert "api_key_file" in message and "allow_unauthenticated = true" in message
    allowed = {**mapping(model()), "router": {"host": "0.0.0.0", "allow_unauthenticated": True}}
    assert config_from_mapping(allowed, source="t").api_key is None
    keyed = config_from_mapping(exposed, source="t", environ={"ELASTICKV_API_KEY": KEY})
    assert keyed.api_key is not None and keyed.api_key.source == "ELASTICKV_API_KEY"
    (tmp_path / "key").write_text(KEY + "\n")
    with_file = {
        **mapping(model()),
        "router": {"host": "::", "api_key_file": str(tmp_path / "key")},
    }
    config = config_from_mapping(with_file, source="t", environ={"ELASTICKV_API_KEY": "x" * 20})
    assert config.api_key is not None and config.api_key.secret == KEY  # the file wins
    assert KEY not in repr(config)
    for host in ("127.0.0.1", "localhost", "::1"):
        loopback = {**mapping(model()), "router": {"host": host}}
        assert config_from_mapping(loopback, source="t").api_key is None
    with pytest.raises(ServeConfigError, match="use true or false"):
        config_from_mapping({**mapping(model()), "router": {"models_api": "yes"}}, source="t")


def test_the_models_api_needs_a_key_and_may_start_with_no_model() -> None:
    empty = {"device": {"budget": "64M"}, "router": {"models_api": True}}
    with pytest.raises(ServeConfigError, match="models_api = true lets whoever calls it start"):
        config_from_mapping(empty, source="t")
    config = config_from_mapping(empty, source="t", environ={"ELASTICKV_API_KEY": KEY})
    assert config.models == () and config.models_api
    with pytest.raises(ServeConfigError, match="no \\[\\[model\\]\\] tables"):
        config_from_mapping({"device": {"budget": "64M"}}, source="t")
    flags = config_from_flags(
        [], min_kv=None, max_kv=None, environ={"ELASTICKV_API_KEY": KEY}, models_api=True,
        budget=8 << 20,
    )  # fmt: skip
    assert flags.models == () and flags.api_key is not None
    with pytest.raises(ServeConfigError, match="--budget is required with --models-api"):
        config_from_flags([], min_kv=None, max_kv=None, models_api=True)


def test_cli_key_flags_check_and_never_print_the_key(tmp_path: Path) -> None:
    proc = run_cli("--check", "--host", "0.0.0.0")
    assert proc.returncode == 2 and "exposes the models to everyone" in proc.stderr
    proc = run_cli("--check", "--host", "0.0.0.0", "--allow-unauthenticated")
    assert proc.returncode == 0 and "no API key: anyone who reaches" in proc.stdout
    key_file = tmp_path / "key"
    key_file.write_text(KEY)
    proc = run_cli("--check", "--host", "0.0.0.0", "--api-key-file", str(key_file))
    assert proc.returncode == 0, proc.stderr
    assert f"API key required on every route (from --api-key-file {key_file})" in proc.stdout
    assert KEY not in proc.stdout + proc.stderr
    proc = run_cli("--check", "--api-key-file", str(tmp_path / "nope"))
    assert (
        proc.returncode == 2 and "--api-key-file" in proc.stderr and "no such file" in proc.stderr
    )


@pytest.mark.parametrize(
    ("fields", "sleep_after"),
    [
        ({}, 120.0),  # release 30 s < 2 min < stop 10 min
        ({"pinned": True}, 120.0),  # never stopped, still put to sleep
        ({"stop_after": "90s"}, None),  # stops before the default sleep: never sleeps
        ({"release_after": "5m"}, None),
        ({"sleep_after": "never"}, None),
        ({"sleep_after": "45s", "stop_after": "never"}, 45.0),
        ({"release_after": "never", "sleep_after": "10s"}, 10.0),
    ],
)
def test_sleep_after_sits_between_release_and_stop(
    fields: dict[str, object], sleep_after: float | None
) -> None:
    (m,) = config_from_mapping(mapping(model(**fields)), source="t").models
    assert m.sleep_after_s == sleep_after


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"sleep_after": "20s"}, "sleep_after = 20s is not longer than its release_after = 30s"),
        ({"sleep_after": "10m"}, "sleep_after = 600s is not shorter than its stop_after = 600s"),
        ({"sleep_after": "0s"}, "sleep_after = .0s.: not a positive duration"),
        ({"sleep_after": "soon"}, "sleep_after"),
        ({"sleep_after": "1m", "pd": True}, "sleep_after is not supported for a pd model"),
    ],
)
def test_bad_sleep_after_is_refused(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ServeConfigError, match=message):
        config_from_mapping(mapping(model(**fields)), source="t")


def test_pd_engines_stay_awake() -> None:
    engines = config_from_mapping(mapping(model(pd=True, min_kv="8M")), source="t").models
    assert [m.sleep_after_s for m in engines] == [None, None]
