"""DeepSpeed JSON configurations, key by key, onto Meshline's training settings.

`--deepspeed-config FILE` (`--deepspeed_config`) reads a DeepSpeed configuration
(https://www.deepspeed.ai/docs/config-json/) and maps every key to the Meshline setting with the
same effect, or refuses it by name with the nearest equivalent; no key is dropped. Each key
becomes one `Row` of the mapping report (`meshline train --deepspeed_config X --dry-run` prints
it):

- `applied`: the key sets a training field (`optimizer.params.lr` -> --lr);
- `auto`: the value is "auto" (HF Trainer's convention): Meshline's own flag or default decides;
- `same`: Meshline already behaves as the key asks (a performance knob at DeepSpeed's default,
  a feature block with `enabled: false`, ...);
- `refused`: no equivalent behaviour; the row says what to use instead. Any refused key makes
  the flag an error listing every refused key.

Values are validated as they are read (types, ranges), errors naming the key path
(`zero_optimization.offload_param.device`). DeepSpeed's batch rule (train_batch_size = micro x
accumulation x data-parallel size) is checked; with all three given, the data-parallel size they
imply is checked against the job's (`check_world`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

Status = Literal["applied", "auto", "same", "refused"]
MAX_BYTES = 1 << 20
"""A DeepSpeed configuration is a few KiB; larger files are refused before parsing."""
MAX_DEPTH = 8
"""DeepSpeed's schema nests at most four levels; deeper JSON is refused."""


@dataclass(frozen=True)
class Row:
    """One key of the DeepSpeed configuration and what Meshline does with it."""

    key: str
    """Dotted key path, e.g. zero_optimization.offload_param.device."""
    value: Any
    """The value in the file."""
    status: Status
    """applied, auto, same or refused (see the module docstring)."""
    setting: str
    """applied/auto: the Meshline flag(s) and value; same: why nothing changes; refused: what
    to use instead."""
    fields: tuple[str, ...] = ()
    """Training fields the row sets or defers to (the dry run prints their resolved values)."""


@dataclass
class Mapping:
    """The mapped field values and the report of every key."""

    fields: dict[str, Any] = field(default_factory=dict)
    """Training field -> value, for `megatron_flags.apply`."""
    rows: list[Row] = field(default_factory=list)
    """One row per key (leaf) of the file, in file order."""
    data_parallel_size: int | None = None
    """The data-parallel size train_batch_size / (micro x accumulation) implies, when all three
    are given."""

    def refused(self) -> list[Row]:
        """The refused rows."""
        return [r for r in self.rows if r.status == "refused"]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _leaves(path: str, value: Any) -> list[tuple[str, Any]]:
    if isinstance(value, dict) and value:
        out: list[tuple[str, Any]] = []
        for key, sub in value.items():
            out += _leaves(f"{path}.{key}", sub)
        return out
    return [(path, value)]


class _Ctx:
    """The mapping under construction."""

    def __init__(self, ds: dict[str, Any], given: dict[str, Any]) -> None:
        self.ds = ds
        self.given = given
        self.out = Mapping()
        self.origin: dict[str, tuple[str, Any]] = {}  # field -> (first key setting it, value)

    def set(self, path: str, value: Any, name: str, new: Any, note: str = "") -> None:
        self.claim(path, name, new)
        self.out.fields[name] = new
        text = f"{_flag(name)} {new}" + (f" ({note})" if note else "")
        self.out.rows.append(Row(path, value, "applied", text, (name,)))

    def claim(self, path: str, name: str, new: Any) -> None:
        """Two keys of the file that set one field to different values are an error."""
        before = self.origin.get(name)
        if before is not None and self.out.fields[name] != new:
            raise ValueError(
                f"{path} means {_flag(name)} {new} but {before[0]} means {_flag(name)} "
                f"{before[1]}; make them agree"
            )
        self.origin.setdefault(name, (path, new))

    def auto(self, path: str, *names: str) -> None:
        flags = ", ".join(_flag(n) for n in names)
        self.out.rows.append(Row(path, "auto", "auto", f"{flags} (flag or default)", names))

    def same(self, path: str, value: Any, why: str) -> None:
        self.out.rows.append(Row(path, value, "same", why))

    def refuse(self, path: str, value: Any, use: str) -> None:
        self.out.rows.append(Row(path, value, "refused", use))

    def refuse_all(self, path: str, value: Any, use: str) -> None:
        for leaf, sub in _leaves(path, value):
            self.refuse(leaf, sub, use)

    def same_all(self, path: str, value: Any, why: str) -> None:
        for leaf, sub in _leaves(path, value):
            self.same(leaf, sub, why)


# --- value checks (errors name the key path)


def _is_auto(value: Any) -> bool:
    return value == "auto"


def _bool(path: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{path}: expected true or false, got {value!r}")
    return value


def _number(path: str, value: Any, *, lo: float = 0.0, integer: bool = False) -> float | int:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{path}: expected a number, got {value!r}")
    if value != value or value in (float("inf"), float("-inf")) or value < lo:
        raise ValueError(f"{path}: expected a finite number >= {lo:g}, got {value!r}")
    if integer:
        if int(value) != value:
            raise ValueError(f"{path}: expected an integer, got {value!r}")
        return int(value)
    return float(value)


def _dict(path: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got {value!r}")
    return value


def _choice(path: str, value: Any, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value.lower() not in choices:
        raise ValueError(f"{path}: expected one of {', '.join(choices)}, got {value!r}")
    return value.lower()


# --- handler factories for keys that change nothing at one value


Handler = Callable[[_Ctx, str, Any], None]


def _only(default: Any, same: str, use: str, *, allow_auto: bool = True) -> Handler:
    """Accept the value that matches Meshline's behaviour (and "auto"); refuse the others."""

    def handle(ctx: _Ctx, path: str, value: Any) -> None:
        if allow_auto and _is_auto(value):
            ctx.same(path, value, f"auto: Meshline's own ({same})")
            return
        if isinstance(default, bool):
            _bool(path, value)
        elif isinstance(default, (int, float)):
            _number(path, value, lo=float("-inf"))
        if value == default or (
            isinstance(default, str) and isinstance(value, str) and value.lower() == default.lower()
        ):
            ctx.same(path, value, same)
        else:
            ctx.refuse(path, value, use)

    return handle


def _feature(use: str, why_off: str = "the feature is off, as in Meshline") -> Handler:
    """A DeepSpeed feature block Meshline lacks: `enabled: false` is the same, anything else is
    refused (every leaf gets its row)."""

    def handle(ctx: _Ctx, path: str, value: Any) -> None:
        block = _dict(path, value)
        if "enabled" in block and _bool(f"{path}.enabled", block["enabled"]) is False:
            ctx.same_all(path, block, why_off)
        else:
            ctx.refuse_all(path, block, use)

    return handle


def _any_bool(why: str) -> Handler:
    """A switch whose both values are Meshline's behaviour."""

    def handle(ctx: _Ctx, path: str, value: Any) -> None:
        _bool(path, value)
        ctx.same(path, value, why)

    return handle


def _refuse(use: str) -> Handler:
    def handle(ctx: _Ctx, path: str, value: Any) -> None:
        ctx.refuse_all(path, value, use)

    return handle


def _block(table: dict[str, Handler], what: str) -> Handler:
    """A JSON object whose keys are handled by `table`; unknown keys are refused by name."""

    def handle(ctx: _Ctx, path: str, value: Any) -> None:
        for key, sub in _dict(path, value).items():
            sub_path = f"{path}.{key}"
            if key in table:
                table[key](ctx, sub_path, sub)
            else:
                ctx.refuse_all(sub_path, sub, f"not a key of DeepSpeed's {what} block; remove it")

    return handle


# --- batch sizes


def _batch(ctx: _Ctx, ds: dict[str, Any]) -> None:
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    vals = {k: ds[k] for k in keys if k in ds}
    ints = {k: _number(k, v, lo=1, integer=True) for k, v in vals.items() if not _is_auto(v)}
    train, micro, accum = (ints.get(k) for k in keys)
    for key in keys:
        if key not in vals:
            continue
        if _is_auto(vals[key]):
            if key == "gradient_accumulation_steps":
                ctx.same(
                    key,
                    "auto",
                    "accumulation = --global-batch-size / "
                    "(--micro-batch-size x data-parallel size)",
                )
            else:
                ctx.auto(key, "global_batch_size" if key == keys[0] else "micro_batch_size")
            continue
        if key == "train_batch_size":
            ctx.set(key, train, "global_batch_size", train)
        elif key == "train_micro_batch_size_per_gpu":
            ctx.set(key, micro, "micro_batch_size", micro)
        elif accum == 1 and train is None and "global_batch_size" not in ctx.given:
            ctx.same(
                key,
                accum,
                "no accumulation: the default global batch is --micro-batch-size x "
                "data-parallel size",
            )
        elif train is None or micro is None:
            ctx.refuse(
                key,
                accum,
                "Meshline derives accumulation from --global-batch-size / "
                "(--micro-batch-size x data-parallel size): give train_batch_size and "
                "train_micro_batch_size_per_gpu (or --global-batch-size)",
            )
        else:
            if train % (micro * accum):
                raise ValueError(
                    f"train_batch_size {train} must equal train_micro_batch_size_per_gpu "
                    f"{micro} x gradient_accumulation_steps {accum} x data-parallel size "
                    "(DeepSpeed's batch rule); fix one of them"
                )
            dp = train // (micro * accum)
            ctx.out.data_parallel_size = dp
            ctx.same(
                key,
                accum,
                f"= --global-batch-size / (--micro-batch-size x data-parallel "
                f"size); the job's data-parallel size must be {dp}",
            )


# --- optimizer

_ADAM = ("adam", "adamw")
_OTHER_OPTIMIZERS = (
    "lamb", "onebitadam", "zerooneadam", "onebitlamb", "adagrad", "lion", "muadam", "muadamw",
    "musgd", "cpuadam", "fusedadam", "adafactor", "rmsprop",
)  # fmt: skip


def _refuse_other_keys(
    ctx: _Ctx, path: str, block: dict[str, Any], known: tuple[str, ...], what: str
) -> None:
    """Refuse, by name, the keys of `block` (DeepSpeed's `what` block) outside `known`."""
    for key in block:
        if key not in known:
            ctx.refuse_all(
                f"{path}.{key}", block[key], f"not a key of DeepSpeed's {what} block; remove it"
            )


def _optimizer(ctx: _Ctx, path: str, value: Any) -> None:
    block = _dict(path, value)
    params = _dict(f"{path}.params", block.get("params", {}))
    _refuse_other_keys(ctx, path, block, ("type", "params", "legacy_fusion"), "optimizer")
    if "legacy_fusion" in block:
        _bool(f"{path}.legacy_fusion", block["legacy_fusion"])
        ctx.same(
            f"{path}.legacy_fusion",
            block["legacy_fusion"],
            "fp16 loss scaling is the trainer's; the optimizer never sees scaled gradients",
        )
    if "type" not in block:
        raise ValueError(f'{path}.type: missing (e.g. "AdamW")')
    kind = block["type"]
    if not isinstance(kind, str):
        raise ValueError(f'{path}.type: expected a name such as "AdamW", got {kind!r}')
    name = kind.lower()
    if name not in (*_ADAM, "sgd"):
        use = 'use "AdamW" or "Adam" (--optimizer adamw), or "SGD" (--optimizer sgd)'
        if name not in _OTHER_OPTIMIZERS:
            use = f"not an optimizer Meshline knows; {use}"
        ctx.refuse(f"{path}.type", kind, use)
        ctx.refuse_all(f"{path}.params", params, f"belongs to optimizer {kind!r}; {use}")
        return
    ctx.set(f"{path}.type", kind, "optimizer", "sgd" if name == "sgd" else name)
    p = f"{path}.params"
    for key, val in params.items():
        _optimizer_param(ctx, f"{p}.{key}", key, val, name)
    _optimizer_defaults(ctx, p, params, name)


def _optimizer_param(ctx: _Ctx, at: str, key: str, val: Any, name: str) -> None:
    """The row of one `optimizer.params` key of optimizer `name` (adam, adamw or sgd)."""
    if key == "lr":
        ctx.auto(at, "lr") if _is_auto(val) else ctx.set(at, val, "lr", _number(at, val))
    elif key == "weight_decay":
        if _is_auto(val):
            ctx.auto(at, "weight_decay")
        else:
            ctx.set(at, val, "weight_decay", _number(at, val))
    elif key == "betas" and name in _ADAM:
        _betas(ctx, at, val)
    elif key == "eps" and name in _ADAM:
        if _is_auto(val):
            ctx.auto(at, "adam_eps")
        else:
            eps = _number(at, val)
            if eps <= 0:
                raise ValueError(f"{at}: must be > 0, got {val!r}")
            ctx.set(at, val, "adam_eps", eps)
    elif key == "adam_w_mode" and name in _ADAM:
        if _bool(at, val):
            ctx.same(at, val, "weight decay is decoupled (AdamW), as Megatron's adam")
        else:
            ctx.refuse(
                at,
                val,
                "Meshline's Adam decays weights decoupled (AdamW); "
                "drop adam_w_mode or set weight_decay 0",
            )
    elif key == "torch_adam" and name in _ADAM:
        _bool(at, val)
        ctx.same(
            at,
            val,
            "the implementation is chosen per device (kernels/optim); the update is the same",
        )
    elif key in ("amsgrad", "nesterov") or (key == "bias_correction" and name in _ADAM):
        ok = _bool(at, val) is (key == "bias_correction")
        if ok:
            ctx.same(at, val, "Meshline's default")
        else:
            ctx.refuse(at, val, f"no {key} variant; drop the key")
    elif key == "momentum" and name == "sgd":
        if _is_auto(val):
            ctx.auto(at, "sgd_momentum")
        else:
            ctx.set(at, val, "sgd_momentum", _number(at, val))
    elif key == "dampening" and name == "sgd":
        if _number(at, val) == 0:
            ctx.same(at, val, "no dampening, as Meshline's SGD")
        else:
            ctx.refuse(at, val, "Meshline's SGD has no dampening; drop the key")
    else:
        ctx.refuse(at, val, f"not a parameter of Meshline's {name}; remove it")


def _betas(ctx: _Ctx, at: str, val: Any) -> None:
    """Adam's `betas` [beta1, beta2] onto --adam-beta1 and --adam-beta2 (one row)."""
    if _is_auto(val):
        ctx.auto(at, "adam_beta1", "adam_beta2")
        return
    if not isinstance(val, list) or len(val) != 2:
        raise ValueError(f"{at}: expected [beta1, beta2], got {val!r}")
    b1, b2 = (_number(at, b) for b in val)
    if not (b1 < 1 and b2 < 1):
        raise ValueError(f"{at}: betas must be in [0, 1), got {val!r}")
    ctx.claim(at, "adam_beta1", b1)
    ctx.claim(at, "adam_beta2", b2)
    ctx.out.fields.update(adam_beta1=b1, adam_beta2=b2)
    ctx.out.rows.append(
        Row(
            at,
            val,
            "applied",
            f"--adam-beta1 {b1} --adam-beta2 {b2}",
            ("adam_beta1", "adam_beta2"),
        )
    )


def _optimizer_defaults(ctx: _Ctx, p: str, params: dict[str, Any], name: str) -> None:
    """DeepSpeed's Adam/AdamW defaults where Meshline's differ (unless a flag sets them)."""
    defaults = [("weight_decay", "weight_decay", 0.0), ("lr", "lr", 1e-3)]
    if name == "sgd":  # torch.optim.SGD's default; Meshline's --sgd-momentum defaults to 0.9
        defaults.append(("momentum", "sgd_momentum", 0.0))
    scheduler = ctx.ds.get("scheduler")
    sched_params = scheduler.get("params") if isinstance(scheduler, dict) else None
    if isinstance(sched_params, dict) and "warmup_max_lr" in sched_params:
        defaults.remove(("lr", "lr", 1e-3))  # the scheduler's peak is the learning rate
    for key, fname, ds_default in defaults:
        if key not in params and fname not in ctx.given:
            ctx.set(f"{p}.{key}", "(absent)", fname, ds_default, "DeepSpeed's default")
    if scheduler is None and params.get("lr") != "auto" and "lr_decay_style" not in ctx.given:
        # No scheduler block: DeepSpeed keeps the optimizer's rate (Meshline's default decays).
        ctx.set("scheduler", "(absent)", "lr_decay_style", "constant", "DeepSpeed's default")


# --- scheduler


_SCHEDULER_USE = (
    "use WarmupLR, WarmupDecayLR or WarmupCosineLR (log or linear warmup), or "
    "--lr-warmup-iters N --lr-decay-style linear/cosine"
)
_SCHEDULE_STYLES = {"warmuplr": "constant", "warmupdecaylr": "linear", "warmupcosinelr": "cosine"}
"""DeepSpeed's scheduler types -> --lr-decay-style."""
_LAG_WHY = "DeepSpeed's scheduler steps after the optimizer"
"""Why WarmupLR/WarmupDecayLR set --lr-schedule-lag 1, WarmupCosineLR --lr-warmup-lag 1
(docs/training.md)."""


def _scheduler(ctx: _Ctx, path: str, value: Any) -> None:
    block = _dict(path, value)
    p = f"{path}.params"
    params = _dict(p, block.get("params", {}))
    _refuse_other_keys(ctx, path, block, ("type", "params"), "scheduler")
    kind = block.get("type")
    if not isinstance(kind, str):
        raise ValueError(f'{path}.type: expected a name such as "WarmupDecayLR", got {kind!r}')
    style = _SCHEDULE_STYLES.get(kind.lower())
    if style is None:
        ctx.refuse(
            f"{path}.type",
            kind,
            f"{kind}'s shape is not one of Meshline's schedules; {_SCHEDULER_USE}",
        )
        ctx.refuse_all(p, params, f"belongs to scheduler {kind!r}; {_SCHEDULER_USE}")
        return
    # DeepSpeed warms up logarithmically unless warmup_type is linear.
    warmup_type = _choice(f"{p}.warmup_type", params.get("warmup_type", "log"), ("log", "linear"))
    _warmup_schedule(ctx, f"{path}.type", kind, style)
    if "warmup_type" not in params:
        note = "DeepSpeed's default warmup_type"
        ctx.set(f"{p}.warmup_type", "(absent)", "lr_warmup_style", "log", note)
    for key, val in params.items():
        _scheduler_param(ctx, f"{p}.{key}", key, val, kind, style, warmup_type)
    _scheduler_defaults(ctx, p, params, style)


def _warmup_schedule(ctx: _Ctx, at: str, kind: str, style: str) -> None:
    """The scheduler's type row: the decay style, one step behind the optimizer (WarmupCosineLR:
    its warmup only, since its decay counts from the warmup's last iteration)."""
    lag = "lr_warmup_lag" if style == "cosine" else "lr_schedule_lag"
    ctx.claim(at, "lr_decay_style", style)
    ctx.claim(at, lag, 1)
    ctx.out.fields.update({"lr_decay_style": style, lag: 1})
    text = f"--lr-decay-style {style} --{lag.replace('_', '-')} 1 ({_LAG_WHY})"
    ctx.out.rows.append(Row(at, kind, "applied", text, ("lr_decay_style", lag)))


def _scheduler_param(
    ctx: _Ctx, at: str, key: str, val: Any, kind: str, style: str, warmup_type: str
) -> None:
    """The row of one `scheduler.params` key of scheduler `kind` (decay `style`)."""
    cosine = style == "cosine"
    if key == "warmup_type":
        ctx.set(at, val, "lr_warmup_style", warmup_type)
    elif key == "warmup_num_steps":
        if _is_auto(val):
            ctx.auto(at, "lr_warmup_iters")
        else:  # DeepSpeed warms up over at least 2 steps (its log warmup divides by log(n))
            steps = _number(at, val, lo=1, integer=True)
            note = "DeepSpeed's minimum of 2" if steps < 2 else ""
            ctx.set(at, val, "lr_warmup_iters", max(2, steps), note)
    elif key == "total_num_steps" and style != "constant":
        if _is_auto(val):
            ctx.auto(at, "lr_decay_iters")
        else:
            ctx.set(at, val, "lr_decay_iters", _number(at, val, lo=1, integer=True))
    elif key == "warmup_min_lr" and style == "linear":
        if not (_is_auto(val) or _number(at, val) == 0):
            ctx.refuse(at, val, "Meshline's warmup starts at lr 0; set it to 0")
        else:
            ctx.set(at, val, "min_lr", 0.0, "warmup starts at 0 and the decay ends there")
    elif key in ("warmup_min_lr", "warmup_min_ratio") and not (cosine and key == "warmup_min_lr"):
        if _is_auto(val) or _number(at, val) == 0:
            ctx.same(at, val, "warmup starts at 0, as Meshline's (and decay ends at --min-lr)")
        else:
            ctx.refuse(at, val, "Meshline's warmup starts at lr 0; set it to 0")
    elif key == "warmup_max_lr" and not cosine:
        if _is_auto(val):
            ctx.auto(at, "lr")
        else:
            ctx.set(at, val, "lr", _number(at, val))
    elif key == "cos_min_ratio" and cosine:
        _cos_min_ratio(ctx, at, val)
    elif key == "last_batch_iteration":
        if _number(at, val, lo=-1, integer=True) == -1:
            ctx.same(at, val, "the schedule starts at step 0 (or the resumed step)")
        else:
            ctx.refuse(at, val, "the schedule position comes from the checkpoint: --load")
    else:
        ctx.refuse(at, val, f"not a parameter of {kind} Meshline maps; {_SCHEDULER_USE}")


def _cos_min_ratio(ctx: _Ctx, at: str, val: Any) -> None:
    """WarmupCosineLR's floor as a fraction of the peak: --min-lr = ratio x lr."""
    if _is_auto(val):
        ctx.auto(at, "min_lr")
        return
    ratio = _number(at, val)
    if ratio > 1:
        raise ValueError(f"{at}: a ratio in [0, 1], got {val!r}")
    lr = ctx.out.fields.get("lr", ctx.given.get("lr"))
    if lr is None:
        ctx.refuse(at, val, "give optimizer.params.lr or --lr (min lr = ratio x lr), or --min-lr")
    else:
        ctx.set(at, val, "min_lr", float(ratio) * float(lr), f"{ratio} x lr {lr}")


def _scheduler_defaults(ctx: _Ctx, p: str, params: dict[str, Any], style: str) -> None:
    """DeepSpeed's defaults for the scheduler keys left out, where Meshline's differ."""
    if style == "cosine" and "cos_min_ratio" not in params and "min_lr" not in ctx.given:
        lr = ctx.out.fields.get("lr", ctx.given.get("lr"))
        if lr is not None:  # DeepSpeed's cos_min_ratio defaults to 1e-4
            ctx.set(
                f"{p}.cos_min_ratio",
                "(absent)",
                "min_lr",
                1e-4 * float(lr),
                "DeepSpeed's default ratio 0.0001 x lr",
            )
    if "warmup_num_steps" not in params and not {"lr_warmup_iters", "lr_warmup_fraction"} & set(
        ctx.given
    ):  # DeepSpeed's default for all three; Meshline's is no warmup
        ctx.set(f"{p}.warmup_num_steps", "(absent)", "lr_warmup_iters", 1000, "DeepSpeed's default")
    if style == "linear" and "warmup_max_lr" not in params and "lr" not in ctx.given:
        # WarmupDecayLR's peak defaults to 0.001 whatever the optimizer's lr (WarmupLR's to it).
        ctx.set(f"{p}.warmup_max_lr", "(absent)", "lr", 1e-3, "WarmupDecayLR's default")
    if style == "linear" and "warmup_min_lr" not in params and "min_lr" not in ctx.given:
        ctx.set(f"{p}.warmup_min_lr", "(absent)", "min_lr", 0.0, "DeepSpeed decays to 0")
    if style != "constant" and "total_num_steps" not in params:
        ctx.same(
            f"{p}.total_num_steps",
            "(absent)",
            "decay over --lr-decay-iters (default --train-iters)",
        )


# --- precision


def _fp16(ctx: _Ctx, path: str, value: Any) -> None:
    block = _dict(path, value)
    enabled = block.get("enabled", False)
    for key, val in block.items():
        at = f"{path}.{key}"
        if key == "enabled":
            if _is_auto(val):
                ctx.auto(at, "fp16")
            elif _bool(at, val):
                ctx.set(at, val, "fp16", True)
            else:
                ctx.same(at, val, "fp16 off (Meshline's default: fp32 unless --fp16/--bf16)")
        elif key == "loss_scale":
            scale = _number(at, val)
            if scale == 0:
                ctx.same(at, val, "0 = dynamic loss scaling, Meshline's default")
            else:
                ctx.set(at, val, "loss_scale", scale)
        elif key == "initial_scale_power":
            power = _number(at, val, integer=True)
            if power > 64:
                raise ValueError(f"{at}: at most 64, got {val!r}")
            ctx.set(at, val, "initial_loss_scale", float(2**power), f"2^{power}")
        elif key == "loss_scale_window":
            ctx.set(at, val, "loss_scale_window", _number(at, val, lo=1, integer=True))
        elif key == "hysteresis":
            ctx.set(at, val, "hysteresis", _number(at, val, lo=1, integer=True))
        elif key == "min_loss_scale":
            scale = _number(at, val)
            if scale <= 0:
                raise ValueError(f"{at}: must be > 0, got {val!r}")
            ctx.set(at, val, "min_loss_scale", scale)
        elif key == "consecutive_hysteresis":
            _only(
                False,
                "hysteresis is refilled when the scale grows, as Meshline's scaler",
                "Meshline refills hysteresis only when the scale grows; drop the key",
            )(ctx, at, val)
        elif key == "fused_mode":
            _any_bool("the optimizer implementation is chosen per device")(ctx, at, val)
        elif key in ("fp16_master_weights_and_grads", "auto_cast"):
            _only(
                False,
                "fp32 master weights and gradients, as Meshline",
                "Meshline keeps fp32 master weights and grads (--release-fp32-grad drops the "
                "grad copy); drop the key",
            )(ctx, at, val)
        else:
            ctx.refuse_all(at, val, "not a key of DeepSpeed's fp16 block; remove it")
    dynamic = block.get("loss_scale", 0) == 0
    if (
        enabled is True
        and dynamic
        and "initial_scale_power" not in block
        and "initial_loss_scale" not in ctx.given
    ):
        # DeepSpeed starts the dynamic scale at 2^16; Meshline's default is 2^32.
        ctx.set(
            f"{path}.initial_scale_power",
            "(absent)",
            "initial_loss_scale",
            2.0**16,
            "DeepSpeed's default 2^16",
        )


def _bf16(ctx: _Ctx, path: str, value: Any) -> None:
    for key, val in _dict(path, value).items():
        at = f"{path}.{key}"
        if key == "enabled":
            if _is_auto(val):
                ctx.auto(at, "bf16")
            elif _bool(at, val):
                ctx.set(at, val, "bf16", True)
            else:
                ctx.same(at, val, "bf16 off (Meshline's default)")
        elif key == "immediate_grad_update":
            _bool(at, val)
            ctx.same(at, val, "gradients are accumulated in fp32 and stepped once per batch")
        elif key == "check_grad_overflow":
            _only(
                False,
                "no overflow check in bf16, as Meshline",
                "use --nan-policy skip to skip steps with non-finite gradients",
            )(ctx, at, val)
        else:
            ctx.refuse_all(at, val, "not a key of DeepSpeed's bf16 block; remove it")


# --- ZeRO

_BUCKET = (
    "bucket sizes are not configurable: ZeRO-2/3 (FSDP2) reduce and gather per decoder "
    'layer, DDP in 25 MB buckets; drop the key or set "auto"'
)
_SWAP_KNOB = "a swap performance knob at DeepSpeed's default; results do not depend on it"
# Keys of an offload block that tune DeepSpeed's swapping: (default, what to do otherwise).
_SWAP_DEFAULTS: dict[str, tuple[Any, str]] = {
    "buffer_count": (4, "the optimizer tier streams through 4 buffers; drop the key or set 4"),
    "buffer_size": (1e8, "the tier's buffers are sized by Meshline; drop the key or set 1e8"),
    "max_in_cpu": (1e9, "drop the key or set 1e9"),
    "fast_init": (False, "the swap files start as zeros (sparse); drop the key"),
}


def _offload_device(ctx: _Ctx, path: str, value: Any, stage: int, which: str) -> str:
    """Map one offload block; returns its device ("none", "cpu" or "nvme")."""
    block = _dict(path, value)
    device = block.get("device", "none")
    device = _choice(f"{path}.device", device, ("none", "cpu", "nvme"))
    for key, val in block.items():
        at = f"{path}.{key}"
        if key == "device":
            _offload_target(ctx, at, val, stage, which, device, block)
        elif key == "pin_memory":
            if device == "none" or _bool(at, val) is False:
                ctx.same(at, val, "nothing pinned (nothing offloaded, or pin_memory false)")
            else:
                ctx.set(
                    at,
                    val,
                    "offload_pin_memory",
                    True,
                    "host buffers pinned where an accelerator exists; a CPU run makes no "
                    "host-device copies",
                )
        elif key == "ratio":
            _only(
                1.0,
                "everything offloaded, as Meshline",
                "partial offload is not implemented; set ratio 1.0",
            )(ctx, at, val)
        elif key == "nvme_path":
            if not isinstance(val, str) or not val:
                raise ValueError(f"{at}: expected a directory path, got {val!r}")
            if device == "nvme" and which == "param":
                # --param-nvme-path also needs --optimizer-cpu-offload (offload_optimizer), which
                # the config check names if the block is missing.
                ctx.set(at, val, "param_nvme_path", val, "the parameter shards' swap file")
            elif device == "nvme":
                ctx.set(at, val, "optimizer_nvme_path", val, "the optimizer states' swap files")
            else:
                ctx.same(at, val, f"unused: device is {device}, as DeepSpeed")
        elif key == "buffer_count" and which == "param" and device == "nvme":
            count = _number(at, val, integer=True)
            ctx.set(at, val, "param_nvme_buffer_count", count, "gathered + read-ahead layers")
        elif key in _SWAP_DEFAULTS:
            default, use = _SWAP_DEFAULTS[key]
            _only(default, _SWAP_KNOB, use)(ctx, at, val)
        elif key in ("pipeline_read", "pipeline_write", "pipeline"):
            _bool(at, val)
            ctx.same(
                at,
                val,
                "the optimizer tier always reads ahead and writes behind the step; results do "
                "not depend on it",
            )
        else:
            ctx.refuse_all(at, val, f"not a key of DeepSpeed's offload_{which} block; remove it")
    return device


def _offload_target(
    ctx: _Ctx, at: str, val: Any, stage: int, which: str, device: str, block: dict[str, Any]
) -> None:
    """The row of an offload block's `device` key."""
    if device == "none":
        ctx.same(at, val, "nothing offloaded, Meshline's default")
    elif device == "nvme" and "nvme_path" not in block:
        ctx.refuse(at, val, "NVMe offload needs nvme_path (a local directory for swap files)")
    elif which == "optimizer":
        ctx.set(
            at,
            val,
            "optimizer_cpu_offload",
            True,
            "AdamW's states and step on the CPU"
            + (", states in swap files under nvme_path" if device == "nvme" else ""),
        )
    elif stage == -1:
        ctx.refuse(at, val, 'parameter offload needs zero_optimization.stage 3 (not "auto")')
    elif stage != 3:
        ctx.refuse(
            at,
            val,
            f"parameter offload needs ZeRO-3 (as DeepSpeed), got stage {stage}; use "
            "offload_optimizer for ZeRO-1/2",
        )
    else:
        ctx.set(
            at,
            val,
            "cpu_offload",
            True,
            "ZeRO-3 parameters and gradients on the CPU"
            + (", parameter shards in a swap file under nvme_path" if device == "nvme" else ""),
        )


_PERF_SAME = "a performance knob at DeepSpeed's default; results do not depend on it"
# zero_optimization keys Meshline behaves as at one value: (value, why the same, what to use else).
_ZERO_DEFAULTS: dict[str, tuple[Any, str, str]] = {
    "allgather_partitions": (
        True,
        "parameters are all-gathered",
        "parameters are always all-gathered; drop the key",
    ),
    "reduce_scatter": (
        True,
        "gradients are reduce-scattered (ZeRO-2/3) or all-reduced",
        "gradients are always reduce-scattered under ZeRO-2/3; drop the key",
    ),
    "overlap_comm": (
        True,
        "gradient reduction overlaps backward (DDP buckets, FSDP2 per layer)",
        "gradient reduction always overlaps backward; drop the key",
    ),
    "contiguous_gradients": (
        True,
        "FSDP2 keeps each layer's gradient shard contiguous",
        "gradient shards are always contiguous; drop the key",
    ),
    "load_from_fp32_weights": (
        True,
        "resume loads the fp32 master weights",
        "resume always loads the fp32 master weights; drop the key",
    ),
    "elastic_checkpoint": (
        False,
        "checkpoints are resharded on load (DCP) anyway",
        "checkpoints are torch.distributed.checkpoint, resharded on load; drop the key",
    ),
    "ignore_unused_parameters": (
        True,
        "unused parameters get zero gradients",
        "unused parameters always get zero gradients; drop it",
    ),
    "legacy_stage1": (False, "Meshline's ZeRO-1", "no legacy stage 1; drop the key"),
    "round_robin_gradients": (
        False,
        _PERF_SAME,
        "gradients are copied to the offloaded optimizer in parameter order; drop the key",
    ),
    "grad_hooks": (
        True,
        "gradients are reduced from backward hooks",
        "gradients are always reduced from backward hooks; drop the key",
    ),
    "sub_group_size": (
        1e9,
        _PERF_SAME,
        "the optimizer steps each rank's shard at once; drop the key or set 1e9",
    ),
    "allgather_bucket_size": (5e8, _PERF_SAME, _BUCKET),
    "reduce_bucket_size": (5e8, _PERF_SAME, _BUCKET),
    "stage3_prefetch_bucket_size": (
        5e7,
        _PERF_SAME,
        "prefetch is counted in layers: use --zero3-prefetch-layers N",
    ),
    "stage3_param_persistence_threshold": (
        1e5,
        _PERF_SAME,
        'every ZeRO-3 parameter is sharded; drop the key or set "auto"',
    ),
    "stage3_model_persistence_threshold": (
        9223372036854775807,
        _PERF_SAME,
        "every ZeRO-3 parameter is sharded; drop the key",
    ),
    "stage3_max_live_parameters": (
        1e9,
        _PERF_SAME,
        "gathered parameters are freed after each layer; use --zero3-prefetch-layers N",
    ),
    "stage3_max_reuse_distance": (
        1e9,
        _PERF_SAME,
        "gathered parameters are freed after each layer; use --zero3-prefetch-layers N",
    ),
    "stage3_gather_16bit_weights_on_model_save": (
        False,
        "checkpoints hold the sharded state",
        "checkpoints are sharded (DCP); "
        "write consolidated weights with "
        "`meshline convert --load-format native --save-format hf`",
    ),
    "stage3_gather_fp16_weights_on_model_save": (
        False,
        "checkpoints hold the sharded state",
        "checkpoints are sharded (DCP); use `meshline convert --load-format native --save-format hf`",
    ),
    "zero_hpz_partition_size": (
        1,
        "no secondary partition, as Meshline",
        "ZeRO++ hpZ is not implemented; nearest: --hsdp --hsdp-shard-size N",
    ),
    "zero_quantized_weights": (
        False,
        "weights gathered unquantized",
        "ZeRO++ quantized communication is not implemented; drop the key",
    ),
    "zero_quantized_nontrainable_weights": (
        False,
        "weights gathered unquantized",
        "ZeRO++ quantized weights are not implemented; drop the key",
    ),
    "zero_quantized_gradients": (
        False,
        "gradients reduced unquantized",
        "ZeRO++ quantized gradients are not implemented; drop the key",
    ),
    "mics_shard_size": (
        -1,
        "shard over all data-parallel ranks",
        "MiCS is not implemented; nearest: --hsdp --hsdp-shard-size N",
    ),
    "mics_hierarchical_params_gather": (
        False,
        "flat all-gather",
        "MiCS is not implemented; drop the key",
    ),
    "use_multi_rank_bucket_allreduce": (True, _PERF_SAME, _BUCKET),
    "log_trace_cache_warnings": (
        False,
        "no trace-cache warnings",
        "no trace cache; drop the key",
    ),
    "pipeline_loading_checkpoint": (
        False,
        "checkpoints load per rank",
        "no pipelined checkpoint load; drop the key",
    ),
    "override_module_apply": (True, "module.apply sees full parameters", "drop the key"),
    "stage3_module_granularity_threshold": (
        0,
        _PERF_SAME,
        "parameters are gathered per decoder layer; drop the key",
    ),
    "stage3_use_all_reduce_for_fetch_params": (
        False,
        _PERF_SAME,
        "parameters are all-gathered; drop the key",
    ),
    "stage3_allgather_sequential": (
        False,
        _PERF_SAME,
        "parameters are gathered per decoder layer; drop the key",
    ),
    "stage3_partition_stream_chunk_size": (
        0,
        _PERF_SAME,
        "parameters are sharded whole; drop the key",
    ),
    "enable_sanity_checks": (False, "no extra checks", "drop the key"),
    "save_muon_momentum_buffer_in_memory": (False, "no Muon optimizer", "drop the key"),
}


def _zero(ctx: _Ctx, path: str, value: Any) -> None:
    block = _dict(path, value)
    stage = block.get("stage", 0)
    if not _is_auto(stage):
        stage = _number(f"{path}.stage", stage, integer=True)
        if stage > 3:
            raise ValueError(f"{path}.stage: 0, 1, 2 or 3, got {stage}")
    for key, val in block.items():
        at = f"{path}.{key}"
        if key == "stage":
            if _is_auto(val):
                ctx.auto(at, "zero_stage")
            else:
                ctx.set(at, val, "zero_stage", stage)
        elif key in ("offload_param", "offload_optimizer"):
            which = key.split("_")[1]
            _offload_device(ctx, at, val, -1 if _is_auto(stage) else stage, which)
        elif key in ("cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory"):
            _zero_deprecated(ctx, at, key, val, stage)
        elif key == "memory_efficient_linear":
            _bool(at, val)
            ctx.same(
                at,
                val,
                "ZeRO-3 parameters are re-gathered for backward by FSDP2 either "
                "way; the math is the same",
            )
        elif key in _ZERO_DEFAULTS:
            default, same, use = _ZERO_DEFAULTS[key]
            _only(default, same, use)(ctx, at, val)
        else:
            ctx.refuse_all(
                at,
                val,
                "not a key of DeepSpeed's zero_optimization block Meshline knows; remove it",
            )


def _zero_deprecated(ctx: _Ctx, at: str, key: str, val: Any, stage: int | str) -> None:
    """DeepSpeed's deprecated offload spellings (before the offload_* blocks)."""
    if key == "cpu_offload":  # deprecated spelling of offload_optimizer.device cpu
        if _bool(at, val) is False:
            ctx.same(at, val, "nothing offloaded (deprecated key)")
        else:
            ctx.set(at, val, "optimizer_cpu_offload", True, "deprecated key")
    elif key == "cpu_offload_param":  # deprecated spelling of offload_param.device cpu
        if _bool(at, val) is False:
            ctx.same(at, val, "nothing offloaded (deprecated key)")
        elif stage == 3:
            ctx.set(at, val, "cpu_offload", True, "deprecated key")
        else:
            ctx.refuse(at, val, f"parameter offload needs ZeRO-3, got stage {stage}")
    elif _bool(at, val):  # cpu_offload_use_pin_memory: deprecated spelling of pin_memory
        ctx.set(at, val, "offload_pin_memory", True, "deprecated key")
    else:
        ctx.same(at, val, "nothing pinned (deprecated key)")


# --- activation checkpointing, logging, monitors


def _activation_checkpointing(ctx: _Ctx, path: str, value: Any) -> None:
    table: dict[str, Handler] = {
        "partition_activations": _only(
            False,
            "activations are not partitioned",
            "use --sequence-parallel to shard activations over tensor-parallel ranks",
        ),
        "cpu_checkpointing": _only(
            False,
            "checkpoints stay on the device",
            "recomputed layers' inputs stay on the device; drop the key",
        ),
        "contiguous_memory_optimization": _only(False, "no contiguous buffer", "drop the key"),
        "number_checkpoints": _only(None, "Meshline counts layers", "use --recompute-num-layers N"),
        "synchronize_checkpoint_boundary": _only(False, "no extra synchronisation", "drop the key"),
        "profile": _only(False, "no checkpoint profiling", "use --profile"),
    }
    _block(table, "activation_checkpointing")(ctx, path, value)
    ctx.out.rows.append(
        Row(
            path,
            "(block)",
            "same",
            "the block configures DeepSpeed's "
            "checkpointing API; recompute itself is --checkpoint-activations / "
            "--recompute-granularity full",
        )
    )


def _monitor(name: str) -> Handler:
    def handle(ctx: _Ctx, path: str, value: Any) -> None:
        block = _dict(path, value)
        enabled = _bool(f"{path}.enabled", block.get("enabled", False))
        out_path = block.get("output_path", "")
        job = block.get("job_name", "DeepSpeedJobName")
        for key, val in block.items():
            at = f"{path}.{key}"
            if key not in ("enabled", "output_path", "job_name"):
                ctx.refuse_all(at, val, f"not a key of DeepSpeed's {name} block; remove it")
            elif not enabled:
                ctx.same(at, val, f"{name} off; Meshline writes metrics only with --log-dir")
            elif key == "enabled":
                ctx.same(at, val, "--log-dir holds metrics.csv and TensorBoard events")
            elif not isinstance(val, str) or "\x00" in val:
                raise ValueError(f"{at}: expected a path string, got {val!r}")
        if enabled:
            if not isinstance(out_path, str) or not isinstance(job, str):
                raise ValueError(f"{path}: output_path and job_name must be strings")
            log_dir = str(Path(out_path or ".") / job)
            previous = ctx.out.fields.get("log_dir")
            if previous is not None and previous != log_dir:
                raise ValueError(
                    f"{path}: writes to {log_dir} but another monitor block writes to "
                    f"{previous}; Meshline writes every monitor to one --log-dir"
                )
            ctx.out.fields["log_dir"] = log_dir
            for key in ("output_path", "job_name"):
                if key in block:
                    ctx.out.rows.append(
                        Row(
                            f"{path}.{key}",
                            block[key],
                            "applied",
                            f"--log-dir {log_dir}",
                            ("log_dir",),
                        )
                    )
            if "output_path" not in block and "job_name" not in block:
                ctx.out.rows.append(
                    Row(f"{path}.enabled", True, "applied", f"--log-dir {log_dir}", ("log_dir",))
                )

    return handle


def _steps_per_print(ctx: _Ctx, path: str, value: Any) -> None:
    ctx.set(path, value, "log_interval", _number(path, value, lo=1, integer=True))


def _gradient_clipping(ctx: _Ctx, path: str, value: Any) -> None:
    if _is_auto(value):
        ctx.auto(path, "clip_grad")
    else:
        ctx.set(path, value, "clip_grad", _number(path, value))


def _fp32_only(what: str) -> Handler:
    def handle(ctx: _Ctx, path: str, value: Any) -> None:
        if value in (None, "fp32", "float32", "auto"):
            ctx.same(path, value, f"{what} in fp32, as Meshline")
        else:
            ctx.refuse(path, value, f"{what} is always fp32 in Meshline; drop the key")

    return handle


_TOP: dict[str, Handler] = {
    "optimizer": _optimizer,
    "scheduler": _scheduler,
    "fp16": _fp16,
    "bf16": _bf16,
    "bfloat16": _bf16,
    "zero_optimization": _zero,
    "gradient_clipping": _gradient_clipping,
    "steps_per_print": _steps_per_print,
    "activation_checkpointing": _activation_checkpointing,
    "tensorboard": _monitor("tensorboard"),
    "csv_monitor": _monitor("csv_monitor"),
    "wall_clock_breakdown": _only(
        False,
        "no per-phase timers",
        "use --profile (a torch.profiler trace of steps --profile-step-start..end)",
    ),
    "memory_breakdown": _only(False, "no memory breakdown", "use --profile --profile-with-memory"),
    "dump_state": _only(False, "no state dump", "use --dry-run --world-size N for the layout"),
    "prescale_gradients": _only(
        False,
        "gradients are averaged after the reduction",
        "gradients are averaged after the reduction; drop the key",
    ),
    "gradient_predivide_factor": _only(
        1.0,
        "no pre-division",
        "gradients are averaged after the reduction; drop the key or set 1.0",
    ),
    "communication_data_type": _fp32_only("gradient reduction"),
    "seq_parallel_communication_data_type": _fp32_only("sequence-parallel communication"),
    "data_types": _block({"grad_accum_dtype": _fp32_only("gradient accumulation")}, "data_types"),
    "sparse_gradients": _only(
        False, "dense gradients", "embeddings have dense gradients; drop the key"
    ),
    "zero_allow_untested_optimizer": _any_bool("every Meshline optimizer works with ZeRO"),
    "vocabulary_size": lambda ctx, path, value: ctx.set(
        path, value, "vocab_size", _number(path, value, lo=1, integer=True)
    ),
    "graph_harvesting": _only(False, "no CUDA graph capture", "use --compile"),
    "use_data_before_expert_parallelism": _only(
        False,
        "expert-parallel groups are taken within data-parallel groups",
        "the expert/data rank order is fixed (--expert-model-parallel-size); drop the key",
    ),
    "seq_parallel_comm_data_type": _fp32_only("sequence-parallel communication"),
    "sequence_parallel_size": _only(
        1, "no Ulysses sequence parallelism", "use --context-parallel-size N (ring attention)"
    ),
    "torch_autocast": _feature("use --bf16 or --fp16 (fp32 master weights)"),
    "zero_force_ds_cpu_optimizer": _any_bool(
        "picks DeepSpeed's CPU optimizer under optimizer offload; Meshline's offload always "
        "steps its own vectorised CPU AdamW"
    ),
    "dataloader_drop_last": _only(
        True,
        "incomplete global batches are never formed",
        "the sampler serves whole global batches only; drop the key",
    ),
    "disable_allgather": _only(False, "parameters are all-gathered", "drop the key"),
    "amp": _feature("use fp16.enabled or bf16.enabled (--fp16 / --bf16)"),
    "flops_profiler": _feature(
        "use --profile; the metrics line reports TFLOP/s (set --peak-tflops for MFU)"
    ),
    "comms_logger": _feature("use --profile (collectives appear in the trace)"),
    "wandb": _feature(
        "Weights & Biases is not supported: use --log-dir (metrics.csv and TensorBoard)"
    ),
    "comet": _feature("Comet is not supported: use --log-dir (metrics.csv and TensorBoard)"),
    # `meshline train --autotune` (training.autotune): measured trials, the fastest that fits.
    "autotuning": lambda ctx, path, value: (
        ctx.same_all(path, value, "autotuning is off (DeepSpeed's default), as without --autotune")
        if _dict(path, value).get("enabled", False) is False
        else _block(
            {
                "enabled": lambda c, p, v: c.set(p, v, "autotune", _bool(p, v)),
                "fast": _only(
                    True,
                    "the micro-batch size and ZeRO stage are tuned (and --autotune-recompute)",
                    "fast: false also tunes ZeRO's bucket and overlap knobs, which Meshline's "
                    "autotuner does not; set true",
                ),
                "metric": _only(
                    "throughput",
                    "trials are ranked by measured tokens/s",
                    "Meshline ranks trials by measured throughput (tokens/s); set throughput",
                ),
                "start_profile_step": lambda c, p, v: c.set(
                    p, v, "autotune_warmup_steps", _number(p, v, integer=True)
                ),
                "end_profile_step": lambda c, p, v: c.set(
                    p,
                    v,
                    "autotune_steps",
                    _number(
                        p,
                        v,
                        lo=_number(
                            f"{path}.start_profile_step",
                            value.get("start_profile_step", 3),
                            integer=True,
                        )
                        + 1,
                        integer=True,
                    )
                    - _number(
                        f"{path}.start_profile_step",
                        value.get("start_profile_step", 3),
                        integer=True,
                    ),
                    "measured steps: end_profile_step - start_profile_step",
                ),
                "num_tuning_micro_batch_sizes": lambda c, p, v: c.set(
                    p, v, "autotune_num_micro_batch_sizes", _number(p, v, lo=1, integer=True)
                ),
                "min_train_micro_batch_size_per_gpu": lambda c, p, v: c.set(
                    p, v, "autotune_min_micro_batch_size", _number(p, v, lo=1, integer=True)
                ),
                "max_train_micro_batch_size_per_gpu": lambda c, p, v: c.set(
                    p, v, "autotune_max_micro_batch_size", _number(p, v, lo=1, integer=True)
                ),
                "tuner_num_trials": lambda c, p, v: c.set(
                    p, v, "autotune_max_trials", _number(p, v, lo=1, integer=True)
                ),
                "tuner_early_stopping": lambda c, p, v: c.set(
                    p, v, "autotune_early_stopping", _number(p, v, integer=True)
                ),
                "tuner_type": _only(
                    "gridsearch",
                    "the grid is run in order",
                    "Meshline runs the grid in order (gridsearch); random and model_based "
                    "are not implemented",
                ),
                "results_dir": lambda c, p, v: (
                    c.set(p, v, "autotune_dir", v)
                    if isinstance(v, str) and v and "\x00" not in v
                    else c.refuse(p, v, "expected a directory path")
                ),
                "exps_dir": _refuse(
                    "each trial's config, log and metrics go into results_dir "
                    "(--autotune-dir); drop exps_dir"
                ),
                "overwrite": _only(
                    True,
                    "every trial is run again",
                    "Meshline reruns every trial (earlier measurements are not reused); set true",
                ),
                "mp_size": _only(1, "no model parallelism", "use --tensor-model-parallel-size N"),
                **{
                    key: _only(None, "unset, as Meshline", use)
                    for key, use in (
                        ("metric_path", "the measures are in results_dir/autotune.json"),
                        ("arg_mappings", "the tuned settings are Meshline's own flags"),
                        ("model_info", "Meshline counts the model itself"),
                        ("model_info_path", "Meshline counts the model itself"),
                        ("max_train_batch_size", "use --autotune-max-micro-batch-size"),
                        ("min_train_batch_size", "use --autotune-min-micro-batch-size"),
                    )
                },
            },
            "autotuning",
        )(ctx, path, value)
    ),
    "elasticity": _feature("elastic batch sizes are not supported: fix --global-batch-size"),
    "aio": _block(
        {
            key: _only(
                default,
                _SWAP_KNOB,
                "Meshline's swap I/O is pread/pwrite on a thread pool, not libaio; drop the key",
            )
            for key, default in (
                ("block_size", 1048576),
                ("queue_depth", 8),
                ("thread_count", 1),
                ("single_submit", False),
                ("overlap_events", True),
                ("intra_op_parallelism", 1),
                ("use_gds", False),
            )
        },
        "aio",
    ),
    "checkpoint": _block(
        {
            "tag_validation": _only("Warn", "checkpoints are validated on load", "drop the key"),
            "load_universal": _only(
                False,
                "checkpoints reshard on load",
                "checkpoints are torch.distributed.checkpoint and reshard on "
                "load to any layout; drop the key",
            ),
            "use_node_local_storage": _only(
                False,
                "--save is one shared directory",
                "--save must be storage all ranks share; drop the key",
            ),
            "parallel_write": _refuse("checkpoint writes are DCP's; use --async-save"),
        },
        "checkpoint",
    ),
    "hybrid_engine": _feature("RLHF generation is not part of `meshline train`; drop the block"),
    "sparse_attention": _refuse("sparse attention is not implemented: use --attention-backend"),
    "pipeline": _refuse("use --pipeline-model-parallel-size and --pipeline-schedule"),
    "progressive_layer_drop": _feature("progressive layer drop is not implemented"),
    "curriculum_learning": _feature(
        "curriculum learning is not implemented; use --rampup-batch-size for a batch ramp"
    ),
    "data_efficiency": _feature("data efficiency (curriculum, random-LTD) is not implemented"),
    "compression_training": _refuse(
        "compression training is not implemented; quantize afterwards with `meshline convert`"
    ),
    "weight_quantization": _refuse("quantize afterwards with `meshline convert`"),
    "quantize_training": _feature("quantized training is not implemented: use --bf16"),
    "eigenvalue": _feature("eigenvalue computation is not implemented"),
    "nebula": _feature("checkpoints are torch.distributed.checkpoint: use --async-save"),
    "compile": _feature("use --compile (torch.compile per decoder layer)"),
    "tensor_parallel": _refuse("use --tensor-model-parallel-size N"),
    "timers": _refuse("the metrics line reports step time and throughput; drop the block"),
}

_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def map_config(ds: dict[str, Any], given: dict[str, Any] | None = None) -> Mapping:
    """Map a parsed DeepSpeed configuration; `given`: the field values already set by flags
    (DeepSpeed defaults that differ from Meshline's are applied only where no flag is given).
    Invalid values raise ValueError naming the key path; refusals are rows (see `refused`)."""
    _dict("the DeepSpeed configuration", ds)
    ctx = _Ctx(ds, dict(given or {}))
    _batch(ctx, ds)
    # The optimizer first: the scheduler's cos_min_ratio is a fraction of its learning rate.
    order = sorted(ds, key=lambda k: k != "optimizer")
    for key in order:
        val = ds[key]
        if key in _BATCH_KEYS:
            continue
        handler = _TOP.get(key)
        if handler is None:
            ctx.refuse_all(key, val, "not a DeepSpeed configuration key Meshline knows; remove it")
        else:
            handler(ctx, key, val)
    fields = ctx.out.fields
    if fields.get("fp16") and fields.get("bf16"):
        raise ValueError("fp16.enabled and bf16.enabled are both true; enable one")
    return ctx.out


def _depth(value: Any, level: int = 0) -> int:
    if isinstance(value, dict):
        return max([level, *(_depth(v, level + 1) for v in value.values())])
    if isinstance(value, list):
        return max([level, *(_depth(v, level + 1) for v in value)])
    return level


def load(path: str | os.PathLike[str], flag: str = "--deepspeed-config") -> dict[str, Any]:
    """Read and check a DeepSpeed JSON file (size, syntax, an object, nesting)."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"{flag} {path}: no such file")
    if file.stat().st_size > MAX_BYTES:
        raise ValueError(f"{flag} {path}: larger than {MAX_BYTES} bytes; not a DeepSpeed config")
    try:
        ds = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise ValueError(f"{flag} {path}: not valid JSON ({exc})") from None
    if not isinstance(ds, dict):
        raise ValueError(f"{flag} {path}: expected a JSON object")
    if _depth(ds) > MAX_DEPTH:
        raise ValueError(f"{flag} {path}: nested deeper than {MAX_DEPTH} levels")
    return ds


def read(path: str, given: dict[str, Any], flag: str = "--deepspeed-config") -> Mapping:
    """Load and map `path`; errors are prefixed with the flag and the file."""
    ds = load(path, flag)
    try:
        return map_config(ds, given)
    except ValueError as exc:
        raise ValueError(f"{flag} {path}: {exc}") from None


def check_world(mapping: Mapping, dp_size: int, flag: str = "--deepspeed-config") -> None:
    """DeepSpeed's batch rule against the job's data-parallel size."""
    dp = mapping.data_parallel_size
    if dp is not None and dp != dp_size:
        raise ValueError(
            f"{flag}: train_batch_size = micro x gradient_accumulation_steps x data-parallel "
            f"size needs {dp} data-parallel ranks, but this job has {dp_size}; change "
            "gradient_accumulation_steps or the job size"
        )


def convert(value: Any, given: dict[str, Any]) -> dict[str, Any]:
    """`megatron_flags` convert: the field values, or ValueError listing every refused key."""
    mapping = read(str(value), given)
    refused = mapping.refused()
    if refused:
        lines = "; ".join(f"{r.key}: {r.setting}" for r in refused)
        raise ValueError(
            f"--deepspeed-config {value}: {len(refused)} key(s) refused (Meshline has no "
            f"setting with the same effect): {lines}"
        )
    if mapping.data_parallel_size is not None and "WORLD_SIZE" in os.environ:
        world = int(os.environ["WORLD_SIZE"])
        mp = 1
        for name in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
        ):
            mp *= int(given.get(name) or 1)
        check_world(mapping, world // mp)
    return dict(mapping.fields)


def path_in_argv(argv: list[str]) -> str | None:
    """The --deepspeed-config (--deepspeed_config) value of a training command line, if any."""
    names = ("--deepspeed-config", "--deepspeed_config")
    found = None
    for i, arg in enumerate(argv):
        if arg in names and i + 1 < len(argv):
            found = argv[i + 1]
        elif arg.startswith(tuple(n + "=" for n in names)):
            found = arg.split("=", 1)[1]
    return found


def format_table(mapping: Mapping, resolved: Callable[[str], Any] | None = None) -> str:
    """The mapping report, one line per key: key = value -> Meshline setting, or refused.

    `resolved(field)` gives the run's resolved value of a field (shown for auto rows)."""
    width = min(max([len(r.key) for r in mapping.rows] + [10]), 60)
    counts = {s: sum(r.status == s for r in mapping.rows) for s in ("applied", "auto", "same")}
    head = ", ".join(f"{n} {s}" for s, n in counts.items())
    lines = [f"{len(mapping.rows)} keys: {head}, {len(mapping.refused())} refused"]
    lines += [f"{'DeepSpeed key':<{width}}  {'value':<14}  Meshline"]
    lines.append("-" * (width + 40))
    for row in mapping.rows:
        value = json.dumps(row.value) if not isinstance(row.value, str) else row.value
        if row.status == "refused":
            text = f"refused: {row.setting}"
        elif row.status == "same":
            text = f"same: {row.setting}"
        else:
            text = row.setting
            if resolved is not None and row.fields:
                now = ", ".join(f"{_flag(f)}={resolved(f)}" for f in row.fields)
                text += f"  [resolved: {now}]"
        lines.append(f"{row.key:<{width}}  {value[:14]:<14}  {text}")
    return "\n".join(lines)
