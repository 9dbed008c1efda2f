"""`sapd check` (and the preflight of `sapd run`) finds, without training, what would stop a run: data
that does not parse, tokenizers that differ, storage that refuses the credentials or cannot be reached,
a run root holding another config, placeholders a starter config still has; `sapd init` writes a
starter config that `sapd check` accepts once its paths are filled in."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sapd.cli import main
from sapd.config import config_from_dict
from sapd.entry import EXIT_OK, EXIT_UNAVAILABLE, EXIT_USER_ERROR
from sapd.run.check import check_command, run_checks
from tests.pipeline_util import make_models, tiny_config

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_models(tmp_path_factory.mktemp("models"))


def _lines(cfg) -> tuple[int, list[str]]:
    lines: list[str] = []
    return check_command(cfg, log=lines.append), lines


def test_a_good_config_passes_every_check(tmp_path, models):
    cfg = config_from_dict(tiny_config(str(tmp_path / "run"), *models))
    code, lines = _lines(cfg)
    assert code == EXIT_OK, lines
    for name in ("storage", "run root", "data", "student", "teacher", "tokenizers", "memory"):
        assert any(line.startswith(f"check {name}: ok") for line in lines), (name, lines)
    assert any("teacher-scores" in line for line in lines) and any("train" in line for line in lines)
    assert not (tmp_path / "run").exists()  # the storage probe leaves nothing behind


def test_each_failure_is_one_line_and_a_user_error(tmp_path, models):
    student, teacher = models
    from sapd.models.byte_tokenizer import build_tokenizer
    other = build_tokenizer(["another corpus, another vocabulary " * 20], tmp_path / "other-tok", vocab_size=300)
    from sapd.models.tiny import build_tiny_model
    build_tiny_model(other, tmp_path / "other", seed=5)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json\n")
    cfg = config_from_dict(tiny_config(str(tmp_path / "run"), student, str(tmp_path / "other"),
                                       data={"input": str(bad)}))
    code, lines = _lines(cfg)
    assert code == EXIT_USER_ERROR
    failed = [line for line in lines if ": FAILED: " in line]
    assert {line.split(":")[0] for line in failed} == {"check data", "check tokenizers"}, lines
    assert any("bad.json" in line for line in failed)
    # the run root holds another committed config: named with the differing key
    from sapd.config import write_run_config
    write_run_config(config_from_dict(tiny_config(str(tmp_path / "run2"), student, teacher)))
    cfg = config_from_dict(tiny_config(str(tmp_path / "run2"), student, teacher, train={"lr": 0.5}))
    code, lines = _lines(cfg)
    assert code == EXIT_USER_ERROR and any(line.startswith("check run root: FAILED") and "train.lr" in line
                                           for line in lines), lines


def test_memory_that_does_not_fit_names_what_to_lower(tmp_path, models):
    cfg = config_from_dict(tiny_config(str(tmp_path / "run"), *models))
    lines: list[str] = []
    code = check_command(cfg, device_memory_gib=1e-6, log=lines.append)
    assert code == EXIT_USER_ERROR
    assert any(line.startswith("check memory: FAILED") and "micro_batch_prefixes" in line for line in lines), lines
    # half precision is no longer the first remedy (bf16 keeps an fp32 master and moments: it saves less than
    # it seems); checkpointing, smaller micro-batches and a larger device come first
    (line,) = [x for x in lines if x.startswith("check memory: FAILED")]
    remedies = line.split("GiB (")[-1]
    assert "half-precision" not in line and "gradient_checkpointing" in remedies
    assert "bfloat16" not in remedies or remedies.index("gradient_checkpointing") < remedies.index("bfloat16")


@pytest.mark.parametrize("dtype,lr,status,says", [
    ("float32", 1e-6, "ok", "moves float32 weights below 32 in size"),
    # bf16 alone keeps 8 significant bits: an lr-1e-6 step moves only weights below 2^-11 ≈ 4.9e-4
    ("bfloat16", 1e-6, "ok", "fp32 master sapd keeps of the bfloat16 weights below 32 in size; bfloat16 weights "
                             "alone would take it only below 0.00049"),
    # even float32 rounds away updates of 1e-8 to weights from 2^-2 up (half their spacing is 2^-26 ≈ 1.5e-8)
    ("float32", 1e-8, "WARNING", "moves float32 weights only below 0.25 in size: updates to larger weights"),
    ("bfloat16", 1e-9, "WARNING", "moves the fp32 master sapd keeps of the bfloat16 weights only below 0.03125 in size"),
    ("float16", 1e-6, "FAILED", "float16 is not trained: its gradients need dynamic loss scaling"),
])
def test_precision_check_weighs_the_learning_rate_against_the_kept_weights(tmp_path, models, dtype, lr, status, says):
    cfg = config_from_dict(tiny_config(str(tmp_path / "run"), *models, model={"dtype": dtype}, train={"lr": lr}))
    code, lines = _lines(cfg)
    (line,) = [x for x in lines if x.startswith("check precision:")]
    assert line.startswith(f"check precision: {status}") and says in line, line
    assert code == (EXIT_USER_ERROR if status == "FAILED" else EXIT_OK), lines
    # the stage's preflight (quiet: failures only) still shows a warning
    seen: list[str] = []
    outcomes = run_checks(cfg, stage="train", log=seen.append, verbose=False, memory_fails=False)
    assert [x for x in seen if x.startswith("check precision")] == ([] if status == "ok" else [line])
    assert {o.name: o.ok for o in outcomes}["precision"] == (status != "FAILED")


def test_init_then_check_then_run_preflight(tmp_path, models, capsys):
    student, teacher = models
    out = tmp_path / "mine.yaml"
    assert main(["init", "--benchmark", "alfworld", "--out", str(out)]) == 0
    assert main(["init", "--benchmark", "alfworld", "--out", str(out)]) == EXIT_USER_ERROR  # no overwrite
    capsys.readouterr()
    run_root = str(tmp_path / "run")
    assert main(["check", str(out), "--run-root", run_root]) == EXIT_USER_ERROR
    text = capsys.readouterr().out
    assert "data.input: still the starter placeholder" in text and "model.student" in text
    data = yaml.safe_load(out.read_text())
    filled = out.read_text().replace(data["data"]["input"], str(REPO / "sapd" / "sample_data" / "alfworld_eto.json"))
    filled = filled.replace(data["model"]["student"], student).replace(data["model"]["teacher"], teacher)
    out.write_text(filled)
    assert main(["check", str(out), "--run-root", run_root]) == EXIT_OK, capsys.readouterr().out
    # `sapd run` runs the same checks first and stops before any work on a failure
    broken = tmp_path / "broken.yaml"
    broken.write_text(filled.replace(teacher, str(tmp_path / "missing-teacher")))
    assert main(["run", str(broken), "--run-root", str(tmp_path / "run3"), "--no-progress"]) == EXIT_USER_ERROR
    err = capsys.readouterr()
    assert "check teacher: FAILED" in err.out and not (tmp_path / "run3" / "prefixes").exists()


@pytest.mark.integration
def test_storage_credentials_and_reachability_on_real_s3(s3_server, tmp_path, models):
    """Good credentials: the probe is written and deleted; bad ones: a user error; no server: retry later."""
    student, teacher = models
    cfg = tmp_path / "s3.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config(f"s3://{s3_server.bucket}/check-{os.getpid()}", student, teacher)))

    def check(key: str, secret: str, endpoint: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret,
               "SAPD_S3_ENDPOINT_URL": endpoint, "AWS_DEFAULT_REGION": "us-east-1",
               "SAPD_S3_MAX_ATTEMPTS": "1"}
        return subprocess.run([sys.executable, "-m", "sapd.cli", "check", str(cfg)], env=env, cwd=REPO,
                              capture_output=True, text=True, timeout=300)

    ok = check(s3_server.access_key, s3_server.secret_key, s3_server.endpoint_url)
    assert ok.returncode == EXIT_OK, ok.stdout + ok.stderr
    assert "check storage: ok" in ok.stdout
    assert not s3_server.server.client().list_objects_v2(Bucket=s3_server.bucket,
                                                         Prefix=f"check-{os.getpid()}").get("Contents")
    bad = check(s3_server.access_key, "wrong-secret", s3_server.endpoint_url)
    assert bad.returncode == EXIT_USER_ERROR, bad.stdout + bad.stderr
    assert "check storage: FAILED" in bad.stdout
    # a stage's job stops at its checks with the same verdict, one line naming what to fix
    env = {**os.environ, "AWS_ACCESS_KEY_ID": s3_server.access_key, "AWS_SECRET_ACCESS_KEY": "wrong-secret",
           "SAPD_S3_ENDPOINT_URL": s3_server.endpoint_url, "AWS_DEFAULT_REGION": "us-east-1", "SAPD_S3_MAX_ATTEMPTS": "1"}
    job = subprocess.run([sys.executable, "-m", "sapd.jobs.build_prefixes", "--config", str(cfg), "--no-progress"], env=env,
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert job.returncode == EXIT_USER_ERROR, job.stdout + job.stderr
    assert "check storage: FAILED" in job.stdout and job.stderr.startswith("build_prefixes: error: check storage")
    assert "prefixes" not in job.stdout
    from tests.conftest import free_port
    gone = check(s3_server.access_key, s3_server.secret_key, f"http://127.0.0.1:{free_port()}")
    assert gone.returncode == EXIT_UNAVAILABLE, gone.stdout + gone.stderr
    assert "check storage: FAILED" in gone.stdout


def test_checks_run_for_one_stage_only(tmp_path, models):
    cfg = config_from_dict(tiny_config(str(tmp_path / "run"), *models))
    names = [o.name for o in run_checks(cfg, stage="train", log=lambda s: None)]
    assert names == ["storage", "run root", "ranks", "student", "memory", "precision"]


def test_webshop_is_bring_your_own_server_probed_in_seconds(tmp_path, models, monkeypatch, capsys):
    """`SAPD_WEBSHOP_URL=… sapd check run.yaml` for a WebShop run: the server's instruction page answers → ok;
    nothing listening → one FAILED line within seconds and exit 75 (retry later); a server that is not
    WebShop, or a malformed URL → exit 2 (fix the URL)."""
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from tests.conftest import free_port
    from tests.envs.test_alfworld_webshop import _records, _site
    first_page = _site(_records("webshop_eto.json")[0])[("init", "")]  # a recorded goal's instruction page

    class Handler(BaseHTTPRequestHandler):
        page: str | None = first_page

        def do_GET(self):  # noqa: N802
            body = (self.page or "<html><body>a blog</body></html>").encode()
            self.send_response(200 if self.path == "/fixed_0" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    config = tmp_path / "webshop.yaml"
    config.write_text(yaml.safe_dump(tiny_config(str(tmp_path / "run"), *models, data={
        "input": str(REPO / "sapd" / "sample_data" / "webshop_eto.json"), "format": "eto", "benchmark": "webshop"})))

    def check(webshop_url: str) -> tuple[int, list[str], float]:
        monkeypatch.setenv("SAPD_WEBSHOP_URL", webshop_url)
        capsys.readouterr()
        t0 = time.monotonic()
        code = main(["check", str(config)])
        return code, [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("check webshop")], \
            time.monotonic() - t0

    try:
        code, lines, _ = check(url)
        assert code == EXIT_OK and lines == [f"check webshop: ok ({url} answers with WebShop's instruction page)"]
        dead = f"http://127.0.0.1:{free_port()}"  # a port nothing listens on (nor will: not an ephemeral one)
        code, lines, seconds = check(dead)
        assert code == EXIT_UNAVAILABLE and len(lines) == 1 and seconds < 30, (lines, seconds)
        assert lines[0].startswith(f"check webshop: FAILED: {dead} is unreachable (") and "evaluate.webshop.url" in lines[0]
        Handler.page = None  # another web server answers there
        code, lines, _ = check(url)
        assert code == EXIT_USER_ERROR and "answers, but not with WebShop's instruction page" in lines[0]
        code, lines, _ = check(url + "/shop/")
        assert code == EXIT_USER_ERROR and f"{url}/shop/fixed_0 answered HTTP 404: not a WebShop server" in lines[0]
        code, lines, _ = check("webshop.sapd-system:3000")
        assert code == EXIT_USER_ERROR and "'webshop.sapd-system:3000' is not an http(s) URL" in lines[0]
    finally:
        server.shutdown()
        server.server_close()
    # another benchmark does not need the server: no line at all
    code, lines = _lines(config_from_dict(tiny_config(str(tmp_path / "run2"), *models)))
    assert code == EXIT_OK and not any(ln.startswith("check webshop") for ln in lines)


def test_the_webshop_probe_defaults_to_the_adapters_server():
    from sapd.envs.webshop_env import DEFAULT_URL
    from sapd.run.check import WEBSHOP_DEFAULT_URL
    assert WEBSHOP_DEFAULT_URL == DEFAULT_URL


def test_an_unknown_data_format_names_the_file_and_line_that_set_it(tmp_path, models, capsys):
    """data.format is checked against the format registry after loading (the config does not spell the
    list), and the error still names the overlay file and line, as every other config error does."""
    base = tmp_path / "run.yaml"
    base.write_text(yaml.safe_dump(tiny_config(str(tmp_path / "run"), *models), sort_keys=False))
    overlay = tmp_path / "format.yaml"
    overlay.write_text("# the format of my logs\ndata:\n  format: natve\n")
    assert main(["check", str(base), str(overlay)]) == EXIT_USER_ERROR
    failed = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("check data: FAILED")]
    assert len(failed) == 1 and f"{overlay}:3: data.format: unknown format 'natve'" in failed[0], failed
