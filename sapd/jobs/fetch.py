"""Job helper: copy one file or a folder from the run's object storage into the pod (the init container
that gives the search-QA retriever its corpus).

Local:   python -m sapd.jobs.fetch s3://bucket/data/corpus.jsonl /scratch/corpus.jsonl
Exit codes: 0 copied, 2 nothing at that URI, 75 storage unreachable (transient: retried).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from sapd import storage


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sapd.jobs.fetch", description=__doc__.splitlines()[0])
    p.add_argument("source", help="a file or folder URI (s3:// or a path)")
    p.add_argument("dest", help="a local file (for a file) or folder (for a folder)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        if not args.source.endswith("/") and storage.exists(args.source):
            storage.download_to(args.source, args.dest)
            n = 1
        else:
            files = storage.list_files(args.source)
            if not files:
                print(f"fetch: error: nothing at {args.source}", file=sys.stderr, flush=True)
                return 2
            base = args.source.rstrip("/") + "/"
            for uri in files:
                storage.download_to(uri, Path(args.dest) / uri[len(base):])
            n = len(files)
    except storage.StorageUnavailable as e:
        print(f"fetch: error: {e}", file=sys.stderr, flush=True)
        return 75
    except storage.StorageError as e:
        print(f"fetch: error: {e}", file=sys.stderr, flush=True)
        return 2
    print(f"fetch: {n} file(s) from {args.source} to {args.dest}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
