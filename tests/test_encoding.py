import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from mtbert import io
from mtbert.data.tokenization import encode_rows
from tests.conftest import TASKS

LONG = " ".join(["word"] * 40)


def pair_rows(label=(1, 0)) -> pd.DataFrame:
    return pd.DataFrame({"id": ["a", "b"], "sentence1": ["How do I cook rice?", LONG],
                         "sentence2": ["What is the way to cook rice?", "short one"], "label": list(label)})


def test_pair_encodings_match_the_tokenizer_and_count_truncation(tokenizer):
    table, stats = encode_rows(tokenizer, pair_rows(), TASKS["qqp"], max_length=20, batch_size=1)
    rows = table.to_pylist()
    for row in rows:
        joint = tokenizer(row["sentence1"], row["sentence2"], truncation="longest_first", max_length=20)
        assert row["input_ids"] == joint["input_ids"]
        assert row["token_type_ids"] == joint["token_type_ids"]
        assert row["input_ids_1"] == tokenizer(row["sentence1"], truncation=True, max_length=20)["input_ids"]
        assert row["input_ids_2"] == tokenizer(row["sentence2"])["input_ids"]
    assert len(rows[1]["input_ids"]) == 20
    assert stats.truncated == 1  # only the pair with the 40-word sentence
    assert stats.truncated_sentences == 1  # that sentence alone, too
    assert rows[0]["label"] == 1


def test_single_sentence_truncation_at_the_exact_limit(tokenizer):
    rows = pd.DataFrame({"id": ["x", "y"], "sentence": ["one two three", "one two three four"], "label": [0, 4]})
    # "one two three" is 3 tokens + [CLS] + [SEP] = 5: fits 5, the 4-word one does not.
    table, stats = encode_rows(tokenizer, rows, TASKS["sst"], max_length=5, batch_size=8)
    assert stats.truncated == 1
    assert [len(ids) for ids in table.column("input_ids").to_pylist()] == [5, 5]
    assert "input_ids_1" not in table.column_names


def test_unlabeled_rows_get_null_labels(tokenizer):
    rows = pair_rows().drop(columns="label")
    table, _ = encode_rows(tokenizer, rows, TASKS["sts"], max_length=32, batch_size=8)
    assert table.column("label").null_count == 2
    assert table.schema.field("label").type == pa.float64()


def test_parquet_round_trip_keeps_types_and_values(tokenizer, tmp_path):
    table, _ = encode_rows(tokenizer, pair_rows(), TASKS["qqp"], max_length=32, batch_size=8)
    path = tmp_path / "qqp-train.parquet"
    io.write_parquet(path, table)
    back = pq.read_table(path)
    assert back.equals(table)
    assert back.schema.field("input_ids").type == pa.list_(pa.int32())
    assert back.schema.field("label").type == pa.int64()
    assert [p.name for p in tmp_path.iterdir()] == ["qqp-train.parquet"]  # no temp file left behind
