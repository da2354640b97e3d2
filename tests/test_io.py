"""Reading JSONL lines (eagledata.io): every line reads as the standard library reads it, whichever
parser reads it first, and a bad line's error names the line and what is wrong."""
import json

import pytest

from eagledata.io import BLANK_LINE, LINE_BUFFER, ResponsesFileError, iter_lines_at, json_line_value, loads_json, open_lines

READ_AS_JSON = [
    b'{"id": "a", "x": [1, 2.5, null, true]}\n',
    b'{"id": "crlf"}\r\n',
    b'{"id": "no line break"}',
    '{"id": "\u00e9 \u6f22\u5b57 \U0001f642 sep\u2028arator"}\n'.encode("utf-8"),
    b'{"id": "lone \\ud800 surrogate"}\n',  # orjson refuses it; the standard library reads it
    b'{"id": "nan", "x": NaN}\n',
    b'  {"id": "spaced"}  \n',
]


@pytest.mark.parametrize("raw", READ_AS_JSON)
def test_a_line_reads_as_the_standard_library_reads_it(raw):
    value = json_line_value(raw, "f.jsonl:3", ResponsesFileError)
    expected = json.loads(raw.decode("utf-8"))
    assert json.dumps(value, sort_keys=True) == json.dumps(expected, sort_keys=True)


@pytest.mark.parametrize("raw", [b"\n", b"   \r\n", b"", "\u00a0\u2028 \n".encode("utf-8"), b"\t\n"])
def test_a_blank_line_is_blank(raw):
    assert json_line_value(raw, "f.jsonl:3", ResponsesFileError) is BLANK_LINE


@pytest.mark.parametrize("raw, message", [
    (b'{"id": "caf\xe9"}\n', "f.jsonl:3:(line): not valid UTF-8 (invalid continuation byte at byte 11)"),
    (b'{"id": "a",}\n', "f.jsonl:3:(json): invalid JSON"),
    (b'\xef\xbb\xbf{"id": "bom"}\n', "f.jsonl:3:(json): invalid JSON: Unexpected UTF-8 BOM"),
    (b'[1, 2]\n', "f.jsonl:3: a line must be a JSON object, got list"),
    (b'"text"\n', "f.jsonl:3: a line must be a JSON object, got str"),
])
def test_a_bad_line_is_refused_naming_the_line(raw, message):
    with pytest.raises(ResponsesFileError) as err:
        json_line_value(raw, "f.jsonl:3", ResponsesFileError)
    assert str(err.value).startswith(message)


def test_lines_longer_than_the_buffer_are_read_whole_with_their_offsets(tmp_path):
    lines = [b'{"id": "short"}\n', b'{"id": "long", "t": "' + b"x" * (3 * LINE_BUFFER + 7) + b'"}\n', b"\n", b'{"id": "end"}']
    path = tmp_path / "r.jsonl"
    path.write_bytes(b"".join(lines))
    with open_lines(path) as fh:
        got = list(iter_lines_at(fh))
    offsets = [sum(map(len, lines[:i])) for i in range(len(lines))]
    assert got == [(i + 1, offsets[i], line) for i, line in enumerate(lines)]


def test_quick_exit_keeps_the_log_and_the_status(tmp_path):
    """A per-shard job ends without the interpreter's teardown: what it logged and printed is there,
    and its exit status is the one asked for (a failed job must still fail)."""
    import subprocess
    import sys

    log = tmp_path / "job.log"
    code = ("import logging\nfrom eagledata.io import quick_exit\n"
            f"logging.basicConfig(filename={str(log)!r}, level=logging.INFO)\n"
            "logging.info('reconstructed 3 samples')\nprint('to stdout', end='')\nquick_exit(3)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 3 and done.stdout == "to stdout"
    assert "reconstructed 3 samples" in log.read_text()


def test_json_nested_too_deeply_is_invalid_json_not_a_crash(tmp_path):
    deep = "[" * 5000 + "]" * 5000
    with pytest.raises(json.JSONDecodeError, match="nested too deeply"):
        loads_json(deep)
    with pytest.raises(ResponsesFileError, match=r"x.jsonl:3:\(json\): invalid JSON: nested too deeply"):
        json_line_value(('{"a": ' + deep + "}").encode(), "x.jsonl:3", ResponsesFileError)
