"""An engine's default ledger name is one a user can type: the model's name (a built-in
model's, not its cache entry's ``tiny-llama-<digest>``), the server's port, and no pid, so
it is the same on every run; a second engine running at the same time gets ``-2``."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from elastickv.integrations.vllm.config import ElasticConfig
from elastickv.integrations.vllm.engine.registration import EngineRegistration, default_name
from elastickv.models import builtin_name_of, tiny_model_path

SERVER = ["api_server.py", "--model", "m"]


def engine(model: str, served: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(model_config=SimpleNamespace(model=model, served_model_name=served))


def test_a_builtin_models_cache_entry_is_named_as_the_model(tmp_path: Path) -> None:
    path = str(tiny_model_path("tiny-llama", tmp_path))
    assert Path(path).name.startswith("tiny-llama-") and Path(path).name != "tiny-llama"
    assert builtin_name_of(path) == "tiny-llama"
    assert builtin_name_of(path + "/") == "tiny-llama"
    assert builtin_name_of(str(tmp_path / "tiny-llama-000000000000")) is None  # a stale digest
    assert builtin_name_of(str(tmp_path / "llama-3-8b")) is None
    assert default_name(engine(path), argv=["script.py"]) == "tiny-llama"
    assert default_name(engine(path), argv=SERVER) == "tiny-llama:8000"
    assert default_name(engine(path), argv=[*SERVER, "--port", "9001"]) == "tiny-llama:9001"
    assert default_name(engine("/models/Qwen2.5-0.5B/"), argv=["x"]) == "Qwen2.5-0.5B"
    assert default_name(engine(path, served="chat"), argv=["x"]) == "chat"


def test_the_same_name_every_run_and_one_per_running_engine(tmp_path: Path) -> None:
    config = ElasticConfig(ledger_dir=str(tmp_path / "ledger"))
    first = EngineRegistration(config, "tiny-llama")
    second = EngineRegistration(config, "tiny-llama")
    try:
        assert (first.name, second.name) == ("tiny-llama", "tiny-llama-2")
        first.close()
        again = EngineRegistration(config, "tiny-llama")  # the next run: the name is free
        assert again.name == "tiny-llama"
        again.close()
    finally:
        first.close()
        second.close()
