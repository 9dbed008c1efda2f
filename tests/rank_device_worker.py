"""One rank of the device-placement check (tests/stages/test_rank_device.py, under ``torchrun`` with 2 processes,
no GPU): the train job's own door, ``sapd.jobs.train.main``, with ``model.device: cuda``. CUDA is stood in for
by recording what this rank asks of it — ``torch.cuda.set_device`` — and the device the train stage passes
to the loader (``sapd.checkpoints.load_checkpoint_model``), where the rank stops: everything up to the
first byte of the model is the real code path. Writes ``{out}.rank{r}.json``."""

from __future__ import annotations

import json
import os
import sys

import torch

from sapd import checkpoints

events: list[list[str]] = []


class Loaded(Exception):
    """The train stage reached the model load: this rank's check is done."""


def set_device(device) -> None:
    d = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    events.append(["set_device", str(d)])


def load_checkpoint_model(root, k, dtype="float32", device="cpu", trainable=False):
    events.append(["load", str(device)])
    raise Loaded


def main(config: str, out: str) -> None:
    torch.cuda.set_device = set_device  # type: ignore[assignment]  # no GPU here: record the call
    checkpoints.load_checkpoint_model = load_checkpoint_model  # type: ignore[assignment]
    from sapd.jobs.train import main as train_main
    try:
        rc = train_main(["--config", config, "--round", "0", "--no-progress"])
    except Loaded:
        rc = None
    with open(f"{out}.rank{os.environ['RANK']}.json", "w") as f:
        json.dump({"local_rank": int(os.environ["LOCAL_RANK"]), "events": events, "rc": rc}, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
