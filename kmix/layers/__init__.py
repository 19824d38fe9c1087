"""kmix.layers: drop-in Keras layers that keep the fragile ops in float32.

    probs = kmix.layers.MaskedSoftmax()(scores, mask=padding_mask)
    attention = kmix.layers.MultiHeadAttention(num_heads=4, key_dim=32)

A `.keras` file holding them loads after `import kmix`; `kmix.export(model, "model.keras")` writes one that
loads without kmix.
"""

from kmix.layers.multi_head_attention import MultiHeadAttention
from kmix.layers.remat import Remat
from kmix.layers.softmax import MaskedSoftmax, Softmax
from kmix.layers.with_policy import WithPolicy

__all__ = ["MaskedSoftmax", "MultiHeadAttention", "Remat", "Softmax", "WithPolicy"]
