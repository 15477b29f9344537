"""``profile.enabled=true``: a ``torch.profiler`` trace of a window of training steps.

:class:`StepProfiler` is created by ``Trainer.fit`` and told about every finished step. It records
optimizer steps ``profile.start_step .. start_step + steps - 1`` (1-based, as the progress bar
counts them) into ``<run_dir>/profile/rank<R>.<timestamp>.pt.trace.json``: a Chrome trace that
https://ui.perfetto.dev and ``chrome://tracing`` open (and TensorBoard with the torch-tb-profiler
plugin, which reads this directory layout). The step before
the window, when there is one, is a profiler warm-up step (traced, then discarded) so that starting
the tracer does not land in the first recorded step. Outside the window the profiler is idle;
disabled, the object does nothing at all.

:func:`measured_peak_bytes` measures a call's peak in torch's CPU allocator (what the memory estimate
of ``portatrain.models.memory`` is checked against on CPU).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from portatrain.config import ProfileConfig
from portatrain.errors import ConfigError

logger = logging.getLogger(__name__)


def profile_problems(cfg: ProfileConfig) -> list[str]:
    """The ``profile`` group's problems (only when profiling is on)."""
    if cfg.enabled and (cfg.start_step < 1 or cfg.steps < 1):
        return [f"profile.start_step={cfg.start_step} and profile.steps={cfg.steps} must both be >= 1"]
    return []


class StepProfiler:
    """Profile the configured step window of one ``fit()`` call.

    Args:
        cfg: the ``profile`` config group.
        out_dir: where the trace goes (created when the window is reached).
        first_step: the optimizer step ``fit()`` starts after (non-zero when resuming).
        activities: ``torch.profiler`` activities, from ``Accelerator.profiler_activities()``.
        worker_name: trace file prefix, one per rank.
    """

    def __init__(
        self,
        cfg: ProfileConfig,
        out_dir: Path,
        *,
        first_step: int,
        activities: list[torch.profiler.ProfilerActivity],
        worker_name: str,
    ) -> None:
        self._profiler: torch.profiler.profile | None = None
        if not cfg.enabled:
            return
        problems = profile_problems(cfg)
        if problems:
            raise ConfigError(problems[0])
        # Steps this fit() runs before the window opens.
        before = cfg.start_step - 1 - first_step
        if before < 0:
            logger.warning(
                "profile: the window starts at step %d but training resumes after step %d; nothing profiled",
                cfg.start_step,
                first_step,
            )
            return
        warmup = 1 if before >= 1 else 0
        out_dir.mkdir(parents=True, exist_ok=True)
        with warnings.catch_warnings():
            # torch warns when warmup=0 (window at step 1): the first step then includes tracer start-up.
            warnings.filterwarnings("ignore", message=".*warmup.*")
            self._profiler = torch.profiler.profile(
                activities=activities,
                schedule=torch.profiler.schedule(
                    wait=before - warmup, warmup=warmup, active=cfg.steps, repeat=1
                ),
                on_trace_ready=torch.profiler.tensorboard_trace_handler(
                    str(out_dir), worker_name=worker_name
                ),
                record_shapes=cfg.record_shapes,
                profile_memory=cfg.profile_memory,
                with_stack=cfg.with_stack,
            )
            self._profiler.start()
        logger.info(
            "profile: recording steps %d-%d into %s", cfg.start_step, cfg.start_step + cfg.steps - 1, out_dir
        )

    def step(self) -> None:
        """Call after every optimizer step; saves the trace when the window closes."""
        if self._profiler is not None:
            self._profiler.step()

    def close(self) -> None:
        """Stop the profiler; a window cut short by the end of training is saved as far as it got."""
        if self._profiler is not None:
            profiler, self._profiler = self._profiler, None
            profiler.stop()


def measured_peak_bytes(fn: Callable[[], object]) -> int:
    """Peak bytes held by torch's CPU allocator while ``fn()`` runs, above what was held before.

    The measurement the estimate is checked against on CPU, where there is no device allocator to
    ask: the profiler's memory events (every allocation and free through c10's CPU allocator,
    inductor's buffers included) summed in time order. ``tracemalloc`` does not see torch, and RSS
    includes the allocator's caching and the interpreter. CPU only, one thread of allocations
    (autograd on CPU runs backward in the calling thread).
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    held = peak = 0
    for event in events:
        if event.device_type() == DeviceType.CPU:
            held += event.nbytes()
            peak = max(peak, held)
    return peak
