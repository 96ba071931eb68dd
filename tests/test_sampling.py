from collections import Counter

import numpy as np
import pyarrow as pa
import pytest

from mtbert.data.batches import TokenColumn, bucketed_batches
from mtbert.data.sampling import TaskStream, epoch_schedule, sampling_weights

SIZES = {"sst": 8000, "qqp": 14000, "sts": 6000}
BATCHES = {"sst": 250, "qqp": 438, "sts": 188}  # batches per pass at batch size 32


def counts(sampler: str, epoch: int = 0, epochs: int = 3, temperature: float = 2.0) -> Counter:
    schedule = epoch_schedule(sampler, BATCHES, SIZES, seed=0, epoch=epoch, epochs=epochs, temperature=temperature)
    return Counter(task for step in schedule for task in step)


def shares(counter: Counter) -> dict[str, float]:
    total = sum(counter.values())
    return {task: count / total for task, count in counter.items()}


def test_round_robin_cycles_the_tasks_in_order():
    schedule = epoch_schedule("round_robin", BATCHES, SIZES, seed=0, epoch=0, epochs=1, temperature=1)
    assert schedule[:4] == [("sst",), ("qqp",), ("sts",), ("sst",)]
    assert len(schedule) == sum(BATCHES.values())


def test_shuffled_draws_every_batch_of_every_task_exactly_once():
    assert counts("shuffled") == Counter(BATCHES)


def test_joint_takes_every_task_each_step_over_a_third_as_many_steps():
    schedule = epoch_schedule("joint", BATCHES, SIZES, seed=0, epoch=0, epochs=1, temperature=1)
    assert set(schedule) == {("sst", "qqp", "sts")}
    assert len(schedule) == round(sum(BATCHES.values()) / 3)


def test_schedules_follow_whatever_tasks_are_declared():
    batches = {"a": 3, "b": 5, "c": 2, "d": 6}  # four tasks, none of them the default three
    sizes = {task: 32 * n for task, n in batches.items()}

    def schedule(sampler, batches=batches, sizes=sizes):
        return epoch_schedule(sampler, batches, sizes, seed=0, epoch=0, epochs=1, temperature=1)

    assert schedule("round_robin")[:5] == [("a",), ("b",), ("c",), ("d",), ("a",)]
    assert Counter(task for step in schedule("shuffled") for task in step) == Counter(batches)
    assert schedule("joint") == [("a", "b", "c", "d")] * 4  # 16 batches / 4 tasks
    proportional = schedule("proportional")
    assert len(proportional) == 16 and set(proportional) <= {("a",), ("b",), ("c",), ("d",)}
    assert schedule("proportional", {"only": 4}, {"only": 100}) == [("only",)] * 4


def test_proportional_follows_dataset_sizes():
    observed = shares(counts("proportional"))
    for task, size in SIZES.items():
        assert observed[task] == pytest.approx(size / sum(SIZES.values()), abs=0.03)


def test_temperature_flattens_towards_uniform():
    weights = sampling_weights("temperature", SIZES, epoch=0, epochs=1, temperature=2.0)
    expected = {t: np.sqrt(n) / sum(np.sqrt(list(SIZES.values()))) for t, n in SIZES.items()}
    assert weights == pytest.approx(expected)
    assert shares(counts("temperature")) == pytest.approx(expected, abs=0.03)


def test_annealed_moves_from_proportional_to_alpha_0_2():
    first = sampling_weights("annealed", SIZES, epoch=0, epochs=5, temperature=1)
    last = sampling_weights("annealed", SIZES, epoch=4, epochs=5, temperature=1)
    assert first == pytest.approx(sampling_weights("proportional", SIZES, epoch=0, epochs=5, temperature=1))
    alpha = 0.2  # 1 - 0.8 * e / (E - 1) at the last epoch
    total = sum(n ** alpha for n in SIZES.values())
    assert last == pytest.approx({t: n ** alpha / total for t, n in SIZES.items()})


def test_schedules_are_reproducible_and_differ_between_epochs():
    assert counts("proportional", epoch=1) == counts("proportional", epoch=1)
    one = epoch_schedule("proportional", BATCHES, SIZES, seed=0, epoch=0, epochs=2, temperature=1)
    two = epoch_schedule("proportional", BATCHES, SIZES, seed=0, epoch=1, epochs=2, temperature=1)
    assert one != two


def test_bucketed_batches_cover_every_example_once_with_little_padding():
    rng = np.random.default_rng(0)
    lengths = rng.integers(5, 120, size=1000)
    batches = bucketed_batches(lengths, 32, 10, np.random.default_rng(1))
    assert sorted(np.concatenate(batches).tolist()) == list(range(1000))
    padded = sum(len(b) * lengths[b].max() for b in batches)
    unbucketed = bucketed_batches(lengths, 32, 1, np.random.default_rng(1))
    assert padded < 0.8 * sum(len(b) * lengths[b].max() for b in unbucketed)


def test_stream_resumes_at_its_saved_position():
    lengths = np.arange(10)
    stream = TaskStream(lengths, 4, 1, seed=3, stream_id=0)
    for _ in range(4):  # past the end of the first pass (3 batches)
        stream.next()
    copy = TaskStream(lengths, 4, 1, seed=3, stream_id=0)
    copy.load_state(stream.state())
    assert [stream.next().tolist() for _ in range(5)] == [copy.next().tolist() for _ in range(5)]


def test_token_column_of_a_sliced_table_pads_the_right_rows():
    table = pa.table({"ids": pa.array([[1], [2, 3], [4, 5, 6], [7]], pa.list_(pa.int32()))}).slice(1, 2)
    column = TokenColumn.from_arrow(table.column("ids"))
    ids, mask = column.padded(np.array([0, 1]))
    assert ids.tolist() == [[2, 3, 0], [4, 5, 6]]
    assert mask.tolist() == [[1, 1, 0], [1, 1, 1]]


def test_a_static_shape_pads_to_the_next_multiple_and_masks_the_padding():
    column = TokenColumn.from_arrow(pa.chunked_array([pa.array([[1, 2, 3, 4, 5], [6]], pa.list_(pa.int32()))]))
    ids, mask = column.padded(np.array([0, 1]), multiple=4)
    assert ids.tolist() == [[1, 2, 3, 4, 5, 0, 0, 0], [6, 0, 0, 0, 0, 0, 0, 0]]
    assert mask.tolist() == [[1] * 5 + [0] * 3, [1] + [0] * 7]
    assert column.padded(np.array([0]), multiple=5)[0].shape == (1, 5)  # already a multiple: no extra column


def test_round_robin_smallest_gives_every_task_the_smallest_tasks_batches_in_turn():
    schedule = epoch_schedule("round_robin_smallest", BATCHES, SIZES, seed=0, epoch=0, epochs=1, temperature=1)
    assert schedule[:4] == [("sst",), ("qqp",), ("sts",), ("sst",)]
    assert Counter(task for step in schedule for task in step) == dict.fromkeys(SIZES, BATCHES["sts"])
    assert len(schedule) == 3 * min(BATCHES.values())  # the epoch (and the LR schedule) shrink with it


def test_round_robin_smallest_uses_other_rows_of_the_larger_task_each_epoch_and_covers_them():
    batches = {"small": 2, "large": 5}  # 10 and 25 rows in batches of 5
    streams = {"small": TaskStream(np.ones(10), 5, 1, seed=0, stream_id=0),
               "large": TaskStream(np.ones(25), 5, 1, seed=0, stream_id=1)}
    drawn = []  # per epoch, the rows each task trained on
    for epoch in range(3):
        rows: dict[str, list[int]] = {"small": [], "large": []}
        for (task,) in epoch_schedule("round_robin_smallest", batches, {"small": 10, "large": 25}, seed=0,
                                      epoch=epoch, epochs=3, temperature=1):
            rows[task] += streams[task].next().tolist()
        drawn.append(rows)
    assert all(sorted(rows["small"]) == list(range(10)) for rows in drawn)  # the smallest: one pass per epoch
    assert all(len(rows["large"]) == 10 for rows in drawn)  # down-sampled to the smallest task's batches
    assert not set(drawn[0]["large"]) & set(drawn[1]["large"])  # other rows in the next epoch
    first_pass = drawn[0]["large"] + drawn[1]["large"] + drawn[2]["large"][:5]
    assert sorted(first_pass) == list(range(25))  # within a few epochs every row was trained on once


def test_the_token_budget_of_a_piece_counts_its_static_width():
    from mtbert.data.batches import micro_batches

    rows, lengths = np.arange(30), np.full(30, 68)  # 2,040 tokens as they are, 2,400 padded to 80
    assert len(micro_batches(rows, lengths, 2048)) == 1
    assert len(micro_batches(rows, lengths, 2048, multiple=16)) == 2
