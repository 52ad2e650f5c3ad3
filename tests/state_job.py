"""What the two-process tests' workers share: joining the run (`join`), and a `run_loop` job
whose checkpoint is its state alone (no data position)."""

from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from coa_jax.runtime import distributed, sharding


def join(process_id: int, port: str):
  """Joins this machine's two-process run (the coordinator on `port`); returns the mesh over
  both processes' devices and the sharding of rows over it."""
  distributed.initialize(distributed.DistributedConfig(
      mode="explicit", coordinator_address=f"127.0.0.1:{port}", num_processes=2,
      process_id=process_id))
  mesh = sharding.make_mesh((2, 1, 1))
  return mesh, NamedSharding(mesh, P("data"))


class StateJob:
  """Keeps `self.state`; a subclass defines `step`."""

  def checkpoint_state(self):
    return self.state

  def data_state(self, step):
    del step
    return {}

  def restore(self, state, data_state):
    del data_state
    self.state = state
