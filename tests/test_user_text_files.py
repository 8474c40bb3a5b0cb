"""Text files a user hands trl_ext (templates, data files, YAML configs, chat templates) are read one way
(trl_ext.errors.read_text): UTF-8 with a byte-order mark dropped, UTF-16/UTF-32 with a byte-order mark decoded, and
any other encoding refused in one line naming the flag and the file (exit 2), never a UnicodeDecodeError traceback
or a U+FEFF at the start of every prompt."""

from __future__ import annotations

import codecs
import gzip
import json

import pytest

from trl_ext import cli, tasks
from trl_ext.errors import RecipeError, decode_text

TEXT = "Réponds en français : {question}\nRéponse :"
"""A template with non-ASCII characters (é, ç), as a French user would write it."""

ENCODINGS = {  # how an editor may save TEXT; each decodes to TEXT
    "utf-8": TEXT.encode("utf-8"),
    "utf-8 with BOM": codecs.BOM_UTF8 + TEXT.encode("utf-8"),
    "utf-16-le with BOM": codecs.BOM_UTF16_LE + TEXT.encode("utf-16-le"),
    "utf-16-be with BOM": codecs.BOM_UTF16_BE + TEXT.encode("utf-16-be"),
    "utf-32-le with BOM": codecs.BOM_UTF32_LE + TEXT.encode("utf-32-le"),
    "utf-8, Windows line ends": TEXT.replace("\n", "\r\n").encode("utf-8"),
}
REFUSED = {  # (bytes, what the one line says)
    "cp1252": (TEXT.encode("cp1252"), r"not UTF-8 text \(byte 0xe9 at line 1, column 2; a cp1252 or latin-1 file\?\)"),
    "utf-16-le without BOM": (TEXT.encode("utf-16-le"), r"holds NUL bytes \(line 1\): UTF-16 or UTF-32 without"),
    "latin-1, second line": (
        "ok\nRéponse {question}".encode("latin-1"),
        r"not UTF-8 text \(byte 0xe9 at line 2, column 2;",
    ),
}


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_every_encoding_with_its_mark_decodes_to_the_same_text(encoding):
    assert decode_text(ENCODINGS[encoding], "f.txt") == TEXT


@pytest.mark.parametrize("encoding", REFUSED)
def test_other_encodings_are_one_line_naming_the_file(encoding):
    data, message = REFUSED[encoding]
    with pytest.raises(ValueError, match=r"^f\.txt: " + message):
        decode_text(data, "f.txt")


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_a_template_file_gives_the_same_prompts_in_every_encoding(encoding, tmp_path):
    path = tmp_path / "template.txt"
    path.write_bytes(ENCODINGS[encoding])
    task = tasks.load_task(tasks.TaskArguments(template=str(path), num_train_problems=5, num_eval=3), 8)
    for row in [*task.train, *task.test]:
        assert row["prompt"] == TEXT.replace("{question}", row["question"])  # no U+FEFF, no \r
        assert not row["prompt"].startswith("\ufeff")


@pytest.mark.parametrize("encoding", REFUSED)
def test_a_template_in_another_encoding_is_one_error_line_and_exit_2(encoding, tmp_path, capsys, monkeypatch):
    """Through the command line, as a user meets it: `error: --template FILE: ...`, exit status 2, no traceback."""
    from conftest import load_recipe

    grpo_math = load_recipe("grpo_math")
    import trl_ext.models

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(trl_ext.models, "load_model_and_tokenizer", no_model)
    data, message = REFUSED[encoding]
    path = tmp_path / "template.txt"
    path.write_bytes(data)
    argv = ["--template", str(path), "--output_dir", str(tmp_path / "out"), "--num_train_problems", "8"]
    with pytest.raises(SystemExit) as exit_info:
        cli.main(grpo_math.main, argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    import re

    assert re.fullmatch(rf"error: --template {re.escape(str(path))}: {message}.*\n", err)
    import signal

    signal.signal(signal.SIGINT, signal.default_int_handler)  # cli.main installed the recipe's handler
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


ROWS = [
    {"question": "Combien font 2 + 2 ?", "answer": "réponse\n#### 4"},
    {"question": "Et 3 + 3 ?", "answer": "#### 6"},
]


@pytest.mark.parametrize("encoding", ["utf-8 with BOM", "utf-16-le with BOM"])
@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_a_math_data_file_with_a_byte_order_mark_loads_every_row(encoding, suffix, tmp_path):
    from trl_ext.data import load_math_dataset

    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in ROWS) if suffix == ".jsonl" else json.dumps(ROWS)
    mark, codec = (codecs.BOM_UTF8, "utf-8") if encoding == "utf-8 with BOM" else (codecs.BOM_UTF16_LE, "utf-16-le")
    path = tmp_path / f"data{suffix}"
    path.write_bytes(mark + text.encode(codec))
    data = load_math_dataset(path, kind="gsm8k")
    assert data["question"] == [r["question"] for r in ROWS] and data["answer"] == ["4", "6"]


def test_a_data_file_in_cp1252_names_the_flag_and_the_file(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in ROWS).encode("cp1252"))
    with pytest.raises(
        RecipeError, match=rf"^--dataset_name: {path}: not UTF-8 text \(byte 0xe9 at line 1, column 50;"
    ):
        tasks.load_task(tasks.TaskArguments(dataset_name=str(path)), 8)


def test_instruction_and_preference_files_drop_the_mark(tmp_path):
    from trl_ext.data.instructions import read_jsonl_lines
    from trl_ext.data.preferences import load_preference_rows

    row = {"prompt": "Salut", "chosen": "Bonjour, ça va ?", "rejected": "Non."}
    path = tmp_path / "pairs.jsonl"
    path.write_bytes(codecs.BOM_UTF8 + (json.dumps(row, ensure_ascii=False) + "\r\n").encode() * 2)
    assert [json.loads(line) for _, _, line in read_jsonl_lines(path)] == [row, row]
    assert len(load_preference_rows(path)) == 2  # the first row is not lost as "invalid JSON"
    path.write_bytes((json.dumps(row, ensure_ascii=False) + "\n").encode("cp1252"))
    with pytest.raises(ValueError, match=rf"^{path}: not UTF-8 text \(byte 0xe7 at line 1, column 41;"):
        load_preference_rows(path)


def test_the_course_sft_file_drops_the_mark_gzipped_or_not(tmp_path):
    import trl_ext.cs336 as cs336

    rows = [{"prompt": "Dis bonjour.", "response": "Bonjour !"}]
    data = codecs.BOM_UTF8 + "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()
    (tmp_path / "sft.jsonl").write_bytes(data)
    (tmp_path / "sft.jsonl.gz").write_bytes(gzip.compress(data))
    for name in ("sft.jsonl", "sft.jsonl.gz"):
        assert cs336._read_jsonl(tmp_path / name) == rows


def test_a_yaml_config_with_a_mark_parses_and_one_in_cp1252_is_one_line(tmp_path):
    from conftest import load_recipe

    grpo_math = load_recipe("grpo_math")
    path = tmp_path / "config.yaml"
    path.write_bytes(codecs.BOM_UTF8 + "instruction: Réponds.\nnum_eval: 7\n".encode())
    script_args, *_ = grpo_math.main.parse_args(["--config", str(path)])
    assert (script_args.instruction, script_args.num_eval) == ("Réponds.", 7)
    path.write_bytes("instruction: Réponds.\n".encode("cp1252"))
    with pytest.raises(RecipeError, match=rf"^--config {path}: not UTF-8 text \(byte 0xe9 at line 1, column 15;"):
        grpo_math.main.parse_args(["--config", str(path)])


def test_a_chat_template_trl_reads_itself_is_refused_with_a_mark_or_another_encoding(tmp_path):
    """SFT's and the reward trainer's chat_template_path is read by TRL (open(path, encoding="utf-8")): a mark would
    put U+FEFF before every prompt, so it is refused before any model loads, as is another encoding."""
    from conftest import load_recipe

    sft = load_recipe("sft_instruct")
    template = "{% for m in messages %}{{ m['content'] }} — {% endfor %}"
    path = tmp_path / "chat.jinja"
    out = ["--output_dir", str(tmp_path / "out")]
    path.write_bytes(template.encode())
    sft.main.parse_args(["--chat_template_path", str(path), *out])  # plain UTF-8: fine
    for data, message in (
        (codecs.BOM_UTF8 + template.encode(), "starts with a byte-order mark, which TRL reads into the chat template"),
        (codecs.BOM_UTF16_LE + template.encode("utf-16-le"), "starts with a byte-order mark"),
        (template.encode("cp1252", errors="replace").replace(b"?", b"\x97"), r"not UTF-8 text \(byte 0x97"),
    ):
        path.write_bytes(data)
        with pytest.raises(RecipeError, match=rf"^--chat_template_path {path}: {message}"):
            sft.main.parse_args(["--chat_template_path", str(path), *out])
