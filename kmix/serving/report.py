"""`ExportReport`: what `kmix.export` wrote, and how far its outputs are from float32's."""

import dataclasses


@dataclasses.dataclass(repr=False, eq=False)
class ExportReport:
    """What `kmix.export` wrote and how far its outputs are from float32's; `str()` prints it.

    Attributes:
        paths: the artifacts written.
        dtype: the half dtype of the weights.
        sample: where the inputs checked came from, and their shapes.
        max_abs_diff, max_abs_float32, top1_agreement: the artifact's outputs
            against the float32 model's on the sample (`kmix.serving.Comparison`).
        weight_bytes, float32_weight_bytes: the variables as stored, and in float32.
        disk_bytes: `{path: bytes on disk}` of the artifact's own files.
        load_seconds: `{path: seconds to read it back}`.
        stored_in_half: the float32 layers storing half weights.
        float32_layers: every layer computing in float32.
        kept_float32: `{path: why}` for float32 layers with a matrix that keep float32 weights.
    """

    paths: list
    dtype: str
    sample: str
    max_abs_diff: float
    max_abs_float32: float
    top1_agreement: float
    weight_bytes: int
    float32_weight_bytes: int
    disk_bytes: dict
    load_seconds: dict
    stored_in_half: list
    float32_layers: list
    kept_float32: dict

    def __str__(self):
        top1 = "n/a" if self.top1_agreement is None else f"{self.top1_agreement:.1%}"
        lines = [
            f"kmix.export: {self.dtype} weights, float32 in and out; checked on a sample {self.sample}",
            f"  max |out - float32|: {self.max_abs_diff:.4g} (largest |float32 out| {self.max_abs_float32:.4g}); "
            f"top-1 = float32: {top1}",
            f"  weights: {self.weight_bytes:,} bytes ({self.weight_bytes / max(self.float32_weight_bytes, 1):.2f}x "
            f"their float32 {self.float32_weight_bytes:,})",
            f"  float32 compute: {len(self.float32_layers)} layers; of these storing {self.dtype}: "
            f"{self.stored_in_half or 'none'}",
        ]
        lines += [f"  float32 weights kept in {path}: {why}" for path, why in self.kept_float32.items()]
        lines += [f"  wrote {path}: {self.disk_bytes[path]:,} bytes, read back in {self.load_seconds[path]:.2f} s"
                  for path in self.paths]
        return "\n".join(lines)

    __repr__ = __str__
