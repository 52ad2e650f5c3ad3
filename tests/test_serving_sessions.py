"""A session's recorded calls become RL samples from their ids (coa_jax.serving.sessions)."""

from coa_jax.serving.sessions import Call, append_only, session_records


def call(prompt, completion, version=0, reason="stop"):
  return Call(tuple(prompt), tuple(completion), tuple(-0.1 * (i + 1) for i in range(len(completion))),
              (version,) * len(completion), reason)


def test_an_append_only_session_is_one_sample_with_loss_on_sampled_tokens_only():
  first = call([1, 2, 3], [10, 11], version=0, reason="tool_calls")
  second = call([1, 2, 3, 10, 11, 50, 51], [12, 13, 14], version=1)  # 50, 51: a tool result
  assert append_only([first, second])
  record, = session_records([first, second], "t", 2)
  assert record.ids == [1, 2, 3, 10, 11, 50, 51, 12, 13, 14]
  assert record.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1, 1, 1]
  assert record.logprobs == [0, 0, 0, -0.1, -0.2, 0, 0, -0.1, -0.2, -0.30000000000000004]
  assert record.versions == [0, 0, 0, 0, 0, 1, 1, 1, 1, 1]
  assert (record.prompt_len, record.task_id, record.sample) == (3, "t", 2)
  assert record.turns == 1 and record.tool_calls == {"endpoint": 1}


def test_a_session_that_rewrites_its_history_gives_one_sample_a_call():
  first = call([1, 2, 3], [10, 11])
  rewritten = call([1, 2, 3, 99, 50], [12])  # the program re-rendered its first answer
  assert not append_only([first, rewritten])
  records = session_records([first, rewritten], "t", 0)
  assert [r.ids for r in records] == [[1, 2, 3, 10, 11], [1, 2, 3, 99, 50, 12]]
  assert [r.loss_mask for r in records] == [[0, 0, 0, 1, 1], [0, 0, 0, 0, 0, 1]]
  assert [r.prompt_len for r in records] == [3, 5]
  assert session_records([], "t", 0) == []
