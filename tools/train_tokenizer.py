"""Train the realistic test tokenizer ("bpe32k", fixtures/tokenizer.py) and write it
gzipped to tests/data/tokenizer-bpe32k.json.gz.

Run by a maintainer when the tokenizer should change (for example after re-recording
tests/data/traffic/ with tools/recorder/), not by the tests: they read the
shipped file. Offline and deterministic for the same corpus and `tokenizers` version;
the corpus is this machine's Python standard library source, this repository's docs and
the recorded traffic (fixtures.tokenizer.bpe32k_corpus), a few seconds on two cores.

    python tools/train_tokenizer.py [--check]   # --check: retrain and compare, write nothing
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fixtures import tokenizer  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="retrain and compare with the shipped file")
    args = ap.parse_args()
    files = tokenizer.bpe32k_corpus()
    chars = sum(len(p.read_text(encoding="utf-8", errors="replace")) for p in files)
    start = time.monotonic()
    text = tokenizer.train_bpe32k(files)
    seconds = time.monotonic() - start
    data = json.loads(text)
    size = len(data["model"]["vocab"]) + len(data["added_tokens"])
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    print(f"corpus: {len(files)} files, {chars / 1e6:.1f} M characters; trained in {seconds:.1f} s; "
          f"vocab {size:,d}; sha256 {digest}")
    if args.check:
        shipped = gzip.decompress(tokenizer.BPE32K_FILE.read_bytes()).decode()
        same = shipped == text
        print("same as the shipped file" if same else "differs from the shipped file "
              f"(sha256 {hashlib.sha256(shipped.encode()).hexdigest()[:16]}): another corpus or "
              "tokenizers version")
        return 0 if same else 1
    # mtime 0: the same tokenizer gives the same bytes
    tokenizer.BPE32K_FILE.write_bytes(gzip.compress(text.encode(), compresslevel=9, mtime=0))
    print(f"wrote {tokenizer.BPE32K_FILE} ({tokenizer.BPE32K_FILE.stat().st_size:,d} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
