"""ServiceConfig from flags and ENCODER_SERVICE_* variables; the CLI's help and make-checkpoint."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import fields

import pytest

from encoder_service.cli import main
from encoder_service.config import ServiceConfig
from encoder_service.config_flags import parse_serve_args

SERVE_FLAGS = ["--model", "--device", "--dtype", "--attn-backend", "--host", "--port", "--cache-bytes",
               "--max-batch-tokens", "--max-queue-images", "--max-message-bytes", "--max-image-pixels",
               "--grace-period-s", "--log-level", "--metrics-port", "--cuda-graphs", "--tls-cert", "--tls-key",
               "--tls-client-ca", "--health-port", "--auth-token-file", "--max-requests-per-client",
               "--sink-tls-ca", "--sink-tls-cert", "--sink-tls-key"]


def test_defaults_serve_the_tiny_preset_on_the_cpu():
    config = parse_serve_args([], environ={})
    assert config == ServiceConfig()
    assert config.uses_default_model and config.model_or_default == "tiny-qwen2.5-vl"
    assert config.device == "cpu" and config.max_chunk_bytes == 4 << 20


def test_environment_fills_options_and_flags_win():
    env = {"ENCODER_SERVICE_CACHE_BYTES": "1234", "ENCODER_SERVICE_PORT": "7000",
           "ENCODER_SERVICE_DTYPE": "bfloat16", "ENCODER_SERVICE_LOG_LEVEL": "debug",
           "ENCODER_SERVICE_GRACE_PERIOD_S": "2.5", "ENCODER_SERVICE_MODEL": "/ckpt"}
    config = parse_serve_args(["--port", "7001"], environ=env)
    assert (config.cache_bytes, config.port, config.dtype, config.log_level, config.grace_period_s,
            config.model) == (1234, 7001, "bfloat16", "DEBUG", 2.5, "/ckpt")


@pytest.mark.parametrize("env, message", [
    ({"ENCODER_SERVICE_CACHE_BYTES": "lots"}, "ENCODER_SERVICE_CACHE_BYTES='lots'"),
    ({"ENCODER_SERVICE_DTYPE": "float64"}, "choose from float32, float16, bfloat16"),
    ({"ENCODER_SERVICE_MAX_BATCH_TOKENS": "0"}, "max-batch-tokens must be >= 1"),
    ({"ENCODER_SERVICE_CUDA_GRAPHS": "-1"}, "cuda-graphs '-1': auto, off, or token budgets"),
    ({"ENCODER_SERVICE_CUDA_GRAPHS": "4 graphs"}, "cuda-graphs '4 graphs': auto, off, or token budgets"),
    ({"ENCODER_SERVICE_WATCHDOG_TIMEOUT_S": "-1"}, "watchdog-timeout-s must be >= 0"),
])
def test_bad_environment_values_are_named(env, message):
    with pytest.raises(ValueError, match=message):
        parse_serve_args([], environ=env)


def test_every_option_has_a_flag_an_environment_variable_and_help(capsys):
    with pytest.raises(SystemExit) as info:
        main(["serve", "--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for flag in SERVE_FLAGS:
        assert flag in text
    for f in fields(ServiceConfig):
        assert f"ENCODER_SERVICE_{f.name.upper()}" in text


def test_bad_flag_value_exits_with_usage_error():
    proc = subprocess.run([sys.executable, "-m", "encoder_service", "serve", "--max-queue-images", "0"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "max-queue-images must be >= 1" in proc.stderr


def test_make_checkpoint_writes_a_loadable_checkpoint(tmp_path, capsys):
    assert main(["make-checkpoint", "--preset", "tiny-qwen2.5-vl", "--out", str(tmp_path / "ckpt"),
                 "--seed", "1"]) == 0
    out = capsys.readouterr().out.strip()
    from encoder_service.models import load_vision_model

    model = load_vision_model(out)
    assert model.spec.model_type == "qwen2_5_vl" and model.spec.hidden_size == 48


def test_the_options_page_lists_exactly_the_serve_options(capsys):
    """docs/options.md's table equals ``serve --help``: a row for every flag and every ServiceConfig
    field, and no row for a flag that serve does not take (a renamed or removed option)."""
    import re

    from repo_paths import REPO_ROOT

    page = (REPO_ROOT / "docs" / "options.md").read_text()
    # The flags in the first cell of the options table's rows (a flag named only in prose is not listed).
    rows = [line.split("|")[1] for line in page.splitlines() if line.startswith("| `--")]
    listed = [flag for cell in rows for flag in re.findall(r"`(--[a-z0-9-]+)`", cell)]
    assert len(listed) == len(set(listed)), sorted(flag for flag in set(listed) if listed.count(flag) > 1)
    with pytest.raises(SystemExit) as info:
        main(["serve", "--help"])
    assert info.value.code == 0
    # argparse puts each option at the start of its own line, indented by two spaces.
    offered = set(re.findall(r"^  (--[a-z0-9-]+)", capsys.readouterr().out, re.M)) - {"--help"}
    fields_flags = {"--" + f.name.replace("_", "-") for f in fields(ServiceConfig)}
    assert fields_flags <= offered
    assert sorted(offered - set(listed)) == [], "serve options without a row in docs/options.md"
    assert sorted(set(listed) - offered) == [], "rows of docs/options.md for flags serve does not take"
