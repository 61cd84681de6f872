"""Configuration base of every service: pydantic settings read from, in order of precedence,
CLI flags > environment variables `PIPELINERL_<SERVICE>_<FIELD>` > a YAML or TOML file > defaults.

A service declares its settings as a subclass with `env_prefix="PIPELINERL_<SERVICE>_"` and a
docstring on every field; those docstrings are the `--help` text and the configuration reference.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Self

from pydantic import Field, model_validator
from pydantic_settings import (
    BaseSettings,
    CliSuppress,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
    YamlConfigSettingsSource,
)

from pipelinerl.common.keepalive import Keepalive
from pipelinerl.common.log import LogFormat

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


class LayeredSettings(BaseSettings):
    """Settings read from CLI flags > environment > a YAML/TOML file > defaults (see `load`)."""

    model_config = SettingsConfigDict(
        use_attribute_docstrings=True,
        extra="forbid",
        cli_kebab_case=True,
        cli_implicit_flags=True,
        env_nested_delimiter="__",
    )

    # Given as `--config` (taken out before flags are parsed) or PIPELINERL_<NAME>_CONFIG_FILE.
    config_file: CliSuppress[Path | None] = Field(default=None, exclude=True)
    """YAML (.yaml/.yml) or TOML (.toml) file with values for these settings (`--config`)."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # CLI flags, when parsed, are put in front of these by pydantic-settings itself.
        assert isinstance(init_settings, InitSettingsSource)  # what pydantic-settings passes here
        path = init_settings.init_kwargs.get("config_file")
        if path is None:
            return (init_settings, env_settings)
        return (init_settings, env_settings, _file_source(settings_cls, Path(path)))

    @classmethod
    def load(cls, config_file: Path | None = None, cli_args: list[str] | None = None, **values: Any) -> Self:
        """Build the settings from a file, the environment and CLI flags (`--port 50051` ...)."""
        if config_file is None and (
            from_env := os.environ.get(f"{cls.model_config.get('env_prefix')}CONFIG_FILE")
        ):
            config_file = Path(from_env)
        if config_file is not None and not Path(config_file).is_file():
            raise FileNotFoundError(f"config file not found: {config_file}")
        if cli_args is not None:
            values["_cli_parse_args"] = cli_args
            values["_cli_prog_name"] = f"pipelinerl {cls.command_name()}"
        return cls(config_file=config_file, **values)

    @classmethod
    def command_name(cls) -> str:
        """`serve <service>` for services, `run` for the launcher (from the env prefix)."""
        name = cls.model_config.get("env_prefix", "").removeprefix("PIPELINERL_").rstrip("_").lower()
        return name if name == "run" else f"serve {name}"


class ServiceSettings(LayeredSettings):
    """Settings every gRPC service shares: where it listens, security, limits and logging."""

    host: str = "127.0.0.1"
    """Address to bind. 127.0.0.1 by default; `0.0.0.0` or `[::]` to serve other machines."""
    port: int = Field(default=0, ge=0, le=65535)
    """Port to bind; 0 picks a free one (logged at start-up, and written to `ready_file`)."""
    ready_file: Path | None = None
    """Once serving, write the bound `host:port` here (replaced atomically), so that a script
    starting the service with port 0 learns where it listens without parsing logs. When `/metrics`
    is served, a second line says where: `metrics host:port`."""
    auth_token: str | None = None
    """If set, every call except health checks must send `authorization: Bearer <token>`."""
    tls_cert_file: Path | None = None
    """PEM certificate chain; with `tls_key_file`, the server speaks TLS only."""
    tls_key_file: Path | None = None
    """PEM private key of `tls_cert_file`."""
    tls_client_ca_file: Path | None = None
    """PEM CA bundle; if set, clients must present a certificate it signed (mutual TLS)."""
    max_message_bytes: int = Field(default=DEFAULT_MAX_MESSAGE_BYTES, ge=1024)
    """Largest gRPC message sent or received, in bytes."""
    drain_seconds: float = Field(default=10.0, ge=0)
    """On SIGTERM, how long calls in flight may run before they are cancelled."""
    keepalive: Keepalive = Field(default_factory=Keepalive)
    """HTTP/2 pings on every connection of this service, to the services it calls and from its
    clients: a peer that acks none within `keepalive.timeout_s` (frozen, or cut off by the
    network) is dropped, and the calls on its connection fail UNAVAILABLE and go elsewhere."""
    metrics_port: int | None = Field(default=None, ge=0, le=65535)
    """Serve Prometheus metrics at `http://<host>:<metrics_port>/metrics` (plain HTTP, same `host`
    as gRPC); 0 picks a free port (logged). Unset: no metrics endpoint."""
    log_format: LogFormat = "console"
    """`console` for people, `json` for log collectors."""
    log_level: str = "info"
    """debug, info, warning or error."""

    @model_validator(mode="after")
    def _tls_pair(self) -> Self:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file must be set together")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ValueError("tls_client_ca_file needs tls_cert_file and tls_key_file")
        return self


def split_config_flag(args: list[str]) -> tuple[Path | None, list[str]]:
    """Take `--config FILE` (or `--config=FILE`) out of the arguments; the rest are settings flags."""
    rest: list[str] = []
    config: Path | None = None
    it = iter(args)
    for arg in it:
        if arg == "--config":
            value = next(it, None)
            if value is None:
                raise ValueError("--config needs a file")
            config = Path(value)
        elif arg.startswith("--config="):
            config = Path(arg.split("=", 1)[1])
        else:
            rest.append(arg)
    return config, rest


def _file_source(settings_cls: type[BaseSettings], path: Path) -> PydanticBaseSettingsSource:
    if path.suffix in (".yaml", ".yml"):
        return YamlConfigSettingsSource(settings_cls, yaml_file=path)
    if path.suffix == ".toml":
        return TomlConfigSettingsSource(settings_cls, toml_file=path)
    raise ValueError(f"config file must be .yaml, .yml or .toml, not {path.name}")
