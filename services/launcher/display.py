"""The terminal view of `pipelinerl run`: a progress bar with reward, correctness, lag and versions."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from pipelinerl.coordinator.types import RunInfo
from pipelinerl.launcher.config import RunSettings


class RunDisplay:
    def __init__(self, settings: RunSettings) -> None:
        self._by_samples = settings.max_samples > 0
        total = settings.max_samples if self._by_samples else settings.duration_s
        console = Console(stderr=True)
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
            console=console,
            disable=not console.is_terminal,  # drawn only once, at the end, it would say nothing new
        )
        self._task = self._progress.add_task(settings.mode, total=total, status="starting services")
        self._restarts: dict[str, int] = {}

    def __enter__(self) -> RunDisplay:
        self._progress.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is not None:  # the error is left alone on the screen
            self._progress.live.transient = True
        self._progress.stop()

    def update(self, run: RunInfo, elapsed_s: float) -> None:
        p = run.progress
        versions = ",".join(str(s.version) for s in p.servers)
        status = (
            f"reward {p.reward_mean:.3f}  correct {p.correct_fraction:.3f}  lag {p.lag_mean:.2f}  "
            f"zero-var {p.zero_variance_fraction:.2f}  entropy {p.entropy:.2f}  "
            f"trained {p.trained}  {p.samples_per_s:.0f}/s  v{p.trainer_version} [{versions}]"
        )
        if (e := p.episodes) is not None:
            status += (
                f"  turns {e.turns_mean:.1f}  tools {e.tool_calls}  truncated {e.truncated}/{e.episodes}"
                f"  forks {e.forks}  env errors {e.environment_errors}"
                f"  step {e.step_seconds_mean * 1e3:.0f} ms"
            )
        if run.evaluations:
            latest = run.evaluations[-1]
            status += f"  held-out {latest.pass_at_1:.3f} @v{latest.weight_version}"
        if self._restarts:
            status += "  restarts " + ",".join(f"{name}:{n}" for name, n in sorted(self._restarts.items()))
        done = p.trained if self._by_samples else elapsed_s
        self._progress.update(self._task, completed=done, status=status)

    def restarted(self, service: str, restarts: int) -> None:
        """A service was restarted (its `restarts`-th time); shown from the next update on."""
        self._restarts[service] = restarts
