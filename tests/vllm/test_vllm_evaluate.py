"""The evaluate stage with ``sampling.backend: vllm`` (vLLM's CPU build here): a run root whose config says
vllm evaluates its checkpoint through a vLLM engine, the result says so, and greedy episodes equal the HF
backend's on the same checkpoint (fp32). The environment is search QA against sapd's own retriever HTTP
server (the BM25 package is not in this environment: the server ranks by shared words here)."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import pytest
import vllm  # noqa: F401  — fail at collection, never skip, where vLLM is absent

from sapd import checkpoints, layout, storage
from sapd.config import config_from_dict, write_run_config
from sapd.envs.panels import PanelSpec
from sapd.envs.retriever import RetrieverServer, load_corpus
from sapd.models.loading import load_tokenizer
from sapd.models.tiny import build_tiny_model
from sapd.stages.evaluate import evaluate_checkpoint
from tests.tokenizer_util import SAMPLE_DATA, build_test_tokenizer

pytestmark = pytest.mark.vllm
ROWS = SAMPLE_DATA / "searchqa_searchr1.jsonl"


class WordOverlapIndex:
    """What RetrieverServer asks of its index: rows ranked by words shared with the query."""

    def __init__(self, corpus) -> None:
        self.corpus = corpus
        self._words = [set(re.findall(r"\w+", c.lower())) for c in corpus.contents]

    def search(self, queries, topk):
        out = []
        for q in queries:
            words = set(re.findall(r"\w+", q.lower()))
            scored = sorted(((-len(words & w), i) for i, w in enumerate(self._words)))[:topk]
            out.append([(i, float(-s)) for s, i in scored])
        return out


@pytest.fixture(scope="module")
def retriever(tmp_path_factory):
    rows = []
    for line in ROWS.read_text(encoding="utf-8").splitlines():
        for block in re.findall(r"<information>(.*?)</information>", json.loads(line)["response"], re.S):
            for doc in block.strip().splitlines():
                rows.append({"id": f"d{len(rows)}", "contents": doc})
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    server = RetrieverServer(("127.0.0.1", 0), WordOverlapIndex(load_corpus(path)))  # type: ignore[arg-type]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.url
    server.stop(thread)


def _run_root(tmp: Path, backend: str) -> str:
    tok = build_test_tokenizer(tmp / "tokenizer")
    # vLLM's CPU attention needs head_dim 32 (hidden 128 / 4 heads); max_positions bounds the KV cache
    model = build_tiny_model(tok, tmp / "student", hidden_size=128, heads=4, kv_heads=2, intermediate_size=256,
                             layers=2, max_positions=1024)
    root = str(tmp / "run")
    cfg = config_from_dict({"run_root": root, "model": {"student": str(tmp / "student"), "dtype": "float32"},
                            "data": {"benchmark": "searchqa"}, "sampling": {"backend": backend}})
    write_run_config(cfg)
    checkpoints.save_checkpoint(root, 0, model, load_tokenizer(str(tmp / "student")), None)
    return root


def test_evaluation_generates_with_the_runs_vllm_backend(retriever, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: the default is sized for a serving machine
    root = _run_root(tmp_path, "vllm")
    panel = PanelSpec("searchqa", rows=str(ROWS), retriever_url=retriever, limit=2)
    kw = dict(max_new_tokens=16, log=lambda s: None, show_progress=False)
    result = evaluate_checkpoint(root, 0, panel, **kw)
    assert (result["backend"], result["dtype"]) == ("vllm", "float32") and result["overall"]["episodes"] == 2
    vllm_episodes = storage.read_text(storage.join(layout.evals_dir(root, 0), "searchqa.episodes.jsonl"))
    storage.delete_prefix(layout.evals_dir(root, 0))
    hf = evaluate_checkpoint(root, 0, panel, backend="hf", **kw)  # the same checkpoint, greedy, with HF
    assert hf["backend"] == "hf"
    hf_episodes = storage.read_text(storage.join(layout.evals_dir(root, 0), "searchqa.episodes.jsonl"))
    responses = [[s["response"] for s in json.loads(line)["turns"]] for line in vllm_episodes.splitlines()]
    assert responses == [[s["response"] for s in json.loads(line)["turns"]] for line in hf_episodes.splitlines()]
    assert sum(len(r) for r in responses) >= 2
    assert {k: hf[k] for k in ("overall", "by_category")} == {k: result[k] for k in ("overall", "by_category")}
