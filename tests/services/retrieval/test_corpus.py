"""The knowledge base: chunking, the stdlib corpus, user files and dedupe."""

from __future__ import annotations

import hashlib
import itertools
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.retrieval.corpus import Passage, chunk, dedupe, file_passages, stdlib_passages

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]
KINDS = {"module", "class", "function", "method", "topic"}


def _digest(passages: list[Passage]) -> str:
    hasher = hashlib.sha256()
    for passage in passages:
        hasher.update(f"{passage.id}\0{passage.text}\0{sorted(passage.payload.items())}\0".encode())
    return hasher.hexdigest()


@pytest.fixture(scope="module")
def corpus() -> list[Passage]:
    start = time.perf_counter()
    passages = list(stdlib_passages())
    assert time.perf_counter() - start < 10
    return passages


# ---------------------------------------------------------------------------- chunk


def test_a_short_text_is_one_chunk():
    assert chunk("One paragraph.\n\nAnother one.") == ["One paragraph.\n\nAnother one."]
    assert chunk("") == []
    assert chunk("\n \n\t\n") == []


def test_paragraphs_are_packed_whole_up_to_max_chars():
    paragraphs = [f"{i}" * 40 for i in range(10)]  # 40 chars each, 42 with the break
    chunks = chunk("\n\n".join(paragraphs), max_chars=130, overlap_chars=0)
    assert chunks == ["\n\n".join(paragraphs[i : i + 3]) for i in (0, 3, 6)] + [paragraphs[9]]


def test_each_chunk_reopens_with_the_tail_of_the_previous_one():
    paragraphs = [f"{i}" * 40 for i in range(6)]
    chunks = chunk("\n\n".join(paragraphs), max_chars=130, overlap_chars=90)
    # Two 40-char paragraphs (82 chars with the break) fit in the overlap; three would not.
    assert chunks[0] == "\n\n".join(paragraphs[0:3])
    assert chunks[1] == "\n\n".join(paragraphs[1:4])
    assert chunks[-1].endswith(paragraphs[-1])


def test_a_long_paragraph_is_cut_between_sentences():
    sentence = "The quick brown fox jumps over the lazy dog. "
    paragraph = (sentence * 10).strip()
    chunks = chunk(paragraph, max_chars=100, overlap_chars=0)
    assert all(len(part) <= 100 for part in chunks)
    assert all(part.startswith("The quick") and part.endswith("dog.") for part in chunks)
    assert " ".join(chunks) == paragraph


def test_a_sentence_longer_than_a_chunk_is_cut_between_words():
    words = [f"word{i:03}" for i in range(60)]
    chunks = chunk(" ".join(words), max_chars=80, overlap_chars=0)
    assert all(len(part) <= 80 for part in chunks)
    assert [word for part in chunks for word in part.split()] == words


def test_a_word_longer_than_a_chunk_is_sliced():
    assert chunk("x" * 250, max_chars=100, overlap_chars=0) == ["x" * 100, "x" * 100, "x" * 50]


def test_lines_of_code_keep_their_indentation():
    code = "def f():\n    return 1\n\n" + "\n".join(f"    line_{i} = {i}" for i in range(40))
    for part in chunk(code, max_chars=200, overlap_chars=0):
        lines = [line for line in part.splitlines() if line]
        assert all(line.startswith(("def", "    ")) for line in lines)


@pytest.mark.parametrize(("max_chars", "overlap_chars"), [(0, 0), (100, 100), (100, -1)])
def test_bad_sizes_are_refused(max_chars: int, overlap_chars: int):
    with pytest.raises(ValueError, match="overlap_chars"):
        chunk("text", max_chars=max_chars, overlap_chars=overlap_chars)


_WORD_LENGTHS = st.integers(min_value=1, max_value=12)
_PARAGRAPHS = st.lists(st.lists(_WORD_LENGTHS, min_size=1, max_size=40), min_size=1, max_size=12)


@settings(max_examples=200, deadline=None)
@given(
    shape=_PARAGRAPHS,
    max_chars=st.integers(min_value=40, max_value=400),
    overlap=st.floats(min_value=0, max_value=0.9),
)
def test_chunks_cover_the_text_in_order_within_bounds(shape, max_chars, overlap):
    """Every word lands in a chunk, in order; the only repeats are a bounded overlap."""
    counter = iter(range(10**6))
    paragraphs = [
        " ".join(f"w{next(counter)}".ljust(length, "x") for length in lengths) for lengths in shape
    ]
    words = " ".join(paragraphs).split()
    overlap_chars = int(max_chars * overlap)
    chunks = chunk("\n\n".join(paragraphs), max_chars=max_chars, overlap_chars=overlap_chars)

    assert all(0 < len(part) <= max_chars for part in chunks)
    assert list(dict.fromkeys(word for part in chunks for word in part.split())) == words
    for previous, current in itertools.pairwise(chunks):
        repeated = [word for word in current.split() if word in set(previous.split())]
        assert current.split()[: len(repeated)] == repeated  # the overlap opens the chunk
        assert len(" ".join(repeated)) <= overlap_chars


# ---------------------------------------------------------------------------- stdlib


def test_the_corpus_has_a_few_thousand_passages_with_unique_ids(corpus: list[Passage]):
    ids = [passage.id for passage in corpus]
    assert 2500 <= len(ids) <= 8000
    assert len(set(ids)) == len(ids)


def test_well_known_ids_are_there(corpus: list[Passage]):
    ids = {passage.id for passage in corpus}
    expected = {
        "subprocess.run",
        "pathlib.Path.glob",
        "collections.OrderedDict.move_to_end",
        "os.path.join",  # posixpath, documented under its public name
        "os.listdir",  # defined in posix
        "asyncio.gather",  # defined in asyncio.tasks
        "sqlite3.connect",  # defined in _sqlite3, which has no __all__
        "argparse.ArgumentParser.add_argument",  # inherited from a private base
        "socket.socket.connect",  # inherited from the C class _socket.socket
        "hashlib.sha256",  # its function is named openssl_sha256
        "builtins.sorted",
        "topic:with",
        "topic:lambda",
    }
    assert expected <= ids


def test_each_object_is_documented_once_under_its_home(corpus: list[Passage]):
    ids = {passage.id for passage in corpus}
    assert "io.IOBase.readlines" in ids
    assert "io.FileIO.readlines" not in ids  # inherited from _io._IOBase like IOBase's
    assert "socket.SocketType" not in ids  # an alias of the C base of socket.socket
    assert "bisect.insort" not in ids  # an alias of bisect.insort_right
    assert "secrets.compare_digest" not in ids  # re-exported from hmac
    assert not any(passage_id.startswith("asyncio.tasks.") for passage_id in ids)
    assert not any("._" in passage_id for passage_id in ids)


def test_payloads_say_where_a_passage_comes_from(corpus: list[Passage]):
    for passage in corpus:
        payload = passage.payload
        assert payload["source"] == "stdlib"
        assert payload["kind"] in KINDS
        assert payload["title"]
        assert ("module" in payload) == (payload["kind"] != "topic")
    run = next(passage for passage in corpus if passage.id == "subprocess.run")
    assert run.payload == {
        "source": "stdlib",
        "kind": "function",
        "module": "subprocess",
        "title": "subprocess.run",
        "part": 1,
    }


def test_texts_open_with_the_name_and_signature(corpus: list[Passage]):
    texts = {passage.id: passage.text for passage in corpus}
    assert texts["subprocess.run"].startswith("subprocess.run(*popenargs, input=None,")
    assert texts["topic:with"].startswith('topic:with\n\nThe "with" statement\n\n')
    assert not any(" at 0x" in text for text in texts.values())  # no run-specific addresses


def test_long_docstrings_are_split_into_numbered_parts(corpus: list[Passage]):
    parts = [passage for passage in corpus if passage.id.startswith("topic:specialnames")]
    assert [passage.payload["part"] for passage in parts] == list(range(1, len(parts) + 1))
    assert parts[0].id == "topic:specialnames"
    assert parts[1].id == "topic:specialnames#2"
    assert parts[1].text.startswith("topic:specialnames (continued)\n\n")
    assert all(len(passage.text) <= 1600 for passage in corpus)


def test_trivial_docstrings_are_skipped(corpus: list[Passage]):
    ids = {passage.id for passage in corpus}
    assert "ast.Eq" not in ids  # its docstring is just "Eq"
    assert "signal.Signals" not in ids  # enum's generated "An enumeration."


def _digest_in_a_fresh_process(hash_seed: str) -> str:
    script = (
        "from tests.services.retrieval.test_corpus import _digest; "
        "from services.retrieval.corpus import stdlib_passages; "
        "print(_digest(list(stdlib_passages())))"
    )
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, env=env
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_the_corpus_is_the_same_in_every_run():
    """Fresh processes, as ingestion runs: this one's pytest has replaced some stdlib hooks.

    Set iteration order changes with the hash seed; the corpus must not.
    """
    assert _digest_in_a_fresh_process("1") == _digest_in_a_fresh_process("2")


# ---------------------------------------------------------------------------- files


def _write(path: Path, data: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        path.write_text(data, encoding="utf-8")
    return path


def test_a_folder_yields_its_text_files_sorted_and_skips_the_rest(tmp_path: Path):
    docs = tmp_path / "docs"
    _write(docs / "b.txt", "Plain text.")
    _write(docs / "a.md", "# Title\n\nMarkdown.")
    _write(docs / "guide" / "intro.rst", "Intro\n=====\n\nText.")
    _write(docs / "guide" / "more.markdown", "More.")
    _write(docs / ".hidden.md", "hidden")
    _write(docs / ".git" / "notes.md", "hidden folder")
    _write(docs / "image.png", b"\x89PNG")
    passages = list(file_passages([docs]))
    assert [passage.id for passage in passages] == [
        "docs/a.md#1",
        "docs/b.txt#1",
        "docs/guide/intro.rst#1",
        "docs/guide/more.markdown#1",
    ]
    assert passages[0].text == "# Title\n\nMarkdown."
    assert passages[0].payload == {
        "source": str(docs / "a.md"),
        "kind": "file",
        "title": "docs/a.md",
        "part": 1,
    }


def test_a_long_file_is_chunked_into_numbered_parts(tmp_path: Path):
    text = "\n\n".join(f"Paragraph {i}. " + "word " * 100 for i in range(10))
    notes = _write(tmp_path / "notes.txt", text)
    passages = list(file_passages([notes]))
    assert [passage.id for passage in passages] == [
        f"notes.txt#{n}" for n in range(1, len(passages) + 1)
    ]
    assert [passage.text for passage in passages] == chunk(text)
    assert len(passages) > 1


def test_line_endings_and_a_bom_are_normalised(tmp_path: Path):
    path = _write(tmp_path / "win.txt", "\ufeffOne line\r\ntwo\r\n\r\nNext paragraph.".encode())
    [passage] = file_passages(path)  # one path alone works too
    assert passage.text == "One line\ntwo\n\nNext paragraph."


def test_a_file_that_is_not_utf8_names_itself_and_the_offset(tmp_path: Path):
    _write(tmp_path / "docs" / "good.md", "fine")
    bad = _write(tmp_path / "docs" / "bad.txt", b"caf\xe9 au lait")
    with pytest.raises(ValueError, match=r"bad\.txt.*UTF-8.*byte offset 3") as raised:
        list(file_passages([tmp_path / "docs"]))
    assert str(bad) in str(raised.value)


def test_unusable_paths_are_refused(tmp_path: Path):
    with pytest.raises(ValueError, match="not a text file"):
        list(file_passages([_write(tmp_path / "data.csv", "a,b")]))
    with pytest.raises(FileNotFoundError):
        list(file_passages([tmp_path / "missing"]))
    first = _write(tmp_path / "one" / "README.md", "one")
    second = _write(tmp_path / "two" / "README.md", "two")
    with pytest.raises(ValueError, match=r"two/README\.md.*second file named 'README\.md'"):
        list(file_passages([first, second]))


# ---------------------------------------------------------------------------- dedupe


def test_dedupe_keeps_the_first_of_texts_equal_but_for_whitespace():
    payload = {"source": "stdlib", "kind": "file", "title": "t", "part": 1}
    passages = [
        Passage("a", "Same  text\nhere.", payload),
        Passage("b", "Other text.", payload),
        Passage("c", " Same text here. ", payload),
        Passage("d", "same text here.", payload),  # case matters
    ]
    assert [passage.id for passage in dedupe(passages)] == ["a", "b", "d"]
