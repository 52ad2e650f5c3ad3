"""A session's recorded calls become RL samples from their ids (coa_jax.serving.sessions)."""

from coa_jax.serving.sessions import Call, append_only, session_record


def call(prompt, completion, version=0, reason="stop"):
  return Call(tuple(prompt), tuple(completion), tuple(-0.1 * (i + 1) for i in range(len(completion))),
              (version,) * len(completion), reason)


def test_an_append_only_session_is_one_sample_with_loss_on_sampled_tokens_only():
  first = call([1, 2, 3], [10, 11], version=0, reason="tool_calls")
  second = call([1, 2, 3, 10, 11, 50, 51], [12, 13, 14], version=1)  # 50, 51: a tool result
  assert append_only([first, second])
  record = session_record([first, second], "t", 2)
  assert record.ids == [1, 2, 3, 10, 11, 50, 51, 12, 13, 14]
  assert record.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1, 1, 1]
  assert record.logprobs == [0, 0, 0, -0.1, -0.2, 0, 0, -0.1, -0.2, -0.30000000000000004]
  assert record.versions == [0, 0, 0, 0, 0, 1, 1, 1, 1, 1]
  assert (record.prompt_len, record.task_id, record.sample) == (3, "t", 2)
  assert record.turns == 1 and record.tool_calls == {"endpoint": 1}


def test_a_session_that_rewrites_its_history_packs_one_sample_a_call():
  first = call([1, 2, 3], [10, 11], reason="tool_calls")
  rewritten = call([1, 2, 3, 99, 50], [12])  # the program re-rendered its first answer
  assert not append_only([first, rewritten])
  record = session_record([first, rewritten], "t", 0)
  assert record.ids == [1, 2, 3, 10, 11, 1, 2, 3, 99, 50, 12]
  assert record.loss_mask == [0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 1]
  assert record.segments == [5, 6] and record.response_len == 1  # the last call's completion
  # Past the update's length, the latest calls are kept.
  short = session_record([first, rewritten], "t", 0, max_len=8)
  assert short.ids == [1, 2, 3, 99, 50, 12] and short.segments == [6]
  assert short.task_data["calls_dropped"] == 1
  assert session_record([], "t", 0) is None


def test_packed_samples_restart_positions_and_keep_to_their_segment():
  from coa_jax.rl.batch import rollout_batch
  record = session_record([call([1, 2, 3], [10, 11]), call([1, 2, 3, 99, 50], [12])], "t", 0)
  batch = rollout_batch([record], [1.0], [0], seq_len=12)
  assert batch.positions[0, :10].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4]
  assert batch.segment_ids[0, :10].tolist() == [1, 1, 1, 1, 1, 2, 2, 2, 2, 2]
  # The last token of the first call does not learn to predict the next call's first token.
  assert batch.loss_mask[0, :10].tolist() == [0, 0, 1, 1, 0, 0, 0, 0, 0, 1]
