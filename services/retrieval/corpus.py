"""The knowledge base as passages: the interpreter's own documentation, or a user's text files.

A passage is what retrieval embeds, indexes and returns: an id, its text, and a payload that
filters can test. The stdlib corpus is built from docstrings of the modules below and from
`pydoc_data.topics` (the language reference `help()` shows), so it needs nothing but the
running interpreter and is the same on every machine with the same Python. Long texts are cut
into overlapping chunks small enough to embed well (MiniLM reads ~256 tokens, ~1,000-1,500
characters of English) while keeping paragraphs, and so code examples, whole.

Pure Python: no grpc, no model. Ingestion upserts these passages as `Document`s.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import inspect
import os
import re
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import takewhile
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

# Widely used modules that import without side effects (no GUI, no terminal, no network).
# A fixed, sorted list, so the corpus and its ids are the same on every run.
STDLIB_MODULES = tuple(
    re.findall(
        r"\S+",
        """abc argparse array ast asyncio atexit base64 bisect builtins bz2 calendar codecs
        collections collections.abc concurrent.futures configparser contextlib contextvars copy csv
        dataclasses datetime decimal difflib doctest email email.message email.utils enum filecmp
        fnmatch fractions functools gc getpass glob graphlib gzip hashlib heapq hmac html
        html.parser http http.client http.server importlib importlib.metadata inspect io ipaddress
        itertools json locale logging logging.handlers lzma math mimetypes multiprocessing
        multiprocessing.pool numbers operator os os.path pathlib pickle pkgutil platform pprint
        queue random re sched secrets select selectors shelve shlex shutil signal smtplib socket
        socketserver sqlite3 ssl statistics string struct subprocess sys tarfile tempfile textwrap
        threading time timeit tomllib traceback types typing unicodedata unittest unittest.mock
        urllib.parse urllib.request uuid warnings weakref xml.etree.ElementTree zipfile zlib
        zoneinfo""",
    )
)

MAX_CHARS = 1500
OVERLAP_CHARS = 200
# Docstrings that say nothing the title does not: a word or two ("Eq", "Return self."), or
# what enum writes on every enum class that has none.
MIN_DOC_WORDS = 3
BOILERPLATE_DOCS = frozenset({"An enumeration."})
TEXT_SUFFIXES = frozenset({".txt", ".md", ".markdown", ".rst"})

# rST heading underlines in pydoc topics: noise to an embedder, and the heading stays.
_UNDERLINE = re.compile(r"^([*=\-~^])\1{2,}$", re.MULTILINE)
_PARAGRAPH_BREAK = re.compile(r"\n\s*\n")
# Where a paragraph too long for one chunk may be cut: first between sentences or lines,
# then between words.
_LONG_PARAGRAPH_CUTS = (re.compile(r"[ \t]*\n|(?<=[.!?])[ \t]+"), re.compile(r"\s+"))


@dataclass(frozen=True)
class Passage:
    """One unit of retrieval; payload holds source, kind, title, part and module if any."""

    id: str
    text: str
    payload: dict[str, Any] = field(hash=False)


# ---------------------------------------------------------------------------- chunking


class _Unit(NamedTuple):
    """Text that is never cut, and the whitespace that preceded it in the original."""

    text: str
    sep: str


def chunk(text: str, max_chars: int = MAX_CHARS, overlap_chars: int = OVERLAP_CHARS) -> list[str]:
    """Cuts text into chunks of at most max_chars, whole paragraphs where they fit.

    Each chunk after the first starts with the last paragraphs (or sentences) of the one
    before, up to overlap_chars, so an answer that straddles a cut is whole in one chunk.
    """
    if max_chars <= 0 or not 0 <= overlap_chars < max_chars:
        raise ValueError(f"need 0 <= overlap_chars < max_chars, got {overlap_chars}, {max_chars}")
    units: list[_Unit] = []
    for paragraph in _PARAGRAPH_BREAK.split(text):
        if paragraph.strip():
            units += _cut(_Unit(paragraph.rstrip(), "\n\n"), max_chars, 0)
    return _pack(units, max_chars, overlap_chars)


def _cut(unit: _Unit, max_chars: int, level: int) -> list[_Unit]:
    """Splits a unit longer than max_chars at the coarsest boundary that exists in it."""
    if len(unit.text) <= max_chars:
        return [unit]
    if level == len(_LONG_PARAGRAPH_CUTS):  # one "word" longer than a chunk: slice it
        starts = range(0, len(unit.text), max_chars)
        return [_Unit(unit.text[i : i + max_chars], unit.sep if i == 0 else "") for i in starts]
    units, start, sep = [], 0, unit.sep
    for match in _LONG_PARAGRAPH_CUTS[level].finditer(unit.text):
        if match.start() > start:
            units += _cut(_Unit(unit.text[start : match.start()], sep), max_chars, level + 1)
            sep = ""
        start, sep = match.end(), sep + match.group()
    if start < len(unit.text):
        units += _cut(_Unit(unit.text[start:], sep), max_chars, level + 1)
    return units


def _pack(units: list[_Unit], max_chars: int, overlap_chars: int) -> list[str]:
    """Greedily fills chunks with units; a new chunk reopens with the previous one's tail."""
    chunks: list[str] = []
    current: list[_Unit] = []
    for unit in units:
        if current and _length([*current, unit]) > max_chars:
            chunks.append(_join(current))
            current = _tail(current, overlap_chars)
            while current and _length([*current, unit]) > max_chars:
                current.pop(0)
        current.append(unit)
    if current:
        chunks.append(_join(current))
    return chunks


def _length(units: list[_Unit]) -> int:
    return len(_join(units))


def _join(units: list[_Unit]) -> str:
    """The units as they read in the original; a chunk's first unit drops its separator."""
    return units[0].text + "".join(unit.sep + unit.text for unit in units[1:])


def _tail(units: list[_Unit], overlap_chars: int) -> list[_Unit]:
    """The longest run of final units that fits in overlap_chars."""
    start = len(units)
    while start > 0 and _length(units[start - 1 :]) <= overlap_chars:
        start -= 1
    return units[start:]


# ---------------------------------------------------------------------------- stdlib


def stdlib_passages() -> Iterator[Passage]:
    """The stdlib knowledge base: module, class, function and method docstrings, then topics.

    Each object is documented once, under the module that defines it. An object defined in a
    private implementation module (`_io`, `posix`, `asyncio.tasks`) goes to the first listed
    module that exports it, which is its documented home (`io`, `os`, `asyncio`). What a
    process has put in place of a stdlib object (pytest replaces `sys.unraisablehook`) is
    not the stdlib's, and is left out.
    """
    with warnings.catch_warnings():  # deprecated names and modules are still documented
        warnings.simplefilter("ignore")
        modules = {name: importlib.import_module(name) for name in STDLIB_MODULES}
        listed = {module.__name__ for module in modules.values()}
        claimed: set[int] = set()
        for name, module in modules.items():
            yield from _module_passages(name, module, listed, claimed)
    yield from _topic_passages()


def _module_passages(
    name: str, module: ModuleType, listed: set[str], claimed: set[int]
) -> Iterator[Passage]:
    """The module's docstring, then each class and function it is home to, with methods."""
    meta = {"kind": "module", "module": name, "title": name}
    yield from _parts(name, _own_doc(module), name, meta)
    homed = []
    for attr, obj in _exports(module):
        if id(obj) not in claimed and _is_home(module, attr, obj, listed):
            claimed.add(id(obj))
            homed.append((attr, obj))
    inherited = _inherited_homes([obj for _, obj in homed if inspect.isclass(obj)])
    for attr, obj in homed:
        qualname = f"{name}.{attr}"
        kind = "class" if inspect.isclass(obj) else "function"
        yield from _object_passages(qualname, obj, {"kind": kind, "module": name})
        if inspect.isclass(obj):
            for method_name, method in _methods(obj, inherited):
                meta = {"kind": "method", "module": name}
                yield from _object_passages(f"{qualname}.{method_name}", method, meta)


def _exports(module: ModuleType) -> list[tuple[str, Any]]:
    """The module's public classes and functions, sorted by name."""
    names = getattr(module, "__all__", vars(module))  # asyncio's __all__ has `_enter_task`
    public = sorted({name for name in names if not name.startswith("_")})
    objects = ((name, getattr(module, name, None)) for name in public)
    return [(name, obj) for name, obj in objects if inspect.isclass(obj) or inspect.isroutine(obj)]


def _is_home(module: ModuleType, attr: str, obj: Any, listed: set[str]) -> bool:
    """Whether `module.attr` is where obj is documented, not an alias or a re-export."""
    if _is_alias(module, attr, obj):
        return False
    home = getattr(obj, "__module__", None)
    if home == module.__name__:
        return True
    if home in listed:  # documented under its own module
        return False
    # From an implementation module: only what the module exports on purpose.
    exported = getattr(module, "__all__", None)
    return attr in exported if exported is not None else str(home).startswith("_")


def _is_alias(owner: Any, attr: str, obj: Any) -> bool:
    """Whether `owner.attr` is a second name for something owner has under its own name.

    `bisect.insort` is `insort_right`, `socket.SocketType` is the C base of `socket.socket`;
    but `hashlib.sha256`, whose function is named `openssl_sha256`, has only that name there.
    """
    name = getattr(obj, "__name__", attr)
    return name != attr and hasattr(owner, name)


def _private_bases(cls: type) -> list[type]:
    """The private classes (`_io._IOBase`, `_socket.socket`) cls inherits from before the
    first public one."""
    return list(takewhile(_is_private, cls.__mro__[1:]))  # object is public


def _is_private(cls: type) -> bool:
    return cls.__name__.startswith("_") or cls.__module__.startswith("_")


def _inherited_homes(classes: list[type]) -> dict[int, type]:
    """Which class documents each method that classes inherit from private bases.

    A method of a public base is documented on that base, but one from a private helper
    (`argparse._ActionsContainer.add_argument`) would be documented nowhere. It goes to the
    class with the fewest private bases that has it, so `_io._IOBase.close` is documented
    once as `io.IOBase.close`, not again under each io class that inherits it. A method
    that an exported class defines itself stays there (`asyncio.Future.result` is not also
    `asyncio.Task.result`).
    """
    homes = {id(value): cls for cls in classes for value in vars(cls).values()}
    for cls in sorted(classes, key=lambda cls: (len(_private_bases(cls)), cls.__name__)):
        for base in _private_bases(cls):
            for value in vars(base).values():
                homes.setdefault(id(value), cls)
    return homes


def _methods(cls: type, inherited: dict[int, type]) -> list[tuple[str, Any]]:
    """Public methods the class defines, or inherits from private bases it documents."""
    raw = dict(vars(cls))
    for base in _private_bases(cls):
        for name, value in vars(base).items():
            if inherited.get(id(value)) is cls:
                raw.setdefault(name, value)
    methods = []
    for name in sorted(raw):
        if name.startswith("_") or not inspect.isroutine(raw[name]):
            continue
        method = getattr(cls, name)
        if not _is_alias(cls, name, method):
            methods.append((name, method))
    return methods


def _object_passages(qualname: str, obj: Any, meta: dict[str, str]) -> Iterator[Passage]:
    meta = {**meta, "title": qualname}
    yield from _parts(qualname + _signature(obj), _own_doc(obj), qualname, meta)


def _signature(obj: Any) -> str:
    """`(a, b=1, *, key=None)`, or nothing for the many builtins without a signature."""
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return ""
    parameters = [
        parameter.replace(default=_Default(parameter.default))
        if parameter.default is not parameter.empty
        else parameter
        for parameter in signature.parameters.values()
    ]
    return str(signature.replace(parameters=parameters))


class _Default:
    """A default value as a signature shows it, the same in every process.

    A plain repr is not: sentinels carry their address (`<object object at 0x7f...>`) and
    mutable defaults show live state (`logging.shutdown(handlerList=[<weakref ...>])`). So
    only literals keep their repr; classes and functions show their name, the rest `...`.
    """

    def __init__(self, value: Any) -> None:
        self._value = value

    def __repr__(self) -> str:
        if inspect.isclass(self._value) or inspect.isroutine(self._value):
            return self._value.__qualname__
        text = repr(self._value)
        try:
            ast.literal_eval(text)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            return "..."
        return text


def _own_doc(obj: Any) -> str:
    """The object's own docstring; a class without one is described by its __init__.

    Not inspect.getdoc: it falls back to a base class's docstring, which would describe
    `ThreadPoolExecutor` as "an abstract base class" and repeat one text under many ids.
    """
    doc = getattr(obj, "__doc__", None)
    if not isinstance(doc, str) and inspect.isclass(obj):
        doc = getattr(vars(obj).get("__init__"), "__doc__", None)
    return inspect.cleandoc(doc) if isinstance(doc, str) else ""


def _parts(title_line: str, doc: str, base_id: str, meta: dict[str, str]) -> Iterator[Passage]:
    """The titled docstring as passages `base_id`, `base_id#2`, ...; none if it is trivial."""
    if len(doc.split()) < MIN_DOC_WORDS or doc in BOILERPLATE_DOCS:
        return
    for number, part in enumerate(chunk(f"{title_line}\n\n{doc}"), start=1):
        payload = {"source": "stdlib", "part": number, **meta}
        if number == 1:
            yield Passage(base_id, part, payload)
        else:  # a later part names its subject, or "it" in it would be anybody's
            yield Passage(f"{base_id}#{number}", f"{base_id} (continued)\n\n{part}", payload)


def _topic_passages() -> Iterator[Passage]:
    """The language reference topics `help("with")` shows, as `topic:with` and so on."""
    from pydoc_data.topics import topics

    for key in sorted(topics):
        text = _UNDERLINE.sub("", topics[key]).strip()
        meta = {"kind": "topic", "title": text.partition("\n")[0]}
        yield from _parts(f"topic:{key}", text, f"topic:{key}", meta)


# ---------------------------------------------------------------------------- files


def file_passages(
    paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
) -> Iterator[Passage]:
    """Passages `<name>#<n>` from text files and the text files under folders.

    A folder is walked in sorted order, skipping hidden files and folders, and its files are
    named relative to the folder's parent (`docs/guide/intro.md`), so ids do not depend on the
    directory ingestion runs from. Raises ValueError for a file that is not UTF-8 text.
    """
    if isinstance(paths, str | os.PathLike):  # one path, not the characters of one
        paths = [paths]
    seen: set[str] = set()
    for root in map(Path, paths):
        for path, name in _text_files(root):
            if name in seen:
                raise ValueError(f"{path}: a second file named {name!r}; ids must be unique")
            seen.add(name)
            for number, part in enumerate(chunk(_read_text(path)), start=1):
                payload = {"source": str(path), "kind": "file", "title": name, "part": number}
                yield Passage(f"{name}#{number}", part, payload)


def _text_files(root: Path) -> list[tuple[Path, str]]:
    """(path, name) of each text file root is or holds, sorted by name."""
    if root.is_file():
        if root.suffix.lower() not in TEXT_SUFFIXES:
            raise ValueError(f"{root}: not a text file ({', '.join(sorted(TEXT_SUFFIXES))})")
        return [(root, root.name)]
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such file or folder")
    top = root.resolve().name
    found = []
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = [sub for sub in subfolders if not sub.startswith(".")]
        for file in files:
            path = Path(folder, file)
            if not file.startswith(".") and path.suffix.lower() in TEXT_SUFFIXES:
                found.append((path, f"{top}/{path.relative_to(root).as_posix()}"))
    return sorted(found, key=lambda pair: pair[1])


def _read_text(path: Path) -> str:
    """Strict UTF-8, so a binary or mis-encoded file fails loudly instead of being indexed
    as mojibake; a byte order mark and CR line ends are dropped."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not valid UTF-8 at byte offset {error.start}") from error
    return text.removeprefix("\ufeff").replace("\r\n", "\n").replace("\r", "\n")


# ---------------------------------------------------------------------------- dedupe


def dedupe(passages: Iterable[Passage]) -> Iterator[Passage]:
    """Drops passages whose text, whitespace aside, an earlier one already had."""
    seen: set[bytes] = set()
    for passage in passages:
        digest = hashlib.sha256(" ".join(passage.text.split()).encode()).digest()
        if digest not in seen:
            seen.add(digest)
            yield passage
