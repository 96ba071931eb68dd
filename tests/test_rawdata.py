import dataclasses
from pathlib import Path

import pytest

from mtbert.data.kinds import Classification, Regression
from mtbert.data.rawdata import RawDataError, read_split
from tests.conftest import TASKS


def write(path: Path, text: str | bytes) -> Path:
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def test_csv_quoting_keeps_doubled_inner_quotes(raw_dir):
    parsed = read_split(raw_dir / "quora-train.csv", TASKS["qqp"], "train")
    assert parsed.kept["sentence1"].tolist() == ["How do I cook rice?", '"Quoted" words?']
    assert parsed.rejects.empty


def test_columns_are_selected_by_name_whatever_the_header_order(raw_dir):
    parsed = read_split(raw_dir / "ids-sst-test-student.csv", TASKS["sst"], "test")
    assert parsed.kept["id"].tolist() == ["st1", "st2"]
    assert parsed.kept["sentence"].tolist() == ["Odd .", "Sweet ."]
    assert "label" not in parsed.kept


def test_ptb_escapes_are_turned_back_only_when_asked(raw_dir):
    path = raw_dir / "ids-sst-train.csv"
    plain = read_split(path, TASKS["sst"], "train", unescape_ptb=True).kept["sentence"].tolist()
    assert plain[:2] == ["It 's a ( lovely ) film .", 'A " dull " mess .']
    raw = read_split(path, TASKS["sst"], "train").kept["sentence"].tolist()
    assert raw[0] == "It 's a -LRB- lovely -RRB- film ."


def test_labels_are_parsed_into_their_domain(raw_dir):
    sst = read_split(raw_dir / "ids-sst-train.csv", TASKS["sst"], "train").kept["label"]
    qqp = read_split(raw_dir / "quora-train.csv", TASKS["qqp"], "train").kept["label"]
    sts = read_split(raw_dir / "sts-train.csv", TASKS["sts"], "train").kept["label"]
    assert sst.tolist() == [3, 0, 2] and str(sst.dtype) == "int64"
    assert qqp.tolist() == [1, 0] and str(qqp.dtype) == "int64"
    assert sts.tolist() == [4.6, 0.0] and str(sts.dtype) == "float64"


@pytest.mark.parametrize(("row", "reason", "detail"), [
    ("9\t\tx\ty\t1.0", "missing_id", "the id column is empty"),
    ("9\tq1\tx\ty\t1.0", "duplicate_id", "id already used at row 1"),
    ("9\tq9\t   \ty\t1.0", "empty_text", "column 'sentence1' is empty or invisible"),
    ("9\tq9\t\u200b\u200b\ty\t1.0", "empty_text", "column 'sentence1' is empty or invisible"),
    ("9\tq9\tx\t\t1.0", "empty_text", "column 'sentence2' is empty or invisible"),
    ("9\tq9\tx\ty\t", "missing_label", "column 'is_duplicate' is empty"),
    ("9\tq9\tx\ty", "missing_label", "column 'is_duplicate' is empty"),
    ("9\tq9\tx\ty\tyes", "label_not_a_number", "label 'yes'"),
    ("9\tq9\tx\ty\t2.0", "label_out_of_range", "label '2.0', expected an integer 0-1"),
    ("9\tq9\tx\ty\t0.5", "label_out_of_range", "label '0.5', expected an integer 0-1"),
])
def test_each_bad_row_is_rejected_with_its_reason(tmp_path, row, reason, detail):
    path = write(tmp_path / "quora-train.csv", "\tid\tsentence1\tsentence2\tis_duplicate\n"
                                               f"0\tq1\ta\tb\t0.0\n{row}\n1\tq2\tc\td\t1.0\n")
    parsed = read_split(path, TASKS["qqp"], "train")
    assert parsed.rows_read == 3
    assert parsed.kept["id"].tolist() == ["q1", "q2"]
    assert parsed.rejects.to_dict("records") == [
        {"task": "qqp", "split": "train", "row": 2, "id": row.split("\t")[1], "reason": reason,
         "detail": detail}]


@pytest.mark.parametrize(("value", "reason"), [("5.5", "label_out_of_range"), ("-0.1", "label_out_of_range"),
                                                ("nan", "label_not_a_number"), ("inf", "label_not_a_number")])
def test_sts_scores_must_be_finite_and_within_0_to_5(tmp_path, value, reason):
    path = write(tmp_path / "sts-dev.csv",
                 f"\tid\tsentence1\tsentence2\tsimilarity\n0\tt1\ta\tb\t5.0\n1\tt2\ta\tb\t{value}\n")
    parsed = read_split(path, TASKS["sts"], "dev")
    assert parsed.kept["label"].tolist() == [5.0]
    assert parsed.rejects["reason"].tolist() == [reason]


def test_sst_labels_must_be_whole_classes(tmp_path):
    path = write(tmp_path / "ids-sst-dev.csv", "\tid\tsentence\tsentiment\n0\ta\tx\t4\n1\tb\tx\t2.5\n2\tc\tx\t5\n")
    rejects = read_split(path, TASKS["sst"], "dev").rejects
    assert rejects["id"].tolist() == ["b", "c"]
    assert set(rejects["reason"]) == {"label_out_of_range"}


def test_label_domain_comes_from_the_task_kind(tmp_path):
    three_classes = dataclasses.replace(TASKS["sst"], kind=Classification(3))
    path = write(tmp_path / "ids-sst-dev.csv", "\tid\tsentence\tsentiment\n0\ta\tx\t2\n1\tb\tx\t3\n2\tc\tx\t0\n")
    parsed = read_split(path, three_classes, "dev")
    assert parsed.kept["label"].tolist() == [2, 0] and str(parsed.kept["label"].dtype) == "int64"
    assert parsed.rejects[["id", "reason", "detail"]].to_dict("records") == [
        {"id": "b", "reason": "label_out_of_range", "detail": "label '3', expected an integer 0-2"}]
    one_to_seven = dataclasses.replace(TASKS["sts"], kind=Regression(1.0, 7.0))
    path = write(tmp_path / "sts-dev.csv", "\tid\tsentence1\tsentence2\tsimilarity\n"
                                           "0\tt1\ta\tb\t6.5\n1\tt2\ta\tb\t0.5\n2\tt3\ta\tb\t7\n")
    parsed = read_split(path, one_to_seven, "dev")
    assert parsed.kept["label"].tolist() == [6.5, 7.0] and str(parsed.kept["label"].dtype) == "float64"
    assert parsed.rejects[["id", "reason", "detail"]].to_dict("records") == [
        {"id": "t2", "reason": "label_out_of_range", "detail": "label '0.5', expected a number 1.0-7.0"}]


def test_missing_column_names_the_file_and_the_expected_header(tmp_path):
    path = write(tmp_path / "sts-dev.csv", "\tid\tsentence1\tscore\n0\tt1\ta\t1.0\n")
    with pytest.raises(RawDataError, match=r"sts-dev.csv: missing column\(s\) 'sentence2', 'similarity'"):
        read_split(path, TASKS["sts"], "dev")


def test_a_file_without_header_is_a_wrong_header(tmp_path):
    path = write(tmp_path / "ids-sst-dev.csv", "0\tabc\t a film .\t3\n")
    with pytest.raises(RawDataError, match="expected a header with id, sentence, sentiment"):
        read_split(path, TASKS["sst"], "dev")


def test_labeled_test_split_is_an_error(tmp_path):
    path = write(tmp_path / "sts-test-student.csv", "\tid\tsentence1\tsentence2\tsimilarity\n0\tt\ta\tb\t1\n")
    with pytest.raises(RawDataError, match="test split must be unlabeled"):
        read_split(path, TASKS["sts"], "test")


def test_non_utf8_file_names_the_line(tmp_path):
    path = write(tmp_path / "ids-sst-dev.csv", b"\tid\tsentence\tsentiment\n0\ta\tfine\t1\n"
                 + b"1\tb\tcaf\xe9\t2\n")
    with pytest.raises(RawDataError, match="ids-sst-dev.csv: not valid UTF-8 at line 3"):
        read_split(path, TASKS["sst"], "dev")


def test_row_with_too_many_fields_is_a_parse_error(tmp_path):
    path = write(tmp_path / "ids-sst-dev.csv", "\tid\tsentence\tsentiment\n0\ta\tx\t1\textra\tmore\n")
    with pytest.raises(RawDataError, match="ids-sst-dev.csv: line 2 has 6 cells, the header has 4"):
        read_split(path, TASKS["sst"], "dev")


def test_empty_and_missing_files_are_clear_errors(tmp_path):
    with pytest.raises(RawDataError, match="the file is empty"):
        read_split(write(tmp_path / "ids-sst-dev.csv", ""), TASKS["sst"], "dev")
    with pytest.raises(RawDataError, match="file not found; run `dvc pull data/raw.dvc`"):
        read_split(tmp_path / "nope.csv", TASKS["sst"], "dev")


def test_a_text_is_visible_when_a_character_shows_after_unicode_normalisation():
    from mtbert.inputs import has_visible_text

    invisible = ["", "  \t\n", "\u200b\u200b", "\u00a0\u3000", "\ufeff\u2060\u200d", "\u202e\u0007"]
    assert not any(has_visible_text(text) for text in invisible)
    assert all(has_visible_text(text) for text in ["a", "\u200bok\u200b", "\uff21", "\u00e9", "\u4e00", "?"])

