"""`python -m kmix demo`: the classic float16 NaN, trained three ways side by side.

A small transformer encoder classifies zero-padded token sequences, from the same weights on the same
batches: in `float32`; in `mixed_float16` with the hand-written mask `scores + (1 - mask) * -1e9` (NaN: -1e9
is -inf in float16 and 0 * -inf is NaN); and in `mixed_float16` with kmix (`MaskedSoftmax`, `kmix.wrap`,
`LossScaleMonitor`). Modules: `task` (data, encoder), `runs` (the trainings, the command line), `report`, `figure`.
"""

from kmix.demo.figure import figure, plot_results
from kmix.demo.report import format_results, headline, summarize
from kmix.demo.runs import BATCH, RUNS, main, train_run
from kmix.demo.task import CLASSES, MAX_LEN, MIN_LEN, VOCAB, build_model, make_data

__all__ = ["BATCH", "CLASSES", "MAX_LEN", "MIN_LEN", "RUNS", "VOCAB", "build_model", "figure", "format_results",
           "headline", "main", "make_data", "plot_results", "summarize", "train_run"]
