"""Server flags → ServerConfig (validation names the flag) and the one-line log formats."""

from __future__ import annotations

import argparse
import io
import json
import logging
from pathlib import Path

import pytest

from services.common.config import ServerConfig, add_server_flags, server_config_from_args
from services.common.logging import setup_logging


def _parse(argv: list[str]) -> ServerConfig:
    parser = argparse.ArgumentParser()
    add_server_flags(parser, default_port=50051)
    return server_config_from_args(parser.parse_args(argv))


def test_flags_map_onto_the_config(tmp_path: Path) -> None:
    assert _parse([]) == ServerConfig(port=50051)
    token = tmp_path / "token"
    token.write_text("t")
    config = _parse(
        ["--host", "0.0.0.0", "--port", "0", "--max-concurrent-rpcs", "8", "--max-message-mb", "16",
         "--grace-period", "2.5", "--auth-token-file", str(token), "--state-dir", str(tmp_path),
         "--log-level", "debug", "--log-format", "json"]
    )  # fmt: skip
    assert (config.host, config.port, config.max_concurrent_rpcs) == ("0.0.0.0", 0, 8)
    assert config.max_message_bytes == 16 * 1024 * 1024
    assert (config.grace_s, config.auth_token_file, config.state_dir) == (
        2.5,
        str(token),
        str(tmp_path),
    )
    assert (config.log_level, config.log_format, config.tls) == ("debug", "json", False)
    parser = argparse.ArgumentParser()
    add_server_flags(parser, default_port=1)
    help_text = parser.format_help()
    for flag in ("--grace-period", "--tls-client-ca", "--state-dir", "--max-concurrent-rpcs"):
        assert flag in help_text


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"port": 70000}, "--port"),
        ({"host": ""}, "--host"),
        ({"max_concurrent_rpcs": 0}, "--max-concurrent-rpcs"),
        ({"max_message_mb": 4096}, "--max-message-mb"),
        ({"grace_s": -1}, "--grace-period"),
        ({"log_level": "verbose"}, "--log-level"),
        ({"log_format": "xml"}, "--log-format"),
        ({"auth_token_file": "/nonexistent/token"}, "--auth-token-file"),
        ({"tls_key": "/nonexistent/key"}, "--tls-cert and --tls-key"),
        ({"tls_client_ca": "/nonexistent/ca"}, "--tls-client-ca"),
    ],
)
def test_bad_values_name_the_flag(kwargs: dict, flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        ServerConfig(**kwargs)


def test_state_dir_must_be_a_directory(tmp_path: Path) -> None:
    file = tmp_path / "f"
    file.write_text("")
    with pytest.raises(ValueError, match="--state-dir"):
        ServerConfig(state_dir=str(file))


def test_json_and_text_lines_carry_extras_and_tracebacks_on_one_line() -> None:
    logger = logging.getLogger("meshline.test")
    root = logging.getLogger()
    saved = (root.level, list(root.handlers))
    try:
        stream = io.StringIO()
        setup_logging("info", "json", stream=stream)
        logger.debug("hidden")
        logger.info("serving %s", "svc", extra={"port": 50051})
        try:
            raise KeyError("boom")
        except KeyError:
            logger.exception("failed")
        lines = stream.getvalue().splitlines()
        assert len(lines) == 2
        first, second = (json.loads(line) for line in lines)
        assert (first["msg"], first["port"], first["level"]) == ("serving svc", 50051, "info")
        assert first["logger"] == "meshline.test" and first["ts"].endswith("Z")
        assert "KeyError: 'boom'" in second["exc"]

        stream = io.StringIO()
        setup_logging("debug", "text", stream=stream)
        logger.debug("two\nlines", extra={"path": "/a b", "n": 3})
        try:
            raise ValueError("bad")
        except ValueError:
            logger.exception("oops")
        lines = stream.getvalue().splitlines()
        assert len(lines) == 2
        assert "DEBUG meshline.test: two\\nlines" in lines[0]
        assert 'path="/a b"' in lines[0] and "n=3" in lines[0]
        assert "ERROR meshline.test: oops exc=" in lines[1] and "ValueError: bad" in lines[1]
        with pytest.raises(ValueError, match="--log-format"):
            setup_logging("info", "xml")
    finally:
        for handler in list(root.handlers):
            if handler not in saved[1]:
                root.removeHandler(handler)
        root.setLevel(saved[0])


def test_what_a_service_logs_while_it_builds_reaches_the_log(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Building a service loads its model, which logs the choices it made (the inference
    engine's `--cpu-linear auto` layout, the decode step). Those lines were dropped: logging
    was set up by `run`, after the build."""
    from services.common.service_cli import ServiceCli, service_main

    def build(args: argparse.Namespace, config: ServerConfig) -> list:
        logging.getLogger("engine.test").info("layout chosen", extra={"layout": "colmajor"})
        raise ValueError("--load: stop here (the test needs no server)")

    spec = ServiceCli("probe", 50099, "test service", lambda parser: None, build)
    root = logging.getLogger()
    saved = (root.level, list(root.handlers))
    try:
        assert service_main(spec, ["serve", "--log-format", "json"]) == 2
    finally:
        for handler in list(root.handlers):
            if handler not in saved[1]:
                root.removeHandler(handler)
        root.setLevel(saved[0])
    err = capsys.readouterr().err.splitlines()
    logged = [json.loads(line) for line in err if line.startswith("{")]
    assert [(e["logger"], e["msg"], e["layout"]) for e in logged] == [
        ("engine.test", "layout chosen", "colmajor")
    ]
    assert err[-1] == "probe serve: --load: stop here (the test needs no server)"
