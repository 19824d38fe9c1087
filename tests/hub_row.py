"""What `tests.hub_coverage.check` measured for one keras-hub architecture, and what kmix misses.

A `Row` holds the figures of float32, plain Keras mixed precision and kmix on
one architecture and one half dtype; `Row.failures()` names the criteria
kmix misses:

- `crash`: kmix crashes (said so where plain Keras crashes too);
- `finite`: kmix's outputs are not finite;
- `error`: kmix's error against float32 is above 5e-2 (bfloat16) / 1e-2
  (float16) and above 1.5x plain Keras's;
- `reload`: a `.keras` save -> `keras.models.load_model` of kmix's model does
  not predict bitwise what the placed model predicted (where plain Keras's
  own reload is not exact either, kmix may say so in a warning instead, if
  what it advises -- loading under `kmix.policy_scope`, or autocasting the
  reloaded model -- predicts bitwise what the placed model predicted);
- `fit`: `fit` crashes, or the losses before its two applied steps are not
  finite or not within `Row.fit_tolerance` of float32's (a dynamic loss
  scale's skipped steps left out: at most `MAX_SKIPPED`, 16).
"""

import dataclasses
import re

import numpy as np

TOLERANCE = {"bfloat16": 5e-2, "float16": 1e-2}
"""The largest output error accepted from kmix, relative to float32's largest output."""

KEPT_TO_KERAS = 1.5
"""kmix's error is accepted up to this many times plain Keras's error as well."""


def first_line(error):
    """`"TypeError: first line of the message (in Block.call())"`, at most 300 characters.

    Keras's "Exception encountered when calling Block.call()" wrapper lines
    give their place at the end; TensorFlow's `{{function_node ...}}`
    prefix and terminal colour codes are left out.
    """
    lines = [_ANSI.sub("", line).strip() for line in str(error).splitlines()]
    where = ""
    for line in filter(None, lines):
        if line.startswith(_WRAPPER):
            where = f" (in {line[len(_WRAPPER):].rstrip('.')})"
            continue
        return f"{type(error).__name__}: {_NODE.sub('', line)}{where}"[:300]
    return f"{type(error).__name__}:{where}"


_WRAPPER = "Exception encountered when calling "
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_NODE = re.compile(r"^\{\{function_node [^}]*\}\}\s*")


@dataclasses.dataclass
class Reload:
    """What a `.keras` save -> `keras.models.load_model` predicted against the saved model.

    Attributes:
        status: `"exact"` (bitwise the same outputs), `"differs"` or `"crash"`.
        diff: the largest absolute difference of an output (`"differs"`).
        message: the first line of the error (`"crash"`).
    """

    status: str
    diff: float = 0.0
    message: str = ""

    def __str__(self):
        if self.status == "differs":
            return f"differs {self.diff:.1e}"
        return "crash: " + self.message if self.status == "crash" else self.status


@dataclasses.dataclass
class Row:
    """Everything `check` measured for one architecture and one half dtype.

    `*_crash` hold the first line of an error (`None` when it ran); errors are
    relative to float32 (`None` where nothing ran); `fit_losses32`
    the losses before and after one SGD step run by hand on the float32 model,
    `fit_losses` and `keras_fit_losses` the two epochs' losses of kmix and
    plain Keras (for the record: plain Keras's fit is no criterion, and
    `check(..., record=False)` leaves it out);
    `fit_reference` why float32's fit gives no reference (it crashes, or
    trains at random: dropout);
    `kmix_layers` is `(layers placed in half, layers)` from autocast's table
    (for the record: a model kept whole in float32 meets the criteria with
    no speed to gain); `seconds` the time of each part.
    """

    name: str
    half: str
    reference_crash: str = None
    keras_error: float = None
    keras_crash: str = None
    keras_reload: Reload = None
    kmix_error: float = None
    kmix_crash: str = None
    kmix_reload: Reload = None
    kmix_reload_advised: Reload = None
    kmix_warnings: list = dataclasses.field(default_factory=list)
    kmix_layers: tuple = None
    fit_losses32: list = None
    fit_losses: list = None
    fit_crash: str = None
    fit_skipped: int = 0
    fit_reference: str = None
    keras_fit_losses: list = None
    keras_fit_crash: str = None
    fit_tolerance: float = None
    seconds: dict = dataclasses.field(default_factory=dict)

    @property
    def tolerance(self):
        """The error kmix may reach: the dtype's tolerance, or 1.5x plain Keras's error."""
        keras_error = self.keras_error if self.keras_error is not None else 0.0
        return max(TOLERANCE[self.half], KEPT_TO_KERAS * keras_error)

    def failures(self):
        """The criteria kmix misses, one line each: `"criterion: what"` (`[]` when all are met).

        The criteria: `crash` (kmix crashes; a crash where plain Keras crashes
        too is said so), `finite`, `error`, `reload`, `fit`; `reference` when
        the float32 model itself fails or trains at random (the builder's fault).
        """
        if self.reference_crash:
            return [f"reference: the float32 model crashes: {self.reference_crash}"]
        if self.kmix_crash:
            if self.keras_crash:
                return [f"crash: kmix crashes, as plain Keras does: {self.kmix_crash}"]
            return [f"crash: kmix crashes where plain Keras runs: {self.kmix_crash}"]
        failed = []
        if not np.isfinite(self.kmix_error):
            failed.append("finite: non-finite outputs")
        elif self.kmix_error > self.tolerance:
            failed.append(f"error: {self.kmix_error:.2e} > {self.tolerance:.2e}")
        if self.kmix_reload.status != "exact" and not self.reload_as_advised():
            failed.append(f"reload: {self.kmix_reload}" + (
                f" (as kmix advises: {self.kmix_reload_advised})" if self.kmix_reload_advised else ""))
        if self.fit_reference:
            failed.append(f"reference: fit: {self.fit_reference}")
        elif self.fit_crash:
            failed.append(f"fit: crashes: {self.fit_crash}")
        elif self.fit_losses is not None:
            if len(self.fit_losses) < 2:
                failed.append(f"fit: the loss scale skipped {self.fit_skipped} steps in a row")
            elif not np.all(np.isfinite(self.fit_losses)):
                failed.append(f"fit: losses not finite: {_losses(self.fit_losses)}")
            elif not self.fit_close():
                failed.append(
                    f"fit: losses {_losses(self.fit_losses)} vs float32 "
                    f"{_losses(self.fit_losses32)} (tolerance {self.fit_tolerance:.1e}){self._skipped()}"
                )
        return failed

    def reload_as_advised(self):
        """Where plain Keras's own reload is not exact either: kmix says so, and its advice reloads exactly."""
        keras_exact = self.keras_reload is not None and self.keras_reload.status == "exact"
        advised = self.kmix_reload_advised
        return not keras_exact and advised is not None and advised.status == "exact"

    def _skipped(self):
        """`" after N skipped steps"` where kmix's loss scale skipped some."""
        return f" after {self.fit_skipped} skipped steps" if self.fit_skipped else ""

    def fit_close(self):
        """Whether each epoch's loss is within `fit_tolerance` of float32's."""
        gap = np.abs(np.subtract(self.fit_losses, self.fit_losses32))
        return bool(np.all(gap <= self.fit_tolerance))

    def worse_than_keras(self):
        """Whether kmix does worse than plain Keras mixed precision on this row."""
        if self.reference_crash or self.keras_crash:
            return False
        if self.kmix_crash:
            return True
        if np.isfinite(self.keras_error) and not np.isfinite(self.kmix_error):
            return True
        if self.kmix_error > self.tolerance:
            return True
        return self.keras_reload.status == "exact" and self.kmix_reload.status != "exact"

    def verdict(self):
        """`"ok"`, or the failing criteria's names joined by `", "` (`"reload, fit"`)."""
        return ", ".join(failure.split(":")[0] for failure in self.failures()) or "ok"


def _losses(losses):
    return "[" + ", ".join(f"{loss:.4g}" for loss in losses) + "]"
