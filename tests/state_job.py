"""A `run_loop` job for tests whose checkpoint is its state alone (no data position)."""


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
