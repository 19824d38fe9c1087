"""What `tf.distribute` needs from kmix: `model.fit` on several machines.

    import kmix
    kmix.distribute.enable_multi_worker_fit()   # once per worker, before fit
"""

from kmix.distribute.multi_worker_fit import (
    disable_multi_worker_fit,
    enable_multi_worker_fit,
    multi_worker_fit_enabled,
)

__all__ = ["disable_multi_worker_fit", "enable_multi_worker_fit", "multi_worker_fit_enabled"]
