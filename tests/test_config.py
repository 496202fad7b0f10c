"""Service configs: flags and SPECSERVE_* variables come from one dataclass per service."""

from __future__ import annotations

import os

import pytest

from draft_service.config import DraftConfig
from gateway.config import GatewayConfig
from specserve.config import parse_config, parse_cpus
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
    with pytest.raises(SystemExit):
        parse_config(VerifyConfig, "verify", ["--copy-min-ngram", "-1"], "verify", "")
    assert "copy_min_ngram must be >= 0" in capsys.readouterr().err
    monkeypatch.setenv("SPECSERVE_GATEWAY_PORT", "eighty")
    with pytest.raises(SystemExit):
        parse_config(GatewayConfig, "gateway", [], "gateway", "")
    assert "SPECSERVE_GATEWAY_PORT" in capsys.readouterr().err


def test_every_field_has_help():
    import dataclasses

    for config_cls in (DraftConfig, VerifyConfig, GatewayConfig):
        for f in dataclasses.fields(config_cls):
            assert f.metadata.get("help"), f"{config_cls.__name__}.{f.name} has no help text"


def test_cpus_take_taskset_lists_and_refuse_what_this_process_cannot_use(capsys):
    cpus = sorted(os.sched_getaffinity(0))
    assert parse_cpus("") == frozenset()
    assert parse_cpus(f" {cpus[0]} ") == {cpus[0]}
    assert parse_cpus(",".join(map(str, cpus))) == set(cpus)
    assert parse_cpus(f"{cpus[0]}-{cpus[0]}, {cpus[0]}") == {cpus[0]}
    for bad, message in (("x", "not a CPU id"), ("3-1", "runs backwards"), ("1-", "not a CPU id"),
                         (str(max(cpus) + 1), "not among this process's CPUs")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            parse_cpus(bad)
    with pytest.raises(SystemExit):
        parse_config(VerifyConfig, "verify", ["--cpus", "0-x"], "verify", "")
    assert "cpus: '0-x'" in capsys.readouterr().err


def test_up_limits_a_draft_services_speculation_to_one_request_on_the_cpu_unless_told(monkeypatch, capsys):
    from specserve import cli, up

    def gateway_flags(*argv: str) -> list[str]:
        args = cli._parser().parse_args(["up", *argv])
        assert up.resolve_models(args) is None
        command = up._gateway_command(args)
        return command[command.index("--verify-address") + 2 :]

    monkeypatch.delenv("SPECSERVE_GATEWAY_MAX_SPECULATING_REQUESTS", raising=False)
    limit = ["--max-speculating-requests", str(up.CPU_MAX_SPECULATING_REQUESTS)]
    assert gateway_flags("--device", "cpu", "--draft-service") == limit
    assert gateway_flags("--device", "cpu") == []  # the verifier drafts: its K choice weighs the batch
    assert gateway_flags("--device", "cuda:0", "--draft-service") == []
    assert gateway_flags("--device", "cpu", "--max-speculating-requests", "0") == ["--max-speculating-requests", "0"]
    monkeypatch.setenv("SPECSERVE_GATEWAY_MAX_SPECULATING_REQUESTS", "4")
    assert gateway_flags("--device", "cpu", "--draft-service") == []  # the gateway reads the variable itself
    assert up.up(cli._parser().parse_args(["up", "--max-speculating-requests", "many"])) == 2
    assert "takes auto or a count" in capsys.readouterr().err
