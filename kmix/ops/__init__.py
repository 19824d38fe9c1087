"""kmix.ops: functional forms of the numerically safe ops.

    probs = kmix.ops.masked_softmax(scores, mask=padding_mask, dtype="float32")
"""

from kmix.ops.softmax import masked_log_softmax, masked_softmax

__all__ = ["masked_log_softmax", "masked_softmax"]
