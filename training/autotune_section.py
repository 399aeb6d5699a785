"""`--autotune` and its search space: the settings of `training.autotune` (DeepSpeed's
`autotuning` block, mapped key by key in `training.deepspeed_config`)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from training.config_sections import flag_name

RECOMPUTE_CHOICES = ("none", "selective", "full")
"""Values of --autotune-recompute: no activation recompute, or --recompute-granularity X."""
MAX_TRIAL_STEPS = 1000
"""Warm-up plus measured steps of one trial at most (a trial is a short probe, not a run)."""


def parse_size(text: str, flag: str) -> int:
    """`1100MiB`, `64GiB`, `1.5 GB` or a plain byte count -> bytes; ValueError naming `flag`."""
    # imported here: models.memory loads torch, and the flag sections stay light to import
    from models.memory import parse_bytes

    try:
        size = parse_bytes(text)
    except ValueError:
        size = 0
    if size <= 0:
        raise ValueError(f"{flag} {text!r}: give a positive size such as 1100MiB, 64GiB or 80GB")
    return size


@dataclass
class AutotuneSection:
    """Autotuning: short measured trials of the layout knobs before the run (--autotune)."""

    autotune: bool = False
    """Before training, run a short trial of each point of the search space below (a fresh
    launch of this job each), print their measured throughput and train with the fastest that
    fits (DeepSpeed's autotuning.enabled); `meshline train` only."""
    autotune_min_micro_batch_size: int = 1
    """Smallest micro-batch size tried (DeepSpeed's min_train_micro_batch_size_per_gpu)."""
    autotune_max_micro_batch_size: int | None = None
    """Largest micro-batch size tried (default: --global-batch-size / data-parallel size when
    the global batch is given, else 8; DeepSpeed's max_train_micro_batch_size_per_gpu)."""
    autotune_num_micro_batch_sizes: int = 3
    """Micro-batch sizes tried: powers of two times the smallest, up to the largest, this many
    spread evenly over that range (DeepSpeed's num_tuning_micro_batch_sizes)."""
    autotune_zero_stages: list[int] | None = None
    """ZeRO stages tried (default: 0 1 2 3 with more than one data-parallel rank, else the run's
    --zero-stage)."""
    autotune_recompute: list[str] | None = None
    """Activation recompute tried: none, selective, full (default: the run's own setting)."""
    autotune_warmup_steps: int = 3
    """Steps of each trial before measuring (DeepSpeed's start_profile_step)."""
    autotune_steps: int = 2
    """Steps measured per trial after the warm-up (DeepSpeed's end_profile_step minus
    start_profile_step)."""
    autotune_max_trials: int = 50
    """Trials run at most (DeepSpeed's tuner_num_trials)."""
    autotune_early_stopping: int = 5
    """Stop after this many trials in a row that do not beat the fastest so far (0: never;
    DeepSpeed's tuner_early_stopping)."""
    autotune_memory_limit: str | None = None
    """Reject trials whose peak memory per rank exceeds this size, e.g. 1100MiB (the device's
    peak allocation; on a CPU run the peak resident set). Default: only trials that fail
    (out of memory included) are rejected."""
    autotune_trial_timeout: float = 600.0
    """Seconds a trial may take (start-up included) before it is stopped and rejected."""
    autotune_dir: str | None = None
    """Directory for each trial's config, log and metrics and for autotune.json (default:
    autotune/ in --log-dir, else a temporary directory; DeepSpeed's results_dir)."""

    def __post_init__(self) -> None:
        for name in (
            "autotune_min_micro_batch_size",
            "autotune_num_micro_batch_sizes",
            "autotune_steps",
            "autotune_max_trials",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{flag_name(name)} must be >= 1, got {getattr(self, name)}")
        for name in ("autotune_warmup_steps", "autotune_early_stopping"):
            if getattr(self, name) < 0:
                raise ValueError(f"{flag_name(name)} must be >= 0, got {getattr(self, name)}")
        if self.autotune_warmup_steps + self.autotune_steps > MAX_TRIAL_STEPS:
            raise ValueError(
                f"--autotune-warmup-steps + --autotune-steps is "
                f"{self.autotune_warmup_steps + self.autotune_steps}; a trial runs at most "
                f"{MAX_TRIAL_STEPS} steps"
            )
        top = self.autotune_max_micro_batch_size
        if top is not None and top < self.autotune_min_micro_batch_size:
            raise ValueError(
                f"--autotune-max-micro-batch-size {top} is below --autotune-min-micro-batch-size "
                f"{self.autotune_min_micro_batch_size}"
            )
        if self.autotune_zero_stages is not None:
            bad = [s for s in self.autotune_zero_stages if s not in (0, 1, 2, 3)]
            if bad or not self.autotune_zero_stages:
                raise ValueError(
                    f"--autotune-zero-stages takes stages among 0 1 2 3, got "
                    f"{self.autotune_zero_stages}"
                )
        if self.autotune_recompute is not None:
            bad_r = [r for r in self.autotune_recompute if r not in RECOMPUTE_CHOICES]
            if bad_r or not self.autotune_recompute:
                raise ValueError(
                    f"--autotune-recompute takes values among {' '.join(RECOMPUTE_CHOICES)}, "
                    f"got {self.autotune_recompute}"
                )
        if not 0 < self.autotune_trial_timeout <= 86400:
            raise ValueError(
                f"--autotune-trial-timeout must be in (0, 86400] seconds, got "
                f"{self.autotune_trial_timeout}"
            )
        if self.autotune_memory_limit is not None:
            parse_size(self.autotune_memory_limit, "--autotune-memory-limit")
        if not self.autotune:
            defaults = AutotuneSection(autotune=True)
            given = [
                flag_name(f.name)
                for f in fields(self)
                if f.name != "autotune" and getattr(self, f.name) != getattr(defaults, f.name)
            ]
            if given:
                raise ValueError(f"{', '.join(given)} set(s) the search of --autotune: add it")

    def memory_limit_bytes(self) -> int | None:
        """--autotune-memory-limit in bytes (None: no limit)."""
        if self.autotune_memory_limit is None:
            return None
        return parse_size(self.autotune_memory_limit, "--autotune-memory-limit")
