"""A local BM25 retriever speaking the Search-R1 ``/retrieve`` API, and the client the search-QA
environment uses (docs/FORMATS.md, "Search-R1 rows").

Server: ``python -m sapd.envs.retriever --corpus corpus.jsonl --port 8000`` indexes a JSONL corpus with
``bm25s`` (``pip install bm25s``: numpy only) and serves, on 127.0.0.1 unless told otherwise,

- ``POST /retrieve {"queries": [str], "topk": int, "return_scores": bool}`` →
  ``{"result": [[{"document": {"id", "contents"}, "score"}, …] per query]}`` — with
  ``return_scores`` false each inner list holds the bare documents, as Search-R1's server does;
- ``GET /health`` → ``{"status": "ok", "documents": N, "retriever": "bm25"}``.

A bad request (body not JSON, ``queries`` missing, empty or not strings, ``topk`` not an integer ≥ 1)
is an HTTP 400 with ``{"error": "…"}``. Corpus rows are ``{"id", "contents"}`` with contents
``"\\"Title\\"\\ntext"`` as in Search-R1's wiki dumps, or ``{"id", "title", "text"}`` (turned into the
same contents); ``id`` defaults to the row's 0-based number. A bad row stops loading with an
:class:`~sapd.data.errors.InvalidRecordError` naming file, line and field.

Simplifications: lexical BM25 (Lucene variant, English stop words, lowercase, optional Snowball
stemming through PyStemmer) stands in for Search-R1's default e5 dense retriever; ranking is
deterministic (score descending, ties in corpus order). The whole corpus is held in memory.

Client: :class:`RetrieverClient` talks to this server or to a real Search-R1 one; :func:`format_passages`
renders results exactly as Search-R1's ``_passages2string`` does: ``Doc 1(Title: "X") text\\n…``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Sequence

from sapd.data.errors import InvalidRecordError

DEFAULT_TOPK = 3  # Search-R1's retrieval_topk


# ---------------------------------------------------------------------------------------------------
# corpus and index


@dataclass
class Corpus:
    ids: list[str]
    contents: list[str]  # "\"Title\"\ntext"
    path: str = ""

    def __len__(self) -> int:
        return len(self.ids)

    def document(self, i: int) -> dict[str, str]:
        return {"id": self.ids[i], "contents": self.contents[i]}


def _row_contents(rec: Any, path: str, loc: str) -> str:
    if not isinstance(rec, dict):
        raise InvalidRecordError(path, loc, "", "bad_type", f"expected an object, found {type(rec).__name__}")
    if "contents" in rec:
        if not isinstance(rec["contents"], str) or not rec["contents"].strip():
            raise InvalidRecordError(path, loc, "contents", "bad_type", "'contents' must be a non-empty string")
        return rec["contents"]
    for key in ("title", "text"):
        if not isinstance(rec.get(key), str):
            raise InvalidRecordError(path, loc, key, "missing_field",
                                     f"a corpus row needs 'contents', or 'title' and 'text' (string '{key}' missing)")
    if not rec["text"].strip():
        raise InvalidRecordError(path, loc, "text", "bad_type", "'text' is empty")
    title = rec["title"].strip()
    if not (title.startswith('"') and title.endswith('"') and len(title) >= 2):
        title = f'"{title}"'
    return f"{title}\n{rec['text']}"


def load_corpus(path: str | Path) -> Corpus:
    """Every row of a JSONL corpus (``.jsonl`` or ``.jsonl.gz``); errors name file, line and field."""
    path = str(path)
    ids: list[str] = []
    contents: list[str] = []
    seen: dict[str, int] = {}
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            loc = f"line {n}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise InvalidRecordError(path, loc, "", "malformed_json",
                                         f"malformed JSON at column {e.colno}: {e.msg}") from None
            text = _row_contents(rec, path, loc)
            rid = rec.get("id", len(ids))
            if not isinstance(rid, (str, int)) or isinstance(rid, bool):
                raise InvalidRecordError(path, loc, "id", "bad_type", f"expected str/int, found {type(rid).__name__}")
            rid = str(rid)
            if rid in seen:
                raise InvalidRecordError(path, loc, "id", "duplicate_id", f"id '{rid}' already on line {seen[rid]}")
            seen[rid] = n
            ids.append(rid)
            contents.append(text)
    if not ids:
        raise InvalidRecordError(path, "file", "", "empty_corpus", "the corpus has no rows")
    return Corpus(ids, contents, path)


class BM25Index:
    """BM25 over a :class:`Corpus` (``bm25s``, Lucene scoring). ``search`` is thread-safe."""

    def __init__(self, corpus: Corpus, stemmer: str | None = None) -> None:
        import bm25s

        self.corpus = corpus
        self._stemmer = None
        if stemmer:
            try:
                import Stemmer  # PyStemmer
            except ImportError:
                raise RuntimeError("stemming needs PyStemmer: pip install PyStemmer") from None
            self._stemmer = Stemmer.Stemmer(stemmer)
        self._bm25s = bm25s
        tokens = bm25s.tokenize(corpus.contents, stopwords="en", stemmer=self._stemmer, show_progress=False)
        self._index = bm25s.BM25()
        self._index.index(tokens, show_progress=False)
        self._lock = threading.Lock()

    def search(self, queries: Sequence[str], topk: int) -> list[list[tuple[int, float]]]:
        """(corpus row, score) of the ``topk`` best rows per query: score descending, ties in corpus order."""
        import numpy as np

        k = min(topk, len(self.corpus))
        toks = self._bm25s.tokenize(list(queries), stopwords="en", stemmer=self._stemmer, return_ids=False,
                                    show_progress=False)
        out = []
        for q in toks:
            with self._lock:
                scores = (np.asarray(self._index.get_scores(q), dtype=np.float64) if q
                          else np.zeros(len(self.corpus)))
            if k == len(scores):
                cand = np.arange(k)
            else:  # the k-th largest score; all above it, then ties at it in corpus order
                kth = np.partition(scores, len(scores) - k)[len(scores) - k]
                above = np.flatnonzero(scores > kth)
                cand = np.concatenate([above, np.flatnonzero(scores == kth)[: k - len(above)]])
            order = np.lexsort((cand, -scores[cand]))
            out.append([(int(i), float(scores[i])) for i in cand[order]])
        return out


# ---------------------------------------------------------------------------------------------------
# HTTP server


class RequestError(ValueError):
    """A bad /retrieve request (answered with HTTP 400)."""


def parse_retrieve_request(body: bytes) -> tuple[list[str], int, bool]:
    """``(queries, topk, return_scores)`` of a /retrieve body, or :class:`RequestError`."""
    try:
        req = json.loads(body.decode("utf-8") or "null")
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RequestError(f"request body is not JSON: {e}") from None
    if not isinstance(req, dict):
        raise RequestError("request body must be a JSON object {\"queries\": [...], \"topk\": k}")
    queries = req.get("queries")
    if not isinstance(queries, list):
        raise RequestError("'queries' must be a list of strings")
    if not queries:
        raise RequestError("'queries' is empty")
    for i, q in enumerate(queries):
        if not isinstance(q, str):
            raise RequestError(f"queries[{i}] is a {type(q).__name__}, not a string")
        if not q.strip():
            raise RequestError(f"queries[{i}] is empty")
    topk = req.get("topk", DEFAULT_TOPK)
    if not isinstance(topk, int) or isinstance(topk, bool) or topk < 1:
        raise RequestError(f"'topk' must be an integer >= 1, got {topk!r}")
    return_scores = req.get("return_scores", False)
    if not isinstance(return_scores, bool):
        raise RequestError(f"'return_scores' must be true or false, got {return_scores!r}")
    return queries, topk, return_scores


class RetrieverServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], index: BM25Index, quiet: bool = True) -> None:
        self.index, self.quiet = index, quiet
        super().__init__(address, _Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}"

    def retrieve(self, queries: list[str], topk: int, return_scores: bool) -> dict[str, Any]:
        result = []
        for hits in self.index.search(queries, topk):
            docs = [self.index.corpus.document(i) for i, _ in hits]
            result.append([{"document": d, "score": s} for d, (_, s) in zip(docs, hits)] if return_scores else docs)
        return {"result": result}

    def stop(self, thread: threading.Thread | None = None) -> None:
        self.shutdown()
        self.server_close()
        if thread is not None:
            thread.join(timeout=10)


class _Handler(BaseHTTPRequestHandler):
    server: RetrieverServer
    protocol_version = "HTTP/1.1"

    def _send(self, status: int, payload: dict[str, Any]) -> None:
        body = json.dumps(payload).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self.path.split("?")[0] == "/health":
            self._send(200, {"status": "ok", "documents": len(self.server.index.corpus), "retriever": "bm25"})
        else:
            self._send(404, {"error": f"no such endpoint: GET {self.path} (try POST /retrieve, GET /health)"})

    def do_POST(self) -> None:  # noqa: N802
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        if self.path.split("?")[0] != "/retrieve":
            self._send(404, {"error": f"no such endpoint: POST {self.path} (try POST /retrieve)"})
            return
        try:
            queries, topk, return_scores = parse_retrieve_request(body)
        except RequestError as e:
            self._send(400, {"error": str(e)})
            return
        try:
            self._send(200, self.server.retrieve(queries, topk, return_scores))
        except Exception as e:  # noqa: BLE001 - reported to the client, the server keeps serving
            self._send(500, {"error": f"{type(e).__name__}: {e}"})

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
        if not self.server.quiet:
            super().log_message(format, *args)


def start_retriever(corpus_path: str | Path, host: str = "127.0.0.1", port: int = 0, *,
                    stemmer: str | None = None, quiet: bool = True) -> tuple[RetrieverServer, threading.Thread, str]:
    """Index ``corpus_path`` and serve it from a background thread: ``(server, thread, url)``; port 0
    picks a free one. Stop with :func:`stop_retriever` (or ``server.stop(thread)``)."""
    server = RetrieverServer((host, port), BM25Index(load_corpus(corpus_path), stemmer), quiet=quiet)
    thread = threading.Thread(target=server.serve_forever, name="sapd-retriever", daemon=True)
    thread.start()
    return server, thread, server.url


def stop_retriever(server: RetrieverServer, thread: threading.Thread | None = None) -> None:
    server.stop(thread)


# ---------------------------------------------------------------------------------------------------
# client


class RetrieverError(RuntimeError):
    pass


def format_passages(hits: Sequence[dict[str, Any]]) -> str:
    """Search-R1's ``_passages2string``: ``Doc i(Title: <first line>) <rest>\\n`` per hit (a hit is
    ``{"document": {...}, "score"}`` or a bare document). The title line keeps its quotes.

    >>> format_passages([{"document": {"id": "1", "contents": '"Mars"\\nMars is red.'}, "score": 1.0}])
    'Doc 1(Title: "Mars") Mars is red.\\n'
    """
    out = []
    for i, hit in enumerate(hits, start=1):
        doc = hit.get("document", hit)
        title, _, text = doc["contents"].partition("\n")
        out.append(f"Doc {i}(Title: {title}) {text}\n")
    return "".join(out)


class RetrieverClient:
    """A Search-R1 ``/retrieve`` endpoint. ``url`` is the server root (``http://host:port``) or the
    endpoint itself; results are lists of ``{"document": {"id", "contents"}, "score"}``."""

    def __init__(self, url: str, topk: int = DEFAULT_TOPK, timeout: float = 30.0) -> None:
        url = url.rstrip("/")
        self.url = url if url.endswith("/retrieve") else url + "/retrieve"
        self.topk, self.timeout = topk, timeout

    def search_batch(self, queries: Sequence[str], topk: int | None = None) -> list[list[dict[str, Any]]]:
        queries = list(queries)
        payload = {"queries": queries, "topk": topk or self.topk, "return_scores": True}
        req = urllib.request.Request(self.url, data=json.dumps(payload).encode("utf-8"), method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                data = json.loads(resp.read().decode("utf-8"))
        except urllib.error.HTTPError as e:
            detail = e.read().decode("utf-8", "replace")[:500]
            raise RetrieverError(f"retriever {self.url} answered HTTP {e.code}: {detail}") from None
        except (urllib.error.URLError, OSError, json.JSONDecodeError) as e:
            raise RetrieverError(f"retriever {self.url} unreachable or unreadable: {e}") from None
        result = data.get("result") if isinstance(data, dict) else None
        if not isinstance(result, list) or len(result) != len(queries):
            raise RetrieverError(f"retriever {self.url}: expected {{'result': [one list per query]}}, "
                                 f"got {str(data)[:200]}")
        # a server asked for scores may still send bare documents: normalise to {"document", "score"}
        return [[h if "document" in h else {"document": h, "score": None} for h in hits] for hits in result]

    def search(self, query: str, topk: int | None = None) -> list[dict[str, Any]]:
        return self.search_batch([query], topk)[0]

    def information(self, query: str, topk: int | None = None) -> str:
        """The text Search-R1 puts between ``<information>`` tags for ``query`` (stripped, as the
        Search-R1 loader records it)."""
        return format_passages(self.search(query, topk)).strip()

    def health(self) -> dict[str, Any]:
        root = self.url[: -len("/retrieve")]
        try:
            with urllib.request.urlopen(root + "/health", timeout=self.timeout) as resp:
                return json.loads(resp.read().decode("utf-8"))
        except (urllib.error.URLError, OSError, json.JSONDecodeError) as e:
            raise RetrieverError(f"retriever {root}/health: {e}") from None


# ---------------------------------------------------------------------------------------------------
# command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sapd.envs.retriever",
                                description="Serve a BM25 index of a JSONL corpus on the Search-R1 /retrieve API.")
    p.add_argument("--corpus", required=True, help="JSONL(.gz) rows {id, contents} or {id, title, text}")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (0 = any free one)")
    p.add_argument("--stemmer", default=None, help="Snowball stemmer language, e.g. english (needs PyStemmer)")
    p.add_argument("--log-requests", action="store_true", help="log every request")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        index = BM25Index(load_corpus(args.corpus), args.stemmer)
    except (InvalidRecordError, OSError, RuntimeError) as e:
        print(f"error: {e}")
        return 2
    server = RetrieverServer((args.host, args.port), index, quiet=not args.log_requests)
    print(f"serving {len(index.corpus)} documents from {args.corpus} at {server.url}/retrieve", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
