"""Browse a training checkpoint from a notebook: tree, shapes, dtypes, shardings, norms, export.

    ckpt = open_checkpoint("runs/default")          # or ".../checkpoints/40", or step=40
    ckpt.show()                                     # treescope in a notebook, text elsewhere
    ckpt.tree()                                     # {"layers": {"attn": {"q_proj": {"kernel": TensorInfo}}}}
    x = ckpt.load_param("layers/attn/q_proj/kernel", mesh=mesh)     # one tensor [L, D, N, H]
    x0 = ckpt.load_param("layers/0/attn/q_proj/kernel")              # layer 0's slice [D, N, H]
    model = ckpt.restore_model(40)                  # the Qwen2 module (ckpt.load_params(): its dict)
    ckpt.model_config                               # setup.model_config_from_checkpoint, shape-checked
    param_stats(ckpt).layer_norms                   # {"embed": ..., "layers/0": ..., ...}
    diff(ckpt, 20, 40).layer_relative               # ||theta_40 - theta_20|| / ||theta_20|| per layer
    to_hf(ckpt, "/tmp/hf")                          # a folder transformers.from_pretrained loads

The tree comes from Orbax's metadata (`<step>/state/_METADATA`, `_sharding`): no array is read.
Tensors are read with Orbax partial restore (`PyTreeRestore(partial_restore=True)`), one tensor or
one stacked tensor at a time, each straight into the placement asked for (one device, or the
`NamedSharding` of its logical axes on a mesh), so a large checkpoint is never loaded whole.
The decoder layers' parameters are stacked: `layers/<name>` is one [L, ...] tensor (the model
scans over it); per-layer figures ("layers/3") are computed on its slices.
Nothing here writes to the checkpoint directory.
"""

from ict_jax.inspect.export import to_hf
from ict_jax.inspect.reader import (
    Checkpoint,
    TensorInfo,
    layer_group,
    open_checkpoint,
    param_axes,
)
from ict_jax.inspect.stats import ParamDiff, ParamStats, diff, param_stats

__all__ = [
    "Checkpoint",
    "TensorInfo",
    "ParamStats",
    "ParamDiff",
    "open_checkpoint",
    "param_stats",
    "diff",
    "to_hf",
    "param_axes",
    "layer_group",
]
