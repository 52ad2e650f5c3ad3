"""Runtime: device meshes and sharding, multi-host set-up, checkpoints (Orbax train states,
HF safetensors folders) and the chips' published figures."""

from coa_jax.runtime import distributed, hardware, sharding
from coa_jax.runtime.checkpointing import Checkpointer, PreemptionFlag
from coa_jax.runtime.hf_checkpoint import load_checkpoint, load_model, save_checkpoint
from coa_jax.runtime.sharding import MeshConfig, make_mesh
