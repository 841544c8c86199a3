"""Typed configuration: flags > environment > defaults, help from field docstrings."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest

from kvmesh.config import ServerConfig, field_docs, load_config


@dataclass(slots=True, frozen=True)
class DemoConfig(ServerConfig):
    """A demo service."""

    env_prefix: ClassVar[str] = "KVMESH_DEMO_"

    port: int = 50099
    """Demo port."""
    model: str = "smollm2-135m"
    """Which model to load."""
    temperature: float = 0.0
    """Default temperature."""
    enabled: bool = False
    """Whether the demo is on."""
    path: Path | None = None
    """Optional file."""
    tiers: tuple[str, ...] = ()
    """Comma-separated tiers."""


def test_defaults() -> None:
    config = load_config(DemoConfig, [], environ={})
    assert config == DemoConfig()
    assert config.port == 50099 and config.host == "127.0.0.1"


def test_environment_overrides_defaults_and_flags_override_environment() -> None:
    env = {
        "KVMESH_DEMO_PORT": "1234",
        "KVMESH_DEMO_MODEL": "from-env",
        "KVMESH_DEMO_ENABLED": "yes",
        "KVMESH_DEMO_TIERS": "a, b",
        "KVMESH_DEMO_PATH": "/tmp/x",
    }
    config = load_config(DemoConfig, ["--model", "from-flag", "--temperature", "0.5"], environ=env)
    assert config.port == 1234
    assert config.model == "from-flag"
    assert config.temperature == 0.5
    assert config.enabled is True
    assert config.tiers == ("a", "b")
    assert config.path == Path("/tmp/x")
    assert load_config(DemoConfig, ["--no-enabled"], environ=env).enabled is False


def test_bad_values_name_the_setting() -> None:
    with pytest.raises(ValueError, match="KVMESH_DEMO_PORT: expected int"):
        load_config(DemoConfig, [], environ={"KVMESH_DEMO_PORT": "http"})
    with pytest.raises(ValueError, match="KVMESH_DEMO_ENABLED: expected a boolean"):
        load_config(DemoConfig, [], environ={"KVMESH_DEMO_ENABLED": "maybe"})


def test_every_field_has_a_docstring_used_as_help(capsys: pytest.CaptureFixture[str]) -> None:
    docs = field_docs(DemoConfig)
    assert docs["model"] == "Which model to load."
    assert docs["grace_s"].startswith("Seconds in-flight RPCs")
    with pytest.raises(SystemExit):
        load_config(DemoConfig, ["--help"], environ={})
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "Which model to load. [env KVMESH_DEMO_MODEL; default smollm2-135m]" in out


def test_config_is_frozen() -> None:
    config = load_config(DemoConfig, [], environ={})
    with pytest.raises(AttributeError):
        config.port = 1  # type: ignore[misc]


def test_every_engine_setting_is_a_worker_flag_and_variable(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The worker nests the engine's config: each engine field is reachable, with its help."""
    from services.worker.config import WorkerConfig
    from services.worker.engine.config import EngineConfig

    flags = [
        "--no-enable-prefix-caching",
        "--max-model-len", "512",
        "--decode-attention", "sdpa",
        "--small-batch-linear", "torch",
        "--num-kv-blocks", "64",
    ]  # fmt: skip
    env = {"KVMESH_WORKER_BLOCK_SIZE": "32", "KVMESH_WORKER_MAX_NUM_SEQS": "7"}
    config = load_config(WorkerConfig, [*flags, "--role", "decode"], environ=env)
    assert config.engine_config == EngineConfig(
        enable_prefix_caching=False,
        max_model_len=512,
        decode_attention="sdpa",
        small_batch_linear="torch",
        num_kv_blocks=64,
        block_size=32,
        max_num_seqs=7,
    )
    assert config.role == "decode"
    assert load_config(WorkerConfig, [], environ={}).engine_config == EngineConfig()
    with pytest.raises(SystemExit):
        load_config(WorkerConfig, ["--help"], environ={})
    help_text = " ".join(capsys.readouterr().out.split())
    for name in (f.name for f in dataclasses.fields(EngineConfig)):
        assert f"KVMESH_WORKER_{name.upper()}" in help_text
    assert "Reuse cached KV blocks of identical prefixes" in help_text


def test_the_workers_niceness_is_checked() -> None:
    from services.worker.config import WorkerConfig

    assert load_config(WorkerConfig, [], environ={}).nice == 10
    assert load_config(WorkerConfig, [], environ={"KVMESH_WORKER_NICE": "0"}).nice == 0
    with pytest.raises(ValueError, match=r"nice must be in \[0, 19\], got 20"):
        load_config(WorkerConfig, ["--nice", "20"], environ={}).validate()
