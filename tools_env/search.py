"""Embedded search (`web_search`, `wiki_search`) and pages (`crawl_page`) from a local corpus.

The corpus is a JSONL file of {"id", "title", "url", "text"} records. Search ranks documents
with BM25 (`bm25s`); the index is built once and cached on disk next to a fingerprint of the
corpus file, so later constructions load it instead of rebuilding. Results use the format

  1. [Title](url)
  snippet...

Limits (constructor arguments): `top_k` results, `snippet_chars` per result,
`max_query_chars` (longer queries are cut, not rejected), `max_output_chars` per observation.
"""

from __future__ import annotations

import abc
import hashlib
import json
import os
import re
from typing import Any

from tools_env.base import BAD_REQUEST, NO_RESULTS, NOT_FOUND, Tool, ToolFailure

DEFAULT_CORPUS = os.path.join(os.path.dirname(__file__), "data", "corpus.jsonl")


def load_corpus(path: str) -> list[dict[str, str]]:
  """Returns the corpus records; raises ValueError naming the first bad line."""
  if not os.path.isfile(path):
    raise ValueError(f"corpus file {path!r} does not exist")
  docs = []
  with open(path, encoding="utf-8") as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
        docs.append({k: str(record[k]) for k in ("id", "title", "url", "text")})
      except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{path}:{number}: not a {{id, title, url, text}} record ({e})") from None
  if not docs:
    raise ValueError(f"corpus file {path!r} has no documents")
  return docs


def format_results(results: list[tuple[str, str, str]]) -> str:
  """Returns (title, url, snippet) results as the numbered `1. [Title](url)` list."""
  return "\n".join(f"{rank}. [{title}]({url})\n{snippet}"
                   for rank, (title, url, snippet) in enumerate(results, 1))


def _fingerprint(path: str) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      digest.update(chunk)
  return digest.hexdigest()[:16]


def _tokenize(texts: list[str]):
  import bm25s

  return bm25s.tokenize(texts, stopwords="en", show_progress=False)


class Bm25Search(Tool):
  """BM25 search over a local corpus; `__call__(query)` returns ranked snippets."""

  def __init__(self, corpus_path: str = DEFAULT_CORPUS, cache_dir: str | None = None,
               top_k: int = 5, snippet_chars: int = 400, max_query_chars: int = 2000,
               max_output_chars: int = 8000, name: str = "web_search"):
    super().__init__(max_output_chars)
    import bm25s

    self.name, self.top_k, self.snippet_chars = name, top_k, snippet_chars
    self.max_query_chars = max_query_chars
    self.docs = load_corpus(corpus_path)
    cache_dir = cache_dir or os.path.join(os.path.dirname(os.path.abspath(corpus_path)),
                                          ".bm25_cache")
    index_dir = os.path.join(cache_dir, _fingerprint(corpus_path))
    self.loaded_from_cache = os.path.isfile(os.path.join(index_dir, "params.index.json"))
    if self.loaded_from_cache:
      self._index = bm25s.BM25.load(index_dir)
    else:
      self._index = bm25s.BM25()
      self._index.index(_tokenize([f"{d['title']} {d['text']}" for d in self.docs]),
                        show_progress=False)
      os.makedirs(index_dir, exist_ok=True)
      self._index.save(index_dir, show_progress=False)

  def search(self, query: str) -> list[tuple[dict[str, str], float]]:
    """Returns up to top_k (document, score) pairs with a positive score, best first."""
    tokens = _tokenize([query[:self.max_query_chars]])
    if not tokens.vocab or not any(len(ids) for ids in tokens.ids):
      return []
    k = min(self.top_k, len(self.docs))
    ids, scores = self._index.retrieve(tokens, k=k, show_progress=False, n_threads=1,
                                       backend_selection="numpy")
    return [(self.docs[int(i)], float(s)) for i, s in zip(ids[0], scores[0]) if s > 0]

  def _run(self, body: str, goal: str) -> tuple[str, dict[str, Any]]:
    query = body.strip()
    if not query:
      raise ToolFailure(BAD_REQUEST, "empty search query")
    hits = self.search(query)
    if not hits:
      raise ToolFailure(NO_RESULTS, f"no results for {query[:100]!r}")
    text = format_results([(doc["title"], doc["url"], doc["text"][:self.snippet_chars])
                           for doc, _ in hits])
    return text, {"ids": [doc["id"] for doc, _ in hits],
                  "scores": [round(s, 4) for _, s in hits]}


class Crawl(Tool):
  """`crawl_page`: the body holds URLs separated by '|'; subclasses fetch one page with
  `page(url, goal) -> (text, info)`, raising ToolFailure. A failed page is reported inline;
  the call fails (with the first failure's kind) only when every page does."""

  name = "crawl_page"

  def __init__(self, max_urls: int, max_page_chars: int, max_output_chars: int):
    super().__init__(max_output_chars)
    self.max_urls, self.max_page_chars = max_urls, max_page_chars

  @abc.abstractmethod
  def page(self, url: str, goal: str) -> tuple[str, dict[str, Any]]:
    """Returns one page's text and metadata; raises ToolFailure."""

  def _run(self, body: str, goal: str) -> tuple[str, dict[str, Any]]:
    urls = [u.strip() for u in body.split("|") if u.strip()]
    if not urls:
      raise ToolFailure(BAD_REQUEST, "no URL given")
    if len(urls) > self.max_urls:
      raise ToolFailure(BAD_REQUEST, f"{len(urls)} URLs; at most {self.max_urls} per call")
    parts, pages, failures = [], {}, []
    for url in urls:
      try:
        text, info = self.page(url, goal)
      except ToolFailure as e:
        failures.append(e)
        parts.append(f"Page: {url}\nError: {e}")
        continue
      pages[url] = info
      parts.append(f"Page: {url}\n{text}")
    if not pages:
      raise ToolFailure(failures[0].kind, "; ".join(str(e) for e in failures)[:1000])
    return "\n\n".join(parts), {"pages": pages, "failed": [u for u in urls if u not in pages]}


_STOPWORDS = frozenset("the and for from that this with what which who whom how many much does "
                       "have has was were are its".split())


def _words(text: str) -> set[str]:
  return set(re.findall(r"[a-z]{3,}", text.lower())) - _STOPWORDS


def focus(text: str, goal: str) -> str:
  """Returns the sentences of `text` that share the most content words with `goal`, in their
  order (all of them on a tie): an extractive stand-in for a model condensing a page toward the
  goal. The whole text when no sentence shares a word or there is no goal."""
  sentences = re.split(r"(?<=\.)\s+", text.strip())
  wanted = _words(goal)
  scores = [len(_words(s) & wanted) for s in sentences]
  if not wanted or max(scores) == 0:
    return text
  return " ".join(s for s, score in zip(sentences, scores) if score == max(scores))


class LocalCrawl(Crawl):
  """Serves page text from the local corpus by URL; with `focus_on_goal`, only the sentences
  most relevant to the goal (see `focus`)."""

  def __init__(self, corpus_path: str = DEFAULT_CORPUS, max_urls: int = 5,
               max_page_chars: int = 6000, max_output_chars: int = 12000,
               focus_on_goal: bool = False):
    super().__init__(max_urls, max_page_chars, max_output_chars)
    self.pages = {d["url"]: d for d in load_corpus(corpus_path)}
    self.focus_on_goal = focus_on_goal

  def page(self, url: str, goal: str) -> tuple[str, dict[str, Any]]:
    doc = self.pages.get(url)
    if doc is None:
      raise ToolFailure(NOT_FOUND, f"page not found: {url[:200]}")
    text = doc["text"][:self.max_page_chars]
    if self.focus_on_goal:
      text = focus(text, goal)
    return f"{doc['title']}\n\n{text}", {"id": doc["id"]}
