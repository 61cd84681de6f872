"""What `pipelinerl run` checks before it starts a process, and how a user's error reads: one line
per wrong setting, `<setting>: <reason>`, the setting named as the run's settings name it.

Settings are checked as they load (pydantic); `check_run` then looks at what the settings point to
on this machine. What only a service can judge (a dataset's rows, a token limit of a model) is
judged by the coordinator at StartRun, whose refusal names a field of the run's spec
(`spec.sampling.max_new_tokens`); `setting_name` turns it back into the setting (`max_new_tokens`).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import ValidationError

from pipelinerl.common.errors import FieldViolation, InvalidArgument
from pipelinerl.common.presets import PRESETS, not_a_model
from pipelinerl.common.settings import split_config_flag
from pipelinerl.coordinator.tasks import parse_builtin
from pipelinerl.environment.loader import EnvironmentLoadError, load_agent, load_environment
from pipelinerl.launcher.config import RunSettings


def load_settings(args: list[str]) -> RunSettings:
    """The run's settings from `--config FILE`, the environment and the flags in `args`; a config
    file that cannot be read, or a value that cannot be parsed, is an InvalidArgument."""
    try:
        config, flags = split_config_flag(args)
        return RunSettings.load(config, flags)
    except ValidationError:
        raise
    except (OSError, ValueError) as exc:  # SettingsError is a ValueError too
        raise InvalidArgument(str(exc)) from exc


def check_run(settings: RunSettings) -> None:
    """InvalidArgument naming every setting that points at something missing: the dataset, the
    model of the trainer and of the inference servers, the vLLM interpreter. With
    `coordinator_address` the services and their files are elsewhere, so nothing is checked here."""
    if settings.coordinator_address is not None:
        return
    violations: list[FieldViolation] = []
    if settings.environment_class is not None and settings.environment_servers > 0:
        try:
            load_environment(settings.environment_class, settings.environment_args)
        except EnvironmentLoadError as exc:
            violations.append(FieldViolation("environment", str(exc)))
    elif settings.agent_function is not None and settings.environment_servers > 0:
        try:
            load_agent(settings.agent_function)
        except EnvironmentLoadError as exc:
            violations.append(FieldViolation("agent", str(exc)))
    elif settings.agent is not None:
        pass  # hosted apart: nothing here to check
    elif settings.dataset.startswith("builtin:"):
        try:
            parse_builtin(settings.dataset)
        except InvalidArgument as exc:
            violations += [FieldViolation("dataset", v.description) for v in exc.violations]
    elif not Path(settings.dataset).is_file():
        violations.append(FieldViolation("dataset", f"no such file: {settings.dataset}"))
    for field, model in _models(settings).items():
        if model not in PRESETS and not Path(model).is_dir():
            violations.append(FieldViolation(field, not_a_model(model)))
    if settings.engine == "vllm" and not settings.vllm_python.is_file():
        violations.append(
            FieldViolation("vllm_python", f"no such file: {settings.vllm_python} (make vllm-env)")
        )
    if violations:
        raise InvalidArgument("; ".join(f"{v.field}: {v.description}" for v in violations), violations)


def _models(settings: RunSettings) -> dict[str, str]:
    """The model each service loads: the run's `model`, unless its section gives its own."""
    models: dict[str, str] = {}
    for name, section in (("trainer", settings.trainer), ("inference", settings.inference)):
        if "model" in section.model_fields_set:
            models[f"{name}.model"] = section.model
        else:
            models["model"] = settings.model
    return models


def setting_name(field: str) -> str:
    """The setting behind a field of StartRun's spec (`spec.sampling.temperature` is
    `temperature`); a field with no setting of its own keeps its name."""
    name = field.removeprefix("spec.").removeprefix("sampling.")
    return name if name in RunSettings.model_fields else field


def user_error(exc: BaseException) -> list[str] | None:
    """`<setting>: <reason>` lines for an error the user made, None for any other error."""
    if isinstance(exc, ValidationError):
        return [_validation_line(error["loc"], error["msg"]) for error in exc.errors()]
    if isinstance(exc, InvalidArgument):
        if not exc.violations:
            return [exc.message]
        return [f"{setting_name(v.field)}: {v.description}" for v in exc.violations]
    return None


def _validation_line(loc: tuple[int | str, ...], message: str) -> str:
    path = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".")
    message = message.removeprefix("Value error, ")
    return f"{path}: {message}" if path else message
