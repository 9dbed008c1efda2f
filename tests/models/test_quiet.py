"""Transformers' notices a user cannot act on are not printed: not at load (a model folder whose
generation_config.json sets sampling flags without ``do_sample``, as many published models do), not
when sampling or scoring with the HF backend, not when its checkpoint is written and loaded again.
Fixed at the source (a consistent generation config, attention masks and pad ids passed), never by
lowering transformers' log level."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from tests.pipeline_util import make_models

REPO = Path(__file__).resolve().parents[2]
NOTICES = ("pad_token_id", "not valid and may be ignored", "attention mask", "GenerationConfig is invalid",
           "generation flags", "Setting accelerator")

SCRIPT = r"""
import sys
from sapd import checkpoints, layout
from sapd.models.generation import HFGenerator, SamplingParams
from sapd.models.loading import load_causal_lm, load_tokenizer
from sapd.models.scoring import response_logprobs
student, teacher, root = sys.argv[1:4]
tok = load_tokenizer(student)
model, judge = load_causal_lm(student), load_causal_lm(teacher)
prompt = tok.apply_chat_template([{"role": "user", "content": "go north"}], tokenize=False, add_generation_prompt=True)
(samples,) = HFGenerator(model, tok, prompts_per_batch=1).generate([prompt], SamplingParams(n=2, max_new_tokens=6))
ids = tok(prompt, add_special_tokens=False)["input_ids"]
logp, mask = response_logprobs(judge, [ids, ids], [s.token_ids for s in samples], pad_id=tok.pad_token_id)
assert logp.shape[0] == 2 and bool(mask.any())
checkpoints.save_checkpoint(root, 0, model, tok, None, {"source": student})
again = load_causal_lm(layout.checkpoint_model_dir(root, 0))
print("sampled", [len(s.token_ids) for s in samples], "generation config", again.generation_config.to_diff_dict())
"""


def test_sampling_scoring_and_saving_print_no_notices(tmp_path):
    student, teacher = make_models(tmp_path / "models")
    for folder in (student, teacher):  # what published instruct models often ship: sampling flags, greedy
        f = Path(folder) / "generation_config.json"
        gen = json.loads(f.read_text()) if f.is_file() else {}
        gen.update({"do_sample": False, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "length_penalty": 0.9})
        gen.pop("pad_token_id", None)
        f.write_text(json.dumps(gen))
    shutil.copy(Path(student) / "generation_config.json", tmp_path / "original.json")
    run = subprocess.run([sys.executable, "-c", SCRIPT, student, teacher, str(tmp_path / "run")], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "sampled" in run.stdout
    lines = [line for line in run.stderr.splitlines() if "Loading weights" not in line and line.strip()]
    assert not [line for line in lines if any(n in line for n in NOTICES)], lines
    # the flags transformers would ignore are dropped from the checkpoint's config; the user's file is kept
    saved = json.loads((tmp_path / "run" / "checkpoints" / "000000" / "model" / "generation_config.json").read_text())
    assert not {"temperature", "top_p", "top_k", "length_penalty"} & set(saved)
    assert json.loads((Path(student) / "generation_config.json").read_text())["temperature"] == 0.7
