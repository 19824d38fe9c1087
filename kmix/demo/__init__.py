"""`python -m kmix demo`: the classic float16 NaN, trained three ways side by side.

A small transformer encoder classifies variable-length, zero-padded token
sequences (generated in this module; nothing is downloaded). The same model,
from the same initial weights, on the same batches, is trained:

1. `float32`: the reference;
2. `mixed_float16` with the attention mask users write by hand,
   `scores + (1 - mask) * -1e9` after casting the mask to the scores' dtype:
   in float16 `-1e9` is `-inf` and `0 * -inf` is NaN, so the loss is NaN;
3. `mixed_float16` with kmix: `kmix.layers.MaskedSoftmax` (a float32 softmax
   that takes the boolean mask), `kmix.wrap` on the optimizer and the
   `LossScaleMonitor` callback.

All three warm the learning rate up with `kmix.callbacks.LearningRateWarmup`
over the first tenth of the steps: warm-up alone does not cure the NaN.

It prints a table (final loss and accuracy on held-out sequences, skipped
steps, final loss scale, training time, first NaN step) and saves a PNG of
the per-step training loss and the loss scale of both mixed runs. On a
terminal each run shows Keras's progress bar; when the output goes to a file
or a CI log, a few compact lines instead (`--progress` chooses).

The package: `task` (the data and the encoder), `runs` (the three trainings
and the command line), `report` (the table and what it shows), `figure`.
"""

from kmix.demo.figure import figure, plot_results
from kmix.demo.report import format_results, headline, summarize
from kmix.demo.runs import BATCH, RUNS, main, train_run
from kmix.demo.task import CLASSES, MAX_LEN, MIN_LEN, VOCAB, build_model, make_data

__all__ = ["BATCH", "CLASSES", "MAX_LEN", "MIN_LEN", "RUNS", "VOCAB", "build_model", "figure", "format_results",
           "headline", "main", "make_data", "plot_results", "summarize", "train_run"]
