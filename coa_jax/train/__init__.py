"""Training: the train state, the optimizer, the jitted sharded step and the job loop that SFT
and DAPO run on."""

from coa_jax.train.loop import Job, LoopConfig, LoopResult, run_loop
from coa_jax.train.state import TrainState, init_state, state_from_params
from coa_jax.train.step import NonFiniteLossError, jit_train_step
