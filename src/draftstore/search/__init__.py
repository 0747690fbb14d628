"""Code search: the matcher, the trigram index format, line tables and the planner.

``View.search_code`` calls a ``CodeSearch`` (the store's is a ``Planner`` over
``PackedIndexes``); the matcher's results and globs are what callers read.

- ``matcher``     globs and the exact matcher on RE2 (no I/O); pages of results bounded in bytes
- ``trigrams``    the trigram index of a pack's files, and the trigrams a pattern requires (no I/O)
- ``linetables``  the lines holding a tree's rarest trigrams: per pack, and the tree summary (no I/O)
- ``packed``      reading the indexes and summaries of packed trees; a query's candidates
- ``planner``     which files a search reads: the summary, the indexes, or every file
"""

from .matcher import (MAX_RESULTS_CAP, PAGE_BYTES, RE2_SYNTAX_URL, Glob, SearchMatch, SearchResult, Searcher,
                      compile_glob, glob_base, paged)
from .packed import PackCover, PackedIndexes
from .planner import CodeSearch, Planner, SearchedState

__all__ = ["CodeSearch", "SearchedState", "Planner", "PackedIndexes", "PackCover", "Searcher", "SearchMatch",
           "SearchResult", "Glob", "compile_glob", "glob_base", "paged", "MAX_RESULTS_CAP", "PAGE_BYTES",
           "RE2_SYNTAX_URL"]
