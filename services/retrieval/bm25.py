"""BM25 as sparse vectors, so Qdrant's sparse index does the keyword half of hybrid search.

Documents carry BM25's term-frequency part, tf * (k1 + 1) / (tf + k1 * (1 - b + b * len /
avgdl)); Qdrant multiplies in the IDF part itself (the sparse vector's `modifier: idf`),
so IDF stays right as the collection grows. Queries carry 1 per distinct term. Terms are
lower-cased words and identifier parts, so `lru_cache`, `lru` and `cache` all match
`functools.lru_cache`. A term's index is its CRC32, stable across processes and versions.
"""

from __future__ import annotations

import re
import zlib
from collections import Counter, defaultdict

K1 = 1.2
B = 0.75
# Qdrant's own BM25 (fastembed) assumes an average length; passages here are ~100 terms.
AVERAGE_LENGTH = 100.0

_WORD = re.compile(r"[a-z0-9_]+")
_STOPWORDS = frozenset(
    re.findall(
        r"\w+",
        """a about above after again against all am an and any are as at be because been before
        being below between both but by can could did do does doing down during each few for
        from further had has have having he her here hers herself him himself his how i if in
        into is it its itself just me more most my myself no nor not now of off on once only
        or other our ours ourselves out over own same she should so some such than that the
        their theirs them themselves then there these they this those through to too under
        until up very was we were what when where which while who whom why will with would
        you your yours yourself yourselves""",
    )
)


def _fold(word: str) -> str:
    """Plural folding, the one stemming step that pays for itself on API docs."""
    if len(word) > 3 and word.endswith("s") and not word.endswith("ss"):
        return word[:-1]
    return word


def terms(text: str) -> list[str]:
    found = []
    for word in _WORD.findall(text.lower()):
        parts = [word, *word.split("_")] if "_" in word.strip("_") else [word]
        found.extend(_fold(p) for p in parts if p and p not in _STOPWORDS)
    return found


def _index(term: str) -> int:
    return zlib.crc32(term.encode())


def document_vector(text: str) -> tuple[list[int], list[float]]:
    counts = Counter(terms(text))
    length = sum(counts.values())
    norm = K1 * (1 - B + B * length / AVERAGE_LENGTH)
    weights: defaultdict[int, float] = defaultdict(float)
    for term, tf in counts.items():
        weights[_index(term)] += tf * (K1 + 1) / (tf + norm)
    return list(weights), list(weights.values())


def query_vector(text: str) -> tuple[list[int], list[float]]:
    indices = sorted({_index(term) for term in terms(text)})
    return indices, [1.0] * len(indices)
