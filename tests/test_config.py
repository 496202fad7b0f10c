"""Service configs: flags and SPECSERVE_* variables come from one dataclass per service."""

from __future__ import annotations

import pytest

from draft_service.config import DraftConfig
from gateway.config import GatewayConfig
from specserve.config import parse_config
from verify_service.config import VerifyConfig


def test_flag_beats_environment_beats_default(monkeypatch):
    monkeypatch.setenv("SPECSERVE_VERIFY_MAX_SESSIONS", "12")
    monkeypatch.setenv("SPECSERVE_VERIFY_PORT", "6000")
    config = parse_config(VerifyConfig, "verify", ["--port", "7000", "--model", "/m"], "verify", "")
    assert (config.port, config.max_sessions, config.max_wait_ms, config.model) == (7000, 12, 0.0, "/m")


def test_bad_values_are_usage_errors(monkeypatch, capsys):
    with pytest.raises(SystemExit):
        parse_config(DraftConfig, "draft", ["--support-size", "0"], "draft", "")
    assert "support_size must be >= 1" in capsys.readouterr().err
    monkeypatch.setenv("SPECSERVE_GATEWAY_PORT", "eighty")
    with pytest.raises(SystemExit):
        parse_config(GatewayConfig, "gateway", [], "gateway", "")
    assert "SPECSERVE_GATEWAY_PORT" in capsys.readouterr().err


def test_every_field_has_help():
    import dataclasses

    for config_cls in (DraftConfig, VerifyConfig, GatewayConfig):
        for f in dataclasses.fields(config_cls):
            assert f.metadata.get("help"), f"{config_cls.__name__}.{f.name} has no help text"
